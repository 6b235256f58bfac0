"""The rlkit-reasoning-gym plugin on the real reasoning-gym 0.1.25: its environment passes the conformance
check, a weighted mix gives rows of each task, `rlkit data reasoning-gym` writes the rows a run gets and the
registered compute_score scores them from the file alone (no data.environment)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from rlkit.errors import RlkitError
from rlkit.plugin.registry import build_registries
from rlkit.recipe.compose import resolve
from rlkit.rewards.dispatch import compute_score
from rlkit.testing import check_environment

EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


@pytest.fixture(scope="module")
def registries():
    return build_registries()


def test_rlkit_plugins_lists_the_environment():
    out = subprocess.run(
        [sys.executable, "-m", "rlkit", "plugins", "--json"], capture_output=True, text=True, check=True
    )
    envs = {e["name"]: e for e in json.loads(out.stdout)["registries"]["environments"]}
    assert envs["reasoning_gym"]["package"] == "rlkit-reasoning-gym"


def test_a_task_passes_the_conformance_check_and_scores_by_score_answer(registries):
    seen = check_environment(
        "reasoning_gym", registries=registries, task="basic_arithmetic", config=EASY, size=8, val_size=2
    )
    assert seen["rows"] == 8 and 1.0 in seen["scores"]  # every ground truth scores 1
    env, problems = resolve(
        "data.environment",
        "environments",
        {"name": "reasoning_gym", "task": "basic_arithmetic", "config": EASY, "size": 4},
        registries,
    )
    assert not problems
    from rlkit.data.environment import build_environment, environment_rows

    e = build_environment(env)
    row = environment_rows(env, "train", e)[0]
    truth = row["reward_model"]["ground_truth"]
    assert e.score(f"I think <answer>{truth}</answer>", truth, row["extra_info"]) == {
        "score": 1.0,
        "correct": 1.0,
        "format": 1.0,
    }
    # no tags: the whole response is the answer, and score_answer gives partial credit when it contains it
    partial = e.score(f"x = {truth}", truth, row["extra_info"])
    assert partial["format"] == 0.0 and partial["correct"] == pytest.approx(len(truth) / len(f"x = {truth}"))


def test_last_number_takes_an_untagged_sentences_last_number_as_the_answer(registries):
    from rlkit.data.environment import build_environment, environment_rows

    params = {"name": "reasoning_gym", "task": "basic_arithmetic", "config": EASY, "size": 4}
    env, problems = resolve(
        "data.environment", "environments", params | {"answer_tags": "last_number"}, registries
    )
    assert not problems
    e = build_environment(env)
    row = environment_rows(env, "train", e)[0]
    truth, extra = row["reward_model"]["ground_truth"], row["extra_info"]
    assert e.score(f"The sum is {truth}.", truth, extra)["correct"] == 1.0
    assert e.score(f"{truth} + 1 is {int(truth) + 1}", truth, extra)["correct"] == 0.0  # the last number
    assert e.score("no number at all", truth, extra)["correct"] == 0.0
    assert e.score(f"<answer>{truth}</answer> or 99", truth, extra) == {
        "score": 1.0,
        "correct": 1.0,
        "format": 1.0,
    }


def test_a_weighted_mix_and_an_unknown_task(registries):
    from rlkit.data.environment import build_environment

    env, _ = resolve(
        "data.environment",
        "environments",
        {"name": "reasoning_gym", "mix": {"leg_counting": 1.0, "basic_arithmetic": 1.0}, "size": 16},
        registries,
    )
    tasks = {r["extra_info"]["task"] for r in build_environment(env).rows("train")}
    assert tasks == {"leg_counting", "basic_arithmetic"}
    _, problems = resolve("data.environment", "environments", {"name": "reasoning_gym"}, registries)
    assert "exactly one of task" in problems[0][1]
    env, _ = resolve(
        "data.environment", "environments", {"name": "reasoning_gym", "task": "leg_countin"}, registries
    )
    with pytest.raises(RlkitError, match=r"unknown task\(s\) \['leg_countin'\].*leg_counting"):
        build_environment(env).rows("train")


def test_rlkit_data_writes_the_rows_a_run_gets(tmp_path, registries):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit",
            "data",
            "reasoning-gym",
            "--task",
            "leg_counting",
            "--size",
            "6",
            "--val-size",
            "2",
            "--seed",
            "3",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "train: 6 rows" in out.stdout and "test: 2 rows" in out.stdout
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    from rlkit.data.environment import environment_rows

    env, _ = resolve(
        "data.environment",
        "environments",
        {"name": "reasoning_gym", "task": "leg_counting", "size": 6, "val_size": 2, "seed": 3},
        registries,
    )
    expected = environment_rows(env, "train")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in expected]
    assert {r["data_source"] for r in rows} == {"reasoning_gym"}
    # scored from the file alone: the registered compute_score rebuilds the task from the row's parameters
    row = rows[0]
    truth = row["reward_model"]["ground_truth"]
    got = compute_score(
        "reasoning_gym", f"<answer>{truth}</answer>", truth, row["extra_info"], registries=registries
    )
    assert got["score"] == 1.0
    assert (
        compute_score(
            "reasoning_gym", "<answer>-1</answer>", truth, row["extra_info"], registries=registries
        )["score"]
        == 0.0
    )


def test_rlkit_data_takes_environment_params_and_names_a_wrong_one(tmp_path, registries):
    def data(*params: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rlkit", "data", "reasoning-gym", "--task", "basic_arithmetic"]
        command += ["--size", "4", "--val-size", "0", "--output", str(tmp_path), *params]
        return subprocess.run(command, capture_output=True, text=True)

    out = data("config.max_digits=1", "config.max_terms=2", "answer_tags=last_number")
    assert out.returncode == 0, out.stderr
    row = pq.read_table(tmp_path / "train.parquet").to_pylist()[0]
    truth = row["reward_model"]["ground_truth"]
    scored = compute_score(
        "reasoning_gym", f"It is {truth}.", truth, row["extra_info"], registries=registries
    )
    assert scored["correct"] == 1.0  # answer_tags=last_number travelled with the row
    bad = data("answer_tag=last_number")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "answer_tag: unknown parameter" in bad.stderr and "Did you mean 'answer_tags'" in bad.stderr
