"""``rollout.backend.linears: onnxruntime`` through ``rlkit run``: the Ray worker decodes in fp32 on ONNX
Runtime's MLAS GEMM (the tiny Qwen2: one graph per step, rlkit.rollout.ort_step), repacks every linear after
each weight sync, and the rollout's log-probs are the actor's to float rounding while the update trains on
them."""

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
        assert step["rollout/onnxruntime_graph_step"] == 1.0  # every token after the prefill: one graph
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"])
        assert step["critic/score/min"] < step["critic/score/max"]  # graded rewards vary: a real gradient
        # fp32 on either side: the rollout's probabilities are the actor's recompute's to float rounding
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert step["training/rollout_probs_diff_max"] < 1e-4


def test_auto_picks_onnxruntime_linears_where_they_pay(tiny_assets, tmp_path):
    """``linears: auto`` (the default) through ``rlkit run`` on a machine whose probes say bf16 is slow, fp16
    weights do not pay and ONNX Runtime's linears do (the hardware cache the run reads holds these readings
    for this machine, as a machine of that kind would have measured them; everything else is real)."""
    from transformers import AutoConfig

    from rlkit.hardware import (
        Fp16Probe,
        MatmulProbe,
        MlasProbe,
        cached_fp16_probe,
        cached_mlas_probe,
        cached_probe,
        cpu_info,
        layer_shapes,
        mlas_decode_pays,
    )

    model, data = tiny_assets
    cache = tmp_path / "cache" / "hardware.json"
    cpu, layer = cpu_info(), layer_shapes(AutoConfig.from_pretrained(model).to_dict())
    cached_probe(cpu, cache, probe=lambda: MatmulProbe(fp32_flops=80e9, bf16_flops=1e9, ratios=(0.0125,)))
    no_fp16 = Fp16Probe(fp32_s=0.010, fp16_s=0.012, pack_s=0.020, rows=16, params=1)
    cached_fp16_probe(cpu, cache, layer=layer, probe=lambda layer: no_fp16)
    pays = MlasProbe(fp32_s=0.010, mlas_s=0.006, pack_s=0.020, rows=16, params=1)  # break-even 5 tokens
    cached_mlas_probe(cpu, cache, layer=layer, probe=lambda layer: pays)
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    overrides = {
        "data.max_response_length": 12,
        "data.train_batch_size": 2,
        "rollout.n": 4,
        "trainer.total_steps": 2,
        "reward": {"custom_score": {"path": str(GRADED_SCORE)}},
    }
    recipe.write_text(recipe_text(model, data, out, overrides))
    result = run_rlkit("run", str(recipe), env=rlkit_env(RLKIT_CACHE=str(cache.parent)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    why = mlas_decode_pays(pays, 12)[1]
    assert "rollout decode float32 on onnxruntime linears" in result.stdout and why in result.stdout
    resolved = json.loads((out / "run_info.json").read_text())["resolved"]
    assert (resolved["decode_linears"], resolved["decode_linears_reason"]) == ("onnxruntime", why)
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["rollout/mlas_repacked_linears"] > 0 for r in steps)
    assert all(r["rollout/onnxruntime_graph_step"] == 1.0 for r in steps)
    assert all(r["actor/grad_norm"] > 0 for r in steps)
