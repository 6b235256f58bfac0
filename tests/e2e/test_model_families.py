"""Each Llama-family architecture the lean decode step takes (``rlkit.rollout.lean_step``) trains through
``rlkit run``: a tiny Llama, Qwen3 (per-head q/k norms) and Mistral (no sliding window), each in its own run
(the shared tiny Qwen2 runs in every other e2e test).

What proves the parts ran: the rollout decoded every token after the prefill by the lean step
(``rollout/lean_step`` = 1), its log-probs are the ones the actor's own forward recomputes for the same tokens
(``training/rollout_probs_diff_max`` at float rounding: a step that skipped Qwen3's q/k norms is off by far
more), and the update had a gradient from graded rewards that vary within the batch."""

from __future__ import annotations

import math

import pytest
from rlkit_harness import GRADED_SCORE, recipe_text, records
from rlkit_harness import run as run_rlkit

from rlkit.model.tiny import build_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_each_lean_step_family_trains_through_rlkit_run(arch, tiny_assets, tmp_path):
    _, data = tiny_assets
    model = build_tiny_model(tmp_path / f"tiny-{arch}", arch=arch, seed=0, eos_norm=3.0)
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    overrides = {
        "data.max_response_length": 8,
        "rollout.n": 4,
        "trainer.total_steps": 2,
        # fp32 on both sides on every machine (auto picks bf16 where the CPU has it): the mismatch below is
        # the lean step's alone
        "actor.mixed_precision": "fp32",
        "rollout.backend": {"name": "hf", "dtype": "float32"},
        "reward": {"custom_score": {"path": str(GRADED_SCORE)}},
    }
    recipe.write_text(recipe_text(model, data, out, overrides))
    result = run_rlkit("run", str(recipe), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for step in steps:
        assert step["rollout/lean_step"] == 1.0, step
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert step["training/rollout_probs_diff_max"] < 1e-4, step["training/rollout_probs_diff_max"]
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"])
    assert any(s["critic/score/min"] < s["critic/score/max"] for s in steps)  # graded rewards varied
