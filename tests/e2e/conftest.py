"""Fixtures for end-to-end runs: a tiny model and arithmetic data, built once per session.

Running `rlkit` and reading its metrics: tests/rlkit_harness.py (shared with tests/reliability). The recipe
scores with the graded reward of tests/fixtures/graded_score.py: the tiny model's rewards vary within groups
from step 1, so every step has a non-zero gradient and Adam's moments are non-zero (arithmetic would score 0
throughout).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from rlkit_harness import GRADED_SCORE, recipe_text


def e2e_overrides(data: Path, out: Path) -> dict:
    """The e2e run on top of the tiny base (``rlkit_harness.tiny_recipe``): 4 prompts x 4 samples of at most 8
    tokens, validation, a checkpoint at every one of 4 steps, a merge at the end, every tracker, the graded
    reward."""
    return {
        "data.val_files": [f"{data}/test.parquet"],
        "data.max_response_length": 8,
        "data.train_batch_size": 4,
        "actor.ppo_micro_batch_size_per_rank": 8,
        "rollout.n": 4,
        # the decode's linears pinned: with `auto` a timed probe picks F.linear or the ONNX Runtime graph, a
        # noise-driven pick for the tiny model that moves the rollout's log-probs in their last bits, which
        # the exact sync reference (tests/e2e/test_run.py) compares
        "rollout.backend": {"name": "hf", "linears": "torch"},
        "resources": {"pools": {"global": {"nodes": 1, "bundles_per_node": 1}}},
        "trainer": {
            "total_steps": 4,
            "save_freq": 1,
            "output_dir": str(out),
            "experiment_name": "e2e",
            "merge_at_end": True,
        },
        "tracking.backends": ["console", "mlflow", "jsonl"],
        "reward": {"custom_score": {"path": str(GRADED_SCORE)}},
    }


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    from rlkit.data import generate_arithmetic

    root = tmp_path_factory.mktemp("e2e-assets")
    generate_arithmetic(root / "data", train_size=64, test_size=8, seed=0)
    return tiny_model_dir, root / "data"


@pytest.fixture
def write_recipe(tiny_assets, tmp_path):
    model, data = tiny_assets

    def write(out: Path, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(recipe_text(model, data, out, e2e_overrides(data, out)))
        return path

    return write


def _run_e2e(tiny_assets, root: Path, changes: Callable[[dict], None] | None = None):
    """``rlkit run`` of the e2e recipe (``changes`` edits its overrides first) under ``root``;
    ``(CompletedProcess, output dir)``."""
    from rlkit_harness import run

    model, data = tiny_assets
    overrides = e2e_overrides(data, root / "out")
    if changes is not None:
        changes(overrides)
    recipe = root / "recipe.yaml"
    recipe.write_text(recipe_text(model, data, root / "out", overrides))
    return run("run", str(recipe)), root / "out"


@pytest.fixture(scope="session")
def fp32_run(tiny_assets, tmp_path_factory):
    """The e2e recipe with the precision pinned to fp32 (training and decode), once; ``(CompletedProcess,
    output dir)``. ``auto`` picks bf16 where a probe finds it faster (Zen 4, AMX) and fp32 elsewhere, and the
    sync reference (tests/e2e/test_run.py) compares runs in one precision: this run is the same on every
    machine class but for float rounding. (``straight_run`` keeps ``auto``, whose resolution it checks.)"""

    def pin_fp32(overrides: dict) -> None:
        overrides["rollout.backend"] = {**overrides["rollout.backend"], "dtype": "float32"}
        overrides["actor.mixed_precision"] = "fp32"

    return _run_e2e(tiny_assets, tmp_path_factory.mktemp("fp32"), pin_fp32)


@pytest.fixture(scope="session")
def straight_run(tiny_assets, tmp_path_factory):
    """``rlkit run`` of the e2e recipe once, uninterrupted (4 steps); ``(CompletedProcess, output dir)``.
    Shared by the tests that only read it (tests/e2e/test_run.py): one checks the run itself, the SIGKILL test
    compares a killed and resumed run with it."""
    return _run_e2e(tiny_assets, tmp_path_factory.mktemp("straight"))
