"""The eval metrics (``rlkit.eval.metrics``) against values worked out by hand, and in-training validation
reporting exactly what ``rlkit eval``'s metric function reports for the same generations."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlkit.batch import Batch
from rlkit.eval.metrics import (
    Samples,
    answer_of,
    core_metrics,
    eval_metrics,
    ks_for,
    majority_correct,
    pass_at_k,
    samples_from,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct one
        (5, 2, 1, 0.4),  # pass@1 = c / n
        (4, 0, 4, 0.0),
        (10, 3, 5, 1 - 21 / 252),  # C(7,5) = 21, C(10,5) = 252
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_majority_and_answers():
    assert majority_correct(["3", "4", "4", "7"], [True, False, False, False]) == 0.0  # "4" wins, wrong
    assert majority_correct(["3", "4"], [True, False]) == 1.0  # a tie: the first given ("3") wins
    assert majority_correct([None, None], [True, True]) == 0.0  # no answer, no vote
    assert majority_correct([None, "5"], [False, True]) == 1.0
    assert answer_of("so 1,234 apples, then 12.50 and finally 7.0") == "7"
    assert answer_of("12.50") == "12.5" and answer_of("none") is None and answer_of("-3") == "-3"
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def two_sources() -> Samples:
    """Source a: prompt p0 scores 1 0 0 0 (answers 3 4 4 7; 3 is right), p1 scores 1 1 0 0 (answers
    12 12 5 5). Source b: one prompt, all 0, no number anywhere. Lengths out of max 8; the two 8s of p0 and
    one of p1 truncated."""
    return Samples(
        data_source=["a"] * 8 + ["b"] * 4,
        group=["p0"] * 4 + ["p1"] * 4 + ["q"] * 4,
        score=[1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
        length=[2, 8, 8, 3, 8, 1, 1, 1, 4, 4, 4, 4],
        truncated=[False, True, True, False, True, False, False, False, False, False, False, False],
        response=["x = 3", "4", "it is 4", "7", "12", "12", "5", "5", "no", "no", "no", "no"],
    )


def test_eval_metrics_by_hand():
    m = {k: e.value for k, e in eval_metrics(two_sources(), 4, seed=0).items()}
    assert m["val-core/a/score/mean@4"] == 3 / 8
    assert m["val-core/a/score/best@4"] == 1.0
    assert m["val-core/a/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["val-core/a/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["val-core/a/pass@4"] == 1.0
    # maj@1: each prompt's first answer (3, 12) is right; maj@2: (3 | 4 tie -> 3), (12, 12);
    # maj@4: 4 wins p0, 12 wins p1
    assert (m["val-core/a/maj@1"], m["val-core/a/maj@2"], m["val-core/a/maj@4"]) == (1.0, 1.0, 0.5)
    assert m["val-aux/a/response_length/mean"] == pytest.approx((5.25 + 2.75) / 2)
    assert (m["val-aux/a/response_length/max"], m["val-aux/a/response_length/min"]) == (8.0, 1.0)
    assert m["val-aux/a/truncation_rate"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert m["val-core/b/score/mean@4"] == 0.0 and m["val-core/b/pass@4"] == 0.0
    assert "val-core/b/maj@1" not in m  # no answer could be extracted in source b


def test_bootstrap_intervals_are_seeded_and_bracket_the_value():
    a = eval_metrics(two_sources(), 4, seed=3)
    b = eval_metrics(two_sources(), 4, seed=3)
    assert a == b
    e = a["val-core/a/pass@2"]
    assert e.ci_low <= e.value <= e.ci_high and e.se > 0
    # two prompts with pass@2 of 1/2 and 5/6: every resample's mean is one of 1/2, 2/3, 5/6
    assert e.ci_low == pytest.approx(0.5) and e.ci_high == pytest.approx(5 / 6)
    flat = a["val-core/b/score/mean@4"]
    assert (flat.ci_low, flat.ci_high, flat.se) == (0.0, 0.0, 0.0)


def test_the_scorers_answer_and_acc_win_over_the_last_number_and_the_score():
    s = Samples(
        ["a"] * 2, ["p"] * 2, [0.0, 0.0], {"pred": ["3", "3"], "acc": [True, True]}, response=["7", "8"]
    )
    m = eval_metrics(s, 2)
    assert s.answers() == ["3", "3"] and m["val-core/a/maj@2"].value == 1.0  # acc says right, pred "3" votes
    assert m["val-core/a/pass@1"].value == 1.0 and m["val-core/a/score/mean@2"].value == 0.0


def test_samples_from_a_generation():
    """eos id 2, width 4: row 0 ends at its eos, row 1 fills the width (truncated), row 2 fills it and
    ends on eos."""
    responses = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 6, 7, 2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    scores = torch.zeros(3, 4)
    scores[0, 2], scores[1, 3] = 1.0, 0.5
    batch = Batch(
        {"responses": responses, "response_mask": mask}, {"data_source": ["a"] * 3, "uid": ["u"] * 3}
    )
    s = samples_from(
        batch, SimpleNamespace(token_level_scores=scores, extra={"acc": [True, False, False]}), [2]
    )
    assert s.length == [3, 4, 4] and s.truncated == [False, True, False]
    assert s.score == [1.0, 0.5, 0.0] and s.extra == {"acc": [True, False, False]}


def test_validation_reports_what_the_eval_metric_function_reports(tmp_path):
    """The validation phase on fake generations (n=3, sampled) equals ``eval_metrics`` on the very batches it
    scored, key for key (training's keys are a subset of eval's)."""
    from rlkit.recipe.validate import validate_recipe
    from rlkit.step.context import StepContext
    from rlkit.step.validation import validate
    from rlkit.testing.fakes import FakeRuntime

    raw = {
        "model": {"path": "fake-model"},
        "data": {
            "train_files": ["f.parquet"],
            "max_response_length": 6,
            "max_prompt_length": 8,
            "train_batch_size": 4,
        },
        "rollout": {"n": 2, "val": {"n": 3, "do_sample": True}},
    }
    recipe = validate_recipe(raw, [], check_files=False)
    rt = FakeRuntime(recipe, tmp_path, prompts=5)
    rt.val_loader = [rt.prompts(), rt.prompts()]
    rt.val_loader[1]["data_source"] = ["other"] * 5
    rt.tokenizer = SimpleNamespace(
        pad_token_id=0, eos_token_id=2, decode=lambda ids: " ".join(map(str, ids.tolist()))
    )
    scored = []
    reward = rt.reward
    rt.reward = lambda batch: scored.append((batch, reward(batch))) or scored[-1][1]
    metrics = validate(StepContext(recipe, rt, 1))

    offline = Samples([], [], [])
    for batch, result in scored:
        offline.extend(samples_from(batch, result, [2]))
    evaluated = eval_metrics(offline, 3)
    assert set(metrics) == {
        "val-core/fake/score/mean@3",
        "val-core/fake/score/best@3",
        "val-core/fake/parity/mean@3",
        "val-core/fake/parity/best@3",
        "val-core/other/score/mean@3",
        "val-core/other/score/best@3",
        "val-core/other/parity/mean@3",
        "val-core/other/parity/best@3",
    }
    assert metrics == {k: evaluated[k].value for k in metrics}
    assert metrics == core_metrics(offline, 3)
    first = scored[0][1].token_level_scores.sum(-1)
    assert metrics["val-core/fake/score/mean@3"] == pytest.approx(float(first.mean()))
