"""Every shipped recipe runs end to end with `rlkit run RECIPE --smoke` (default test run, not behind a marker).

Each recipe in recipes/ runs in its own subprocess and working folder, sharing one tiny smoke model built once
per session (``RLKIT_CACHE``). ``EXPECTED`` names, per recipe, the metrics that prove its parts ran; a recipe
without an entry fails ``test_every_recipe_has_an_entry`` (add one when you add a recipe). On top of the table,
what a recipe declares is checked generically: a KL loss must log ``actor/kl_loss``, a critic
``critic/vf_loss``. One recipe (quickstart, which merges at the end) is also resumed from its checkpoint.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from rlkit_harness import records, rlkit_env
from rlkit_harness import run as run_rlkit

REPO = Path(__file__).resolve().parents[2]
RECIPES = {p.stem: p for p in sorted((REPO / "recipes").glob("*.yaml"))}

# recipe -> metrics its smoke run must log (in its last training step unless noted in CHECKS)
EXPECTED: dict[str, tuple[str, ...]] = {
    "quickstart": ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean"),
    "grpo": ("actor/pg_loss", "actor/kl_loss", "critic/advantages/mean"),
    "ppo": ("critic/vf_loss", "critic/values/mean", "critic/vf_clipfrac", "actor/pg_loss", "critic/returns/mean"),
    "dapo": ("train/num_gen_batches", "train/filter_groups_kept", "train/filter_groups_dropped",
             "reward/overlong_penalty/mean", "reward/overlong_ratio", "actor/pg_clipfrac"),
    "grpo_tool_agent": ("num_turns/mean", "num_turns/min", "num_turns/max", "tool_call_counts/mean",
                        "actor/kl_loss"),
}


def _dapo_refilled(steps: list[dict]) -> None:
    """Dynamic sampling dropped uniform groups and generated again in at least one step."""
    assert max(s["train/num_gen_batches"] for s in steps) >= 2, [s["train/num_gen_batches"] for s in steps]
    assert sum(s["train/filter_groups_dropped"] for s in steps) >= 1
    assert all(s["train/filter_groups_kept"] >= 4 for s in steps)  # the batch was filled every step


def _tool_turns(steps: list[dict]) -> None:
    assert all(s["num_turns/min"] >= 1 and s["num_turns/max"] <= 5 for s in steps)


CHECKS = {"dapo": _dapo_refilled, "grpo_tool_agent": _tool_turns}


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory) -> Path:
    """One smoke model for the whole session (RLKIT_CACHE of every run)."""
    from rlkit.recipe.smoke import TINY_MODEL, _build_tiny

    cache = tmp_path_factory.mktemp("rlkit-cache")
    _build_tiny(cache / "models" / TINY_MODEL)
    return cache


_RUNS: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}


def smoke_run(name: str, cache: Path, root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """`rlkit run recipes/<name>.yaml --smoke` in its own folder, once per session."""
    if name not in _RUNS:
        cwd = root / name
        cwd.mkdir()
        result = run_rlkit("run", str(RECIPES[name]), "--smoke", env=rlkit_env(RLKIT_CACHE=str(cache)), cwd=cwd,
                           timeout=400)
        _RUNS[name] = (result, cwd / "outputs/smoke" / name)
    return _RUNS[name]


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("smoke-runs")


def test_every_recipe_has_an_entry():
    missing = sorted(set(RECIPES) - set(EXPECTED))
    assert not missing, f"recipes without expected smoke metrics in tests/e2e/test_smoke_matrix.py EXPECTED: {missing}"
    assert {"quickstart", "ppo", "grpo", "dapo", "grpo_tool_agent"} <= set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_smoke_run(name, smoke_cache, runs_root):
    from rlkit.recipe import load_recipe
    from rlkit.registry import build_registries

    result, out = smoke_run(name, smoke_cache, runs_root)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--smoke:" in result.stderr and "resources.device" in result.stderr  # the table of swaps
    assert "done:" in result.stdout
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    declared = load_recipe(RECIPES[name], check_files=False)
    registries = build_registries()
    wanted = list(EXPECTED.get(name, ()))
    wanted += ["actor/kl_loss"] if declared.actor.use_kl_loss else []
    wanted += ["critic/vf_loss"] if registries.estimators.get(declared.algorithm.estimator).needs_critic else []
    for key in wanted:
        assert key in steps[-1], f"{name}: metric {key} missing; logged: {sorted(steps[-1])}"
    if name in CHECKS:
        CHECKS[name](steps)
    assert (out / "checkpoints" / "global_step_2").is_dir()  # saved at the end


def test_resume_and_merge_after_a_smoke_run(smoke_cache, runs_root, tmp_path):
    """Quickstart's smoke run merged its final actor (merge_at_end); resume it for one more step, merge again."""
    result, out = smoke_run("quickstart", smoke_cache, runs_root)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "hf_model" / "config.json").is_file()
    again = run_rlkit("run", str(RECIPES["quickstart"]), "--smoke", "trainer.resume=auto", "trainer.total_steps=3",
                      "trainer.merge_at_end=false", env=rlkit_env(RLKIT_CACHE=str(smoke_cache)),
                      cwd=runs_root / "quickstart", timeout=400)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stderr
    assert [r["step"] for r in records(out) if "training/global_step" in r] == [1, 2, 3]  # step 3 only, appended
    merged = tmp_path / "merged"
    result = run_rlkit("merge", str(out / "checkpoints" / "global_step_3"), "--out", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(merged).config.model_type == "qwen2"
