"""``rollout.backend.linears: onnxruntime`` through ``rlkit run``: the Ray worker decodes in fp32 on ONNX
Runtime's MLAS GEMM (rlkit.rollout.mlas_weights), repacks every linear after each weight sync, and the
rollout's log-probs are the actor's to float rounding while the update trains on them."""

from __future__ import annotations

import json
import math

import pytest
from rlkit_harness import GRADED_SCORE, recipe_text, records, rlkit_env
from rlkit_harness import run as run_rlkit

from rlkit.hardware import onnxruntime_unavailable

pytestmark = pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")


def test_a_run_decodes_on_onnxruntime_linears(tiny_assets, tmp_path):
    model, data = tiny_assets
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    overrides = {
        "data.max_response_length": 12,
        "data.train_batch_size": 2,
        "rollout.n": 4,
        "rollout.backend": {"name": "hf", "linears": "onnxruntime"},
        "trainer.total_steps": 2,
        "reward": {"custom_score": {"path": str(GRADED_SCORE)}},
    }
    recipe.write_text(recipe_text(model, data, out, overrides))
    result = run_rlkit("run", str(recipe), env=rlkit_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollout decode float32" in result.stdout
    resolved = json.loads((out / "run_info.json").read_text())["resolved"]
    assert resolved["decode_dtype"] == "float32" and "linears=onnxruntime" in resolved["decode_reason"]

    from transformers import AutoConfig

    linears = 7 * AutoConfig.from_pretrained(model).num_hidden_layers + 1  # q k v o gate up down, the head
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for step in steps:
        # every linear packed at step 1 (the copy is made) and again after the weight sync that followed it
        assert step["rollout/mlas_repacked_linears"] == linears
        assert step["rollout/lean_step"] == 1.0
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"])
        assert step["critic/score/min"] < step["critic/score/max"]  # graded rewards vary: a real gradient
        # fp32 on either side: the rollout's probabilities are the actor's recompute's to float rounding
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert step["training/rollout_probs_diff_max"] < 1e-4
