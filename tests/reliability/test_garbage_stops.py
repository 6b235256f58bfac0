"""Garbage stops early: a data_source without a compute_score is refused before anything starts, and a run
whose scores fail (more than ``reward.max_error_fraction`` of a batch) stops, naming the data source and the
first failure, with its last checkpoint intact."""

from __future__ import annotations

import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from rlkit_harness import (
    check_checkpoints,
    last_record_per_step,
    ray_session,
    recipe_text,
    reliability_overrides,
    run,
    sessions_started_by,
    wait_until_reaped,
)

from rlkit.cli import main
from rlkit.rewards.managers import RewardFailureError, RewardResult
from rlkit.rewards.steps import RewardStep, check_failures


def result_with(failed_rows: list[int], size: int = 4, source: str = "src/a") -> RewardResult:
    failures = [(i, source, f"returned nan, not a finite number (row {i})") for i in failed_rows]
    return RewardResult(torch.zeros(size, 2), {}, {"reward/errors": float(len(failed_rows))}, failures)


# ----- counting ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failed", "fraction", "stops"),
    [
        ([], 0.5, False),
        ([1], 0.5, False),
        ([0, 3], 0.5, False),  # at the bound: goes on
        ([0, 1, 3], 0.5, True),
        ([0, 1, 2, 3], 0.5, True),
        ([0], 0.0, True),
        ([0, 1, 2, 3], 1.0, False),  # 1.0 never stops
    ],
)
def test_more_than_the_fraction_failed_stops(failed, fraction, stops):
    if not stops:
        check_failures(result_with(failed), 4, fraction)
        return
    with pytest.raises(RewardFailureError) as error:
        check_failures(result_with(failed), 4, fraction)
    message = str(error.value)
    assert f"reward: {len(failed)} of 4 scores of a batch failed" in message
    assert f"more than reward.max_error_fraction={fraction:g}" in message
    assert f"data_source 'src/a' ({len(failed)} failed)" in message
    assert (
        f"first failure: row {failed[0]}, data_source 'src/a': returned nan, not a finite number" in message
    )


def test_a_manager_without_a_failure_list_is_counted_from_its_metrics():
    result = RewardResult(torch.zeros(4, 2), {}, {"reward/errors": 2.0, "reward/timeouts": 1.0})
    with pytest.raises(
        RewardFailureError, match="3 of 4 scores .* the manager reports no per-sample failures"
    ):
        check_failures(result, 4, 0.5)


@pytest.mark.parametrize(
    ("score", "message"),
    [
        (lambda *a: math.nan, "returned nan, not a finite number"),
        (lambda *a: math.inf, "returned inf"),
        (lambda *a: "1.0", "returned str '1.0', not a number"),
        (lambda *a: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_the_reward_step_stops_on_a_real_manager(assets, score, message):
    from rlkit.batch import Batch
    from rlkit.model.load import load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rewards.managers import NaiveRewardManager

    tokenizer = load_tokenizer(ModelConfig(path=str(assets[0])))
    batch = Batch(
        {"responses": torch.tensor([[5, 6], [7, 8]]), "response_mask": torch.ones(2, 2, dtype=torch.long)},
        {
            "data_source": ["bad/src", "bad/src"],
            "reward_model": [{"ground_truth": "1"}] * 2,
            "extra_info": [{}, {}],
        },
    )
    with NaiveRewardManager(tokenizer, score) as manager:
        # built by hand: never stops (a run passes the recipe's)
        assert RewardStep(manager).max_error_fraction == 1.0
        with pytest.raises(RewardFailureError) as error:
            RewardStep(manager, max_error_fraction=0.5)(batch)
    assert "2 of 2 scores" in str(error.value) and "data_source 'bad/src'" in str(error.value)
    assert f"first failure: row 0, data_source 'bad/src': {message}" in str(error.value)


def test_the_default_fraction_is_a_half():
    from rlkit.recipe.schema import RewardConfig

    assert RewardConfig().max_error_fraction == 0.5


# ----- validation: every data_source has a compute_score -------------------------------------------
def write_rows(path, sources: list[str]) -> str:
    rows = [
        {
            "data_source": s,
            "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": i},
        }
        for i, s in enumerate(sources)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def base(assets, tmp_path):
    model, data = assets
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_text(model, data, tmp_path / "out", reliability_overrides(steps=2, keep=2)))
    return path


def test_data_sources_without_a_compute_score_are_refused_by_validate(capsys, base, tmp_path):
    train = write_rows(tmp_path / "train.parquet", ["rlkit/arithmetic", "my/unscored", "my/unscored"])
    val = write_rows(tmp_path / "val.parquet", ["other/unscored", "rlkit/arithmetic"])
    code = main(["validate", str(base), f"data.train_files=[{train}]", f"data.val_files=[{val}]"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("  - ") == 1, err  # one problem lists every missing source
    assert f"no compute_score for data_source 'my/unscored' (in {train}); 'other/unscored' (in {val})" in err
    assert "Registered data sources: " in err and "rlkit/arithmetic" in err and "reward.custom_score" in err
    # a custom score covers every source
    score = tmp_path / "score.py"
    score.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    assert (
        main(["validate", str(base), f"data.train_files=[{train}]", f"reward.custom_score.path={score}"]) == 0
    )


def test_run_refuses_unscored_data_before_ray(capsys, base, tmp_path):
    train = write_rows(tmp_path / "train.parquet", ["nobody/scores/this"] * 4)
    before = set(sessions_started_by(os.getpid()))
    assert main(["run", str(base), f"data.train_files=[{train}]"]) == 1
    assert "no compute_score for data_source 'nobody/scores/this'" in capsys.readouterr().err
    assert set(sessions_started_by(os.getpid())) == before and not (tmp_path / "out").exists()


# ----- a real run whose scorer turns to NaN -------------------------------------------------------
NAN_AFTER_FIRST_CHECKPOINT = """\
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if Path({ckpt!r}).exists():  # from step 2 on, every score is NaN
        return float("nan")
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""


def test_a_run_whose_scores_turn_nan_stops_naming_source_and_first_failure(recipe, tmp_path):
    out = tmp_path / "out"
    score = tmp_path / "nan_score.py"
    score.write_text(
        NAN_AFTER_FIRST_CHECKPOINT.format(ckpt=str(out / "checkpoints" / "global_step_1" / "COMPLETE"))
    )
    path = recipe(out, steps=3, extra=f"reward: {{custom_score: {{path: {score}}}}}\n")
    result = run("run", str(path))
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("error: ") :]
    assert "Traceback" not in error
    assert (
        "error: reward: 4 of 4 scores of a batch failed (100%, more than reward.max_error_fraction=0.5)"
        in error
    )
    assert "data_source 'rlkit/arithmetic' (4 failed)" in error
    assert "first failure: row 0, data_source 'rlkit/arithmetic': returned nan, not a finite number" in error
    assert f"Training stopped; the last good checkpoint is {out / 'checkpoints' / 'global_step_1'}." in error
    assert check_checkpoints(out) == [1]  # step 2 was never saved; checkpoint 1 loads
    assert sorted(last_record_per_step(out)) == [1]
    wait_until_reaped(ray_session(out))
