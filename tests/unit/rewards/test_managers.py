"""Reward managers (placement, bad score functions, batch/parallel) and the reward step after them
(reward-model scores, overlong shaping)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
import torch

from rlkit.errors import RlkitError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries, load_object
from rlkit.recipe.compose import resolve
from rlkit.rewards.dispatch import ScoreDispatcher, batched
from rlkit.rewards.managers import BatchRewardManager, NaiveRewardManager, RewardManager, normalize_score
from rlkit.rewards.parallel import ParallelRewardManager
from rlkit.rewards.steps import OverlongShaping, RewardStep


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


@pytest.fixture(scope="module")
def dispatcher(registries):
    return ScoreDispatcher(registries)


def build_manager(registries, component, tokenizer, score_fn, **kwargs):
    """A manager as the driver builds it: the recipe's component resolved, its params model passed as
    ``params=``."""
    resolved, problems = resolve("reward.manager", "reward_managers", component, registries)
    assert not problems, problems
    return resolved.build(tokenizer, score_fn, **kwargs)


def parallel(registries, tokenizer, score_fn, num_workers, **kwargs):
    return build_manager(
        registries, {"name": "parallel", "num_workers": num_workers}, tokenizer, score_fn, **kwargs
    )


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    """The first word of the response says how to misbehave."""
    word = solution_str.split()[0]
    if word == "sleep":
        time.sleep(30)
    if word == "crash":
        os._exit(3)
    if word == "raise":
        raise ValueError("scorer exploded")
    return {
        "nan": math.nan,
        "none": None,
        "str": "1.0",
        "dict": {"acc": 1},
        "ok": {"score": 0.75, "acc": True},
    }.get(word, 1.0)


def test_naive_places_score_on_last_valid_token(tokenizer, make_batch, dispatcher):
    batch = make_batch(["the answer is #### 12", "#### 3", "#### 4"], ["12", "3", "5"], width=8)
    result = NaiveRewardManager(tokenizer, dispatcher)(batch)
    # Lengths with eos: 6, 3, 3 -> scores at positions 5, 2, 2.
    expected = torch.zeros(3, 8)
    expected[0, 5], expected[1, 2] = 1.0, 1.0
    assert torch.equal(result.token_level_scores, expected)
    assert result.token_level_scores.shape == batch["responses"].shape
    assert result.metrics == {
        "reward/errors": 0.0,
        "reward/timeouts": 0.0,
        "reward/score/mean": pytest.approx(2 / 3),
    }


def test_mask_with_holes_uses_the_last_one(tokenizer, make_batch, dispatcher):
    batch = make_batch(["#### 3"], ["3"], width=6)
    batch["response_mask"] = torch.tensor([[1, 0, 1, 0, 0, 0]])  # e.g. a masked tool turn
    assert NaiveRewardManager(tokenizer, dispatcher)(batch).token_level_scores[0].tolist() == [
        0,
        0,
        1,
        0,
        0,
        0,
    ]


@pytest.mark.parametrize("manager_cls", [NaiveRewardManager, ParallelRewardManager])
def test_bad_scores_get_the_default_and_are_counted(tokenizer, make_batch, manager_cls, caplog):
    texts = ["raise", "nan", "none", "str", "dict", "ok", "1"]
    batch = make_batch(texts, ["x"] * len(texts), data_source="my/source")
    manager = manager_cls(tokenizer, misbehaving, default_score=-1.0)
    with caplog.at_level(logging.WARNING, logger="rlkit.rewards"):
        result = manager(batch)
    scores = result.token_level_scores.sum(1).tolist()
    assert scores == [-1.0, -1.0, -1.0, -1.0, -1.0, 0.75, 1.0]
    assert result.metrics["reward/errors"] == 5.0 and result.metrics["reward/timeouts"] == 0.0
    assert result.extra == {"acc": [None, None, None, None, 1, True, None]}
    assert "5 of 7 samples got the default score -1.0" in caplog.text
    assert "first, data_source 'my/source': raised ValueError: scorer exploded" in caplog.text
    if isinstance(manager, ParallelRewardManager):
        manager.close()


def test_normalize_score_cases():
    assert normalize_score(1, 0.0).score == 1.0
    assert normalize_score(torch.tensor(0.5), 0.0).score == 0.5
    assert normalize_score(math.inf, 0.0).error == "returned inf, not a finite number"
    assert normalize_score("1.0", 0.0).error == "returned str '1.0', not a number"
    assert normalize_score({"acc": 1}, 0.0).error.startswith("returned a dict without a 'score' key")


def test_batch_manager(tokenizer, make_batch, dispatcher, tmp_path):
    batch = make_batch(["#### 3", "#### 4"], ["3", "5"])
    log_file = tmp_path / "calls.jsonl"

    def score_batch(**kwargs):  # runs in the scoring child: it records its calls in a file
        with log_file.open("a") as f:
            f.write(json.dumps(kwargs) + "\n")
        return batched(dispatcher)(**{k: v for k, v in kwargs.items()})

    result = BatchRewardManager(tokenizer, lambda **kw: score_batch(**kw))(batch)
    assert result.token_level_scores.sum(1).tolist() == [1.0, 0.0]
    calls = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["solution_strs"] == ["#### 3", "#### 4"]
    assert calls[0]["ground_truths"] == ["3", "5"] and calls[0]["data_sources"] == ["openai/gsm8k"] * 2
    short = BatchRewardManager(tokenizer, lambda **kw: [1.0], default_score=0.1)(batch)
    assert short.token_level_scores.sum(1).tolist() == pytest.approx([0.1, 0.1])
    assert short.metrics["reward/errors"] == 2.0


@pytest.mark.parametrize("manager_cls", [NaiveRewardManager, BatchRewardManager])
def test_overlong_shaping_after_any_manager(tokenizer, make_batch, dispatcher, manager_cls):
    # max length 8, buffer 4: no penalty up to 4 tokens, then -factor * (L - 4) / 4.
    texts = ["#### 3", "the answer is #### 3", "the answer is 1 2 #### 3"]  # + eos: 3, 6, 8 tokens
    batch = make_batch(texts, ["3"] * 3, width=8)
    score_fn = batched(dispatcher) if manager_cls is BatchRewardManager else dispatcher
    step = RewardStep(
        manager_cls(tokenizer, score_fn),
        overlong=OverlongShaping(buffer_len=4, penalty_factor=1.0, max_response_length=8),
    )
    result = step(batch)
    assert result.token_level_scores.sum(1).tolist() == [1.0, 0.5, 0.0]  # 1 - 0, 1 - 2/4, 1 - 4/4
    # the shaped score stays on the last valid token (positions 2, 5, 7)
    assert result.token_level_scores[[0, 1, 2], [2, 5, 7]].tolist() == [1.0, 0.5, 0.0]
    assert result.extra["overlong_reward"] == [0.0, -0.5, -1.0]
    assert result.extra["overlong"] == [False, True, True]
    assert result.metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert result.metrics["reward/overlong_ratio"] == pytest.approx(2 / 3)
    off = RewardStep(manager_cls(tokenizer, score_fn))(batch)
    assert off.token_level_scores.sum(1).tolist() == [1.0, 1.0, 1.0]
    assert "overlong_reward" not in off.extra


@pytest.mark.parametrize("buffer_len", [0, 9])
def test_overlong_buffer_must_fit_the_response(buffer_len):
    with pytest.raises(
        RlkitError, match=r"reward.overlong_buffer.len must be in \(0, max response length=8\]"
    ):
        OverlongShaping(buffer_len=buffer_len, penalty_factor=1.0, max_response_length=8)


def test_reward_model_scores_sum(tokenizer, make_batch, dispatcher):
    batch = make_batch(["#### 3", "#### 4"], ["3", "3"], rm_scores=torch.tensor([0.25, -0.5]))
    plain = NaiveRewardManager(tokenizer, dispatcher)(batch)
    assert plain.token_level_scores.sum(1).tolist() == [1.0, 0.0]  # managers leave rm_scores alone
    result = RewardStep(NaiveRewardManager(tokenizer, dispatcher), reward_model="sum")(batch)
    assert result.token_level_scores.sum(1).tolist() == [1.25, -0.5]  # 1 + 0.25, 0 - 0.5
    assert result.metrics["reward/rm_scores/mean"] == pytest.approx(-0.125)
    assert result.metrics["reward/rm_scores/used_fraction"] == 1.0
    assert result.extra["rm_score"] == [0.25, -0.5]
    no_rule = RewardStep(NaiveRewardManager(tokenizer, None), reward_model="sum")(batch)
    assert no_rule.token_level_scores.sum(1).tolist() == [0.25, -0.5]


def test_reward_model_scores_fallback(tokenizer, make_batch, registries):
    # gsm8k has a rule (1.0 for the right answer), my/rm-only has none: the model's score is used there.
    batch = make_batch(
        ["#### 3", "#### 4"],
        ["3", "3"],
        data_source=["openai/gsm8k", "my/rm-only"],
        rm_scores=torch.tensor([0.25, -0.5]),
    )
    dispatcher = ScoreDispatcher(registries, unknown_score=0.0)
    step = RewardStep(
        NaiveRewardManager(tokenizer, dispatcher), reward_model="fallback", has_rule=dispatcher.has_rule
    )
    result = step(batch)
    assert result.token_level_scores.sum(1).tolist() == [1.0, -0.5]
    assert result.metrics["reward/rm_scores/used_fraction"] == 0.5 and result.metrics["reward/errors"] == 0.0
    # fallback and overlong shaping compose: the penalty lands on whichever score was chosen (2 tokens + eos =
    # 3)
    shaped = RewardStep(
        NaiveRewardManager(tokenizer, dispatcher),
        reward_model="fallback",
        has_rule=dispatcher.has_rule,
        overlong=OverlongShaping(buffer_len=2, penalty_factor=1.0, max_response_length=4),
    )(batch)
    assert shaped.token_level_scores.sum(1).tolist() == [0.5, -1.0]  # -(3 - 2) / 2 each
    # no reward model: rm_scores ignored
    without = RewardStep(NaiveRewardManager(tokenizer, dispatcher))(batch)
    assert without.token_level_scores.sum(1).tolist() == [1.0, 0.0]


def test_manager_params_go_through_the_params_model(tokenizer, registries, dispatcher):
    _, problems = resolve(
        "reward.manager", "reward_managers", {"name": "naive", "num_workers": 2}, registries
    )
    assert (
        problems
        and problems[0][0] == "reward.manager.num_workers"
        and "takes no parameters" in problems[0][1]
    )
    _, problems = resolve(
        "reward.manager", "reward_managers", {"name": "parallel", "num_workers": 0}, registries
    )
    assert problems and problems[0][0] == "reward.manager.num_workers" and "greater than 0" in problems[0][1]
    with parallel(registries, tokenizer, dispatcher, 3, timeout_s=3.0) as manager:
        assert manager.params.num_workers == 3 and manager.score_workers == 3 and manager.timeout_s == 3.0
    with pytest.raises(RlkitError, match="reward.timeout_s must be > 0"):
        NaiveRewardManager(tokenizer, dispatcher, timeout_s=0)


class CountingManager(NaiveRewardManager.__mro__[1]):
    """A third-party manager written against the base class only: its own ``score_all``, no timeout code."""

    def score_all(self, items):
        from rlkit.rewards.managers import normalize_score

        return [normalize_score(self.score_fn(*item), self.default_score) for item in items]


@pytest.mark.parametrize("manager_cls", [NaiveRewardManager, ParallelRewardManager])
def test_a_hanging_scorer_times_out_per_sample_under_every_per_sample_manager(
    tokenizer, make_batch, manager_cls
):
    """A score that sleeps 30 s, timeout 0.5 s: that sample gets the default and is counted; the rest are
    scored."""
    batch = make_batch(["1", "sleep", "2"], ["x"] * 3, data_source="my/source")
    with manager_cls(tokenizer, misbehaving, timeout_s=0.5, default_score=-1.0) as manager:
        result = manager(batch)
        assert result.token_level_scores.sum(1).tolist() == [1.0, -1.0, 1.0]
        assert result.metrics["reward/timeouts"] == 1.0 and result.metrics["reward/errors"] == 0.0
        again = manager(make_batch(["3"], ["x"], data_source="my/source"))  # the killed child was replaced
        assert again.token_level_scores.sum(1).tolist() == [1.0] and again.metrics["reward/timeouts"] == 0.0


@pytest.mark.parametrize("manager_cls", [BatchRewardManager, CountingManager])
def test_a_hanging_batch_call_gives_every_sample_the_default(tokenizer, make_batch, manager_cls):
    """``batch`` (and a plugin manager, whose default scope is the batch): one timeout for the whole call."""
    fn = batched(misbehaving) if manager_cls is BatchRewardManager else misbehaving
    batch = make_batch(["1", "sleep", "2"], ["x"] * 3, data_source="my/source")
    with manager_cls(tokenizer, fn, timeout_s=0.5, default_score=-1.0) as manager:
        result = manager(batch)
        assert result.token_level_scores.sum(1).tolist() == [-1.0, -1.0, -1.0]
        assert result.metrics["reward/timeouts"] == 3.0
        assert manager(make_batch(["3"], ["x"], data_source="my/source")).token_level_scores.sum(
            1
        ).tolist() == [1.0]


def test_a_killed_driver_leaves_no_scoring_child(tokenizer, make_batch, tmp_path):
    """The scoring children die with the process that started them (PR_SET_PDEATHSIG), even mid-call."""
    import subprocess
    import sys

    import psutil

    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"  # noqa: UP031 - a script template
        "sys.path.insert(0, %r)\nfrom conftest import build_tokenizer\nfrom "
        "rlkit.rewards.managers import NaiveRewardManager\nfrom test_managers "
        "import misbehaving\nimport torch\nfrom rlkit.batch import Batch\ntok = "
        "build_tokenizer()\nids = tok('sleep', "
        "add_special_tokens=False)['input_ids']\nb = Batch({'responses': "
        "torch.tensor([ids]), 'response_mask': torch.ones(1, len(ids), "
        "dtype=torch.long)}, {'data_source': ['s'], 'reward_model': "
        "[{'ground_truth': 'x'}], 'extra_info': [None]})\nm = "
        "NaiveRewardManager(tok, misbehaving, timeout_s=60)\nprint('scoring', "
        "flush=True)\nm(b)\n" % str(Path(__file__).parent)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "scoring"
        deadline = time.monotonic() + 30
        children = []
        while not children and time.monotonic() < deadline:
            children = psutil.Process(proc.pid).children()
            time.sleep(0.05)
        assert children, "the scoring child did not start"
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"scoring children outlived the killed driver: {alive}"


def test_num_examine_prints(tokenizer, make_batch, dispatcher, capsys):
    batch = make_batch(
        ["#### 3", "#### 4", "5"], ["3", "4", "5"], data_source=["gsm8k", "gsm8k", "arithmetic"]
    )
    NaiveRewardManager(tokenizer, dispatcher, num_examine=1)(batch)
    out = capsys.readouterr().out
    assert "[gsm8k] response: '#### 3'" in out and "[arithmetic] response: '5'" in out
    assert "#### 4" not in out


def test_parallel_timeout_does_not_stall_the_batch(tokenizer, make_batch, registries):
    texts = ["sleep", "1", "sleep", "2", "3", "4"]
    batch = make_batch(texts, ["x"] * 6, data_source="my/source")
    with parallel(registries, tokenizer, misbehaving, 2, timeout_s=1.0) as manager:
        manager(make_batch(["1"], ["x"], data_source="my/source"))  # start the workers
        start = time.monotonic()
        result = manager(batch)
        elapsed = time.monotonic() - start
        print(f"batch with 2 sleeping scorers, timeout 1.0 s, 2 workers: {elapsed:.2f} s")
        assert elapsed < 1.0 + 1.5
        assert result.metrics["reward/timeouts"] == 2.0 and result.metrics["reward/errors"] == 0.0
        assert result.token_level_scores.sum(1).tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        # The pool recovered: the next batch is scored normally and quickly.
        start = time.monotonic()
        again = manager(make_batch(["1", "2", "3"], ["x"] * 3, data_source="my/source"))
        assert again.token_level_scores.sum(1).tolist() == [1.0, 1.0, 1.0] and time.monotonic() - start < 1.0


def test_parallel_survives_a_crashing_worker(tokenizer, make_batch, registries):
    with parallel(registries, tokenizer, misbehaving, 2, timeout_s=5.0, default_score=-2.0) as manager:
        result = manager(make_batch(["crash", "1", "2"], ["x"] * 3, data_source="my/source"))
    assert result.token_level_scores.sum(1).tolist() == [-2.0, 1.0, 1.0]
    assert result.metrics["reward/errors"] == 1.0


def test_parallel_matches_naive_on_real_scores(tokenizer, make_batch, registries, dispatcher):
    batch = make_batch(
        ["#### 3", "#### 4", "the answer is 12"],
        ["3", "5", "12"],
        data_source=["gsm8k", "gsm8k", "arithmetic"],
    )
    with parallel(registries, tokenizer, dispatcher, 2) as manager:
        in_pool = manager(batch)
    naive = NaiveRewardManager(tokenizer, dispatcher)(batch)
    assert torch.equal(in_pool.token_level_scores, naive.token_level_scores)


def test_registered_managers_resolve(registries):
    assert registries.reward_managers.names() == ["batch", "naive", "parallel"]
    for entry in registries.reward_managers:
        assert issubclass(load_object(entry.spec.cls), RewardManager)
    assert registries.reward_managers.get("batch").batched_scores
    assert not registries.reward_managers.get("naive").batched_scores


def test_parallel_runs_a_custom_score_file(tokenizer, make_batch, tmp_path, registries):
    from rlkit.rewards.dispatch import load_custom_score

    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return "
        "len(solution_str)\n"
    )
    fn = load_custom_score(path, "compute_score")
    with parallel(registries, tokenizer, fn, 1) as manager:
        result = manager(make_batch(["1 2 3", "4"], ["x", "x"], data_source="anything"))
    assert result.token_level_scores.sum(1).tolist() == [5.0, 1.0]


def test_every_manager_builds_as_the_driver_builds_it(tokenizer, make_batch, registries, dispatcher):
    """Each registered manager, built from its resolved component with the recipe's common arguments,
    scores the same batch the same way (batched managers get the batched score function)."""
    batch = make_batch(["#### 3", "#### 4"], ["3", "5"])
    for name in registries.reward_managers.names():
        spec = registries.reward_managers.get(name)
        score_fn = batched(dispatcher) if spec.batched_scores else dispatcher
        manager = build_manager(
            registries, name, tokenizer, score_fn, num_examine=0, default_score=-1.0, timeout_s=3.0
        )
        try:
            assert manager.default_score == -1.0 and manager.timeout_s == 3.0
            assert manager(batch).token_level_scores.sum(1).tolist() == [1.0, 0.0], name
        finally:
            getattr(manager, "close", lambda: None)()
