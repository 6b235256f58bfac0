"""The bad-input corpus, seen as a user sees it: `rlkit validate` / `rlkit run` exit 1 with one message that
names what is wrong and where (recipe key, data file and row, plugin package) and no traceback; nothing
is started (no Ray session) for input refused up front.

Most cases call the CLI's ``main(argv)`` in this process (the exact code `rlkit` runs, without paying
~2 s of imports per case); the plugin cases and a sample of the others run `python -m rlkit` in a
subprocess. Unit-level corpora stay where they are (tests/unit/recipe BROKEN, tests/unit/data,
tests/unit/rewards, tests/unit/test_plugins.py); these cases add the end-to-end view.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlkit_harness import (
    check_checkpoints,
    last_record_per_step,
    ray_session,
    recipe_text,
    reliability_overrides,
    rlkit_env,
    run,
    wait_until_reaped,
)

from rlkit.cli import main

GOOD_ROW = {
    "data_source": "rlkit/arithmetic",
    "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"index": 0},
}


@pytest.fixture
def base(assets, tmp_path) -> Path:
    """A valid tiny recipe (its own output folder)."""
    model, data = assets
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_text(model, data, tmp_path / "out", reliability_overrides(steps=2, keep=2)))
    return path


def cli(capsys, *argv: str) -> tuple[int, str]:
    from rlkit_harness import sessions_started_by

    before = set(sessions_started_by(os.getpid()))
    code = main(list(argv))
    err = capsys.readouterr().err
    assert set(sessions_started_by(os.getpid())) == before, "a Ray cluster was started for refused input"
    return code, err


def assert_refused(code: int, err: str, *fragments: str) -> None:
    assert code == 1, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"


# ----- recipes: `rlkit validate RECIPE OVERRIDES` ----------------------------------------------------
# (overrides, fragments the message must hold: the key path, and what is valid or wrong)
RECIPE_CASES = {
    "wrong type int": (["rollout.n=many"], ["rollout.n", "valid integer"]),
    "wrong type float": (["actor.optim.lr=fast"], ["actor.optim.lr", "valid number"]),
    "wrong type list": (["trainer.total_steps=[1, 2]"], ["trainer.total_steps"]),
    "wrong type mapping": (["model=3"], ["model", "valid dictionary"]),
    "negative batch": (["data.train_batch_size=-1"], ["data.train_batch_size", "greater than 0"]),
    "unknown key with suggestion": (
        ["actor.loss_agg_mod=token-mean"],
        ["actor.loss_agg_mod", "Did you mean 'loss_agg_mode'"],
    ),
    "unknown component parameter": (
        ["actor.policy_loss.clip_ratio_hgh=0.3"],
        ["actor.policy_loss.clip_ratio_hgh", "ppo_clip", "clip_ratio_high"],
    ),
    "parameter out of range": (
        ["algorithm.estimator={name: ppo, lam: 1.5}"],
        ["algorithm.estimator.lam", "less than or equal to 1"],
    ),
    "parameter of a component without any": (
        ["reward.manager={name: naive, num_workers: 2}"],
        ["reward.manager.num_workers", "takes no parameters"],
    ),
    "unknown section": (["nonsense.key=1"], ["nonsense", "unknown key"]),
    "unknown estimator": (["algorithm.estimator=grpoo"], ["algorithm.estimator", "grpo"]),
    "unknown policy loss": (["actor.policy_loss=ppo_clp"], ["actor.policy_loss", "ppo_clip"]),
    "unknown reward manager": (["reward.manager=navie"], ["reward.manager", "naive"]),
    "unknown tracker": (["tracking.backends=[console, mlflw]"], ["tracking.backends.1", "mlflow"]),
    "unknown rollout backend": (["rollout.backend=tensorrt"], ["rollout.backend", "hf"]),
    "unknown prompt length policy": (
        ["data.prompt_length_policy=cut"],
        ["data.prompt_length_policy", "truncate_left"],
    ),
    "unknown loss aggregation": (["actor.loss_agg_mode=mean"], ["actor.loss_agg_mode", "token-mean"]),
    "missing train file": (
        ["data.train_files=[/no/such/train.parquet]"],
        ["data.train_files.0", "/no/such/train.parquet"],
    ),
    "missing val file": (
        ["data.val_files=[/no/such/val.parquet]"],
        ["data.val_files.0", "/no/such/val.parquet"],
    ),
    "missing custom score file": (
        ["reward.custom_score={path: /no/such_score.py}"],
        ["reward.custom_score.path", "/no/such_score.py"],
    ),
    "critic option without critic": (
        ["critic.cliprange_value=0.3"],
        ["critic.cliprange_value", "uses no critic"],
    ),
    "critic enabled for grpo": (["critic.enable=true"], ["critic.enable", "uses no critic"]),
    "kl loss without reference": (
        ["ref.enable=false", "actor.use_kl_loss=true"],
        ["ref.enable", "reference model"],
    ),
    "group estimator with n=1": (["rollout.n=1"], ["rollout.n", "2 or more"]),
    "mini batch does not divide": (
        ["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"],
        ["actor.ppo_mini_batch_size", "does not divide"],
    ),
    "unknown pool": (
        ["resources.roles={actor_rollout_ref: gpu_pool}"],
        ["resources.roles.actor_rollout_ref", "unknown pool"],
    ),
    "override without =": (["badoverride"], ["badoverride", "not an override"]),
    "removing a missing key": (["~nothing.here"], ["~nothing.here", "no key"]),
    # a backend's declared limits (RolloutBackendSpec), refused before any engine starts
    "vllm with top-k": (
        ["rollout.backend=vllm", "rollout.top_k=20"],
        ["rollout.top_k", "'vllm'", "rollout.top_k=0"],
    ),
    "vllm with top-p": (
        ["rollout.backend=vllm", "rollout.top_p=0.9"],
        ["rollout.top_p", "'vllm'", "rollout.top_p=1.0"],
    ),
    "vllm with two actor ranks": (
        ["rollout.backend=vllm", "resources.pools={global: {bundles_per_node: 2}}"],
        ["resources.roles.actor_rollout_ref", "at most 1 rank", "has 2"],
    ),
    "decode copy with a sharded actor": (
        ["rollout.backend={name: hf, dtype: float16}", "resources.pools={global: {bundles_per_node: 2}}"],
        ["rollout.backend.dtype", "unsharded", "has 2 ranks", "dtype=auto"],
    ),
    "two problems at once": (
        ["rollout.n=0", "actor.policy_loss=nope"],
        ["rollout.n", "actor.policy_loss", "2 problem(s)"],
    ),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_recipe_refused_by_validate(capsys, base, case):
    overrides, fragments = RECIPE_CASES[case]
    code, err = cli(capsys, "validate", str(base), *overrides)
    assert_refused(code, err, str(base), *fragments)


RECIPE_FILES = {
    "empty file": ("", ["recipe"]),
    "yaml syntax error": ("model: {path: x\n", ["line"]),
    "a list, not a mapping": ("- a\n- b\n", ["mapping"]),
    "not utf-8": (b"model: {path: \xff\xfe}\n", ["UTF-8"]),
}


@pytest.mark.parametrize("case", sorted(RECIPE_FILES))
def test_broken_recipe_file(capsys, tmp_path, case):
    text, fragments = RECIPE_FILES[case]
    path = tmp_path / "broken.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, err = cli(capsys, "validate", str(path))
    assert_refused(code, err, str(path), *fragments)


def test_missing_recipe_file(capsys, tmp_path):
    code, err = cli(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert_refused(code, err, "nope.yaml")


def test_missing_model_folder_refused_before_ray(capsys, base):
    code, err = cli(capsys, "run", str(base), "model.path=/no/such/model")
    assert_refused(code, err, "/no/such/model")


def test_resume_from_a_folder_that_is_no_checkpoint(capsys, base, tmp_path):
    code, err = cli(capsys, "run", str(base), f"trainer.resume={tmp_path}")
    assert_refused(code, err, f"trainer.resume={tmp_path}", "not a complete checkpoint")


# ----- data: `rlkit run` refuses the file before any model or Ray process starts --------------------
def bad_utf8_table() -> pa.Table:
    content = pa.array([b"What is 1 + 1?", b"\xff\xfe 2 + 2"], pa.binary()).view(pa.string())  # not validated
    prompt = pa.ListArray.from_arrays(
        pa.array([0, 1, 2], pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user", "user"]), content], names=["role", "content"]),
    )
    return pa.table(
        {
            "data_source": ["rlkit/arithmetic"] * 2,
            "prompt": prompt,
            "reward_model": [{"ground_truth": "2"}, {"ground_truth": "4"}],
        }
    )


def rows_with(**changes) -> list[dict]:
    """Two good rows; row 1 gets ``changes`` (a value of None removes nothing: it sets None)."""
    return [dict(GOOD_ROW), {**GOOD_ROW, **changes}]


DATA_CASES = {
    "empty file (no rows)": (lambda: pa.Table.from_pylist([GOOD_ROW]).slice(0, 0), ["has no rows"]),
    "missing reward_model column": (
        lambda: pa.Table.from_pylist([{k: v for k, v in GOOD_ROW.items() if k != "reward_model"}]),
        ["missing column(s) ['reward_model']"],
    ),
    "missing prompt column": (
        lambda: pa.Table.from_pylist([{k: v for k, v in GOOD_ROW.items() if k != "prompt"}]),
        ["missing column(s) ['prompt']"],
    ),
    "prompt is a string": (
        lambda: pa.Table.from_pylist([{**GOOD_ROW, "prompt": "What is 1 + 1?"}]),
        ["column 'prompt' has type string"],
    ),
    "non-UTF-8 text": (bad_utf8_table, ["row 1: a text field is not valid UTF-8"]),
    "prompt over the limit": (
        lambda: pa.Table.from_pylist(rows_with(prompt=[{"role": "user", "content": "7 " * 200}])),
        ["row 1: the prompt is", "longer than data.max_prompt_length=64"],
    ),
    "ground truth missing": (
        lambda: pa.Table.from_pylist(rows_with(reward_model={"style": "rule", "ground_truth": None})),
        ["row 1: 'reward_model.ground_truth' is missing"],
    ),
    "data_source empty": (
        lambda: pa.Table.from_pylist(rows_with(data_source="")),
        ["row 1: 'data_source' is missing"],
    ),
    "message without role": (
        lambda: pa.Table.from_pylist(rows_with(prompt=[{"role": None, "content": "hi"}])),
        ["row 1: 'prompt'[0] has no string 'role'"],
    ),
    "empty message list": (
        lambda: pa.Table.from_pylist(rows_with(prompt=[])),
        ["row 1: 'prompt' is missing or empty"],
    ),
    "extra_info not a mapping": (
        lambda: pa.table(
            {**{k: [v, v] for k, v in GOOD_ROW.items() if k != "extra_info"}, "extra_info": ["x", "y"]}
        ),
        ["row 0: 'extra_info' is a str"],
    ),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_refused_by_run(capsys, base, tmp_path, case):
    make, fragments = DATA_CASES[case]
    data = tmp_path / "bad.parquet"
    pq.write_table(make(), data)
    code, err = cli(capsys, "run", str(base), f"data.train_files=[{data}]")
    assert_refused(code, err, str(data), *fragments)


def test_not_a_parquet_file(capsys, base, tmp_path):
    data = tmp_path / "text.parquet"
    data.write_text("data_source,prompt\n")
    code, err = cli(capsys, "run", str(base), f"data.train_files=[{data}]")
    assert_refused(code, err, str(data), "cannot be read as parquet")


def test_every_row_filtered(capsys, base, tmp_path):
    data = tmp_path / "long.parquet"
    pq.write_table(
        pa.Table.from_pylist([{**GOOD_ROW, "prompt": [{"role": "user", "content": "7 " * 200}]}]), data
    )
    code, err = cli(
        capsys, "run", str(base), f"data.train_files=[{data}]", "data.prompt_length_policy=filter"
    )
    assert_refused(code, err, str(data), "no rows left")


def test_fewer_rows_than_one_batch(capsys, base, tmp_path):
    data = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD_ROW]), data)
    code, err = cli(capsys, "run", str(base), f"data.train_files=[{data}]")
    assert_refused(code, err, str(data), "data.train_batch_size")


# ----- the same refusals through a real `python -m rlkit` process --------------------------------
def test_subprocess_refusals_exit_1_without_traceback(base, tmp_path):
    data = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD_ROW]).slice(0, 0), data)
    for argv, fragment in (
        (["validate", str(base), "algorithm.estimator=grpoo"], "Did you mean 'grpo'"),
        (["run", str(base), f"data.train_files=[{data}]"], "has no rows"),
    ):
        result = run(*argv, timeout=120)
        assert result.returncode == 1 and fragment in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]


# ----- plugins: a package on PYTHONPATH with entry points -------------------------------------------
def fake_dist(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> None:
    dist = root / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


PLUGIN_CASES = {
    "entry point fails to import": (
        "[rlkit]\nbroken = broken_hooks\n",
        {"broken_hooks": "import a_module_that_does_not_exist\n"},
        ["rlkit-bad", "broken = broken_hooks", "a_module_that_does_not_exist"],
    ),
    "two plugins claim one name": (
        "[rlkit]\ndup = dup_hooks\n",
        {
            "dup_hooks": """\
            import rlkit
            from rlkit.plugin.specs import EstimatorSpec
            from rlkit.algos import estimators
            @rlkit.hookimpl
            def rlkit_register_estimators():
                return [EstimatorSpec(name="grpo", fn=print)]
            """
        },
        ["grpo", "rlkit-bad"],
    ),
    "compute_score entry point names nothing": (
        "[rlkit.compute_score]\nmy_source = no_such_module:compute_score\n",
        {},
        ["my_source", "no_such_module"],
    ),
}


@pytest.mark.parametrize("case", sorted(PLUGIN_CASES))
def test_bad_plugin_named_by_validate(base, tmp_path, case):
    entry_points, modules, fragments = PLUGIN_CASES[case]
    site = tmp_path / "site"
    fake_dist(site, "rlkit-bad", entry_points, modules)
    env = rlkit_env(PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    result = run("validate", str(base), env=env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr[-3000:]}"


# ----- score functions that misbehave: default score, counted, the run never stops ------------------
SCORES = {
    "nan": (lambda *a, **k: math.nan, "not a finite number"),
    "inf": (lambda *a, **k: math.inf, "not a finite number"),
    "none": (lambda *a, **k: None, "NoneType"),
    "string": (lambda *a, **k: "1.0", "not a number"),
    "dict without score": (lambda *a, **k: {"acc": 1.0}, "without a 'score' key"),
    "raises": (lambda *a, **k: 1 / 0, "ZeroDivisionError"),
}


@pytest.mark.parametrize("case", sorted(SCORES))
def test_misbehaving_score_gets_default_and_is_counted(assets, case, caplog):
    import torch

    from rlkit.batch import Batch
    from rlkit.model.load import load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rewards.managers import NaiveRewardManager

    fn, message = SCORES[case]
    tokenizer = load_tokenizer(ModelConfig(path=str(assets[0])))
    batch = Batch(
        {"responses": torch.tensor([[5, 6], [7, 8]]), "response_mask": torch.ones(2, 2, dtype=torch.long)},
        {"data_source": ["x", "x"], "reward_model": [{"ground_truth": "1"}] * 2, "extra_info": [{}, {}]},
    )
    result = NaiveRewardManager(tokenizer, fn, default_score=-1.0)(batch)
    assert result.token_level_scores.sum(-1).tolist() == [-1.0, -1.0]
    assert result.metrics["reward/errors"] == 2
    assert message in caplog.text


MISBEHAVING_SCORE = """\
import math, time

CALLS = [0]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS[0] += 1
    kind = CALLS[0] % 6
    if kind == 0:
        time.sleep(30)  # hangs: the parallel manager's timeout gives it the default score
    return [math.nan, None, "one", {{"no_score": 1}}, 1.0 / (kind - 5)][kind - 1] if kind else 0.0
"""


@pytest.mark.slow  # a full run; the same cases are checked in-process above
def test_run_survives_scores_that_return_nan_none_strings_raise_or_hang(recipe, tmp_path):
    """One real run whose score file cycles through NaN, None, a string, a dict without score, a
    ZeroDivisionError and a 30 s sleep (parallel manager, timeout 2 s): it finishes, counting them."""
    out = tmp_path / "out"
    score = tmp_path / "bad_score.py"
    score.write_text(MISBEHAVING_SCORE.format())
    path = recipe(
        out,
        steps=2,
        extra=f"reward: {{custom_score: {{path: {score}}}, manager: {{name: parallel, "
        "num_workers: 1}, timeout_s: 2.0, "
        "max_error_fraction: 1.0}\n",
    )  # 5 of 6 fail: opt out of the stop
    result = run("run", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    records = last_record_per_step(out)
    assert sum(r.get("reward/errors", 0) for r in records.values()) >= 4, records
    assert sum(r.get("reward/timeouts", 0) for r in records.values()) >= 1, records
    assert check_checkpoints(out) == [1, 2]
    wait_until_reaped(ray_session(out))
