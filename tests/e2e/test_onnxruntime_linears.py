"""``rollout.backend.linears: onnxruntime`` through ``rlkit run``: the Ray worker decodes in fp32 on ONNX
Runtime's MLAS GEMM (the tiny Qwen2: one graph per step, rlkit.rollout.ort_step), repacks every linear after
each weight sync, and the rollout's log-probs are the actor's to float rounding while the update trains on
them."""

from __future__ import annotations

import json
import math

import pytest
from rlkit_harness import TWO_GRADED_STEPS, recipe_text, records, rlkit_env
from rlkit_harness import run as run_rlkit

from rlkit.hardware import onnxruntime_unavailable

pytestmark = pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")


def test_a_run_decodes_on_onnxruntime_linears(tiny_assets, tmp_path):
    model, data = tiny_assets
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    overrides = TWO_GRADED_STEPS | {"rollout.backend": {"name": "hf", "linears": "onnxruntime"}}
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
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for step in (r for r in raw if "training/global_step" in r):  # records() drops timings: read the file
        assert 0 < step["perf/decode_weights_s"] < step["timing_s/gen"]  # the session rebuilt, within gen
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


def _seed_cpu_probes(model, cache):
    """The hardware cache the run reads, holding the readings a machine of that kind would have measured: bf16
    slow, fp16 weights not paying, ONNX Runtime paying (per linear and as one graph). Returns (per-linear
    probe, graph probe)."""
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
    )
    from rlkit.rollout.graph_probe import GraphProbe, cached_graph_probe

    config = AutoConfig.from_pretrained(model).to_dict()
    cpu, layer = cpu_info(), layer_shapes(config)
    cached_probe(cpu, cache, probe=lambda: MatmulProbe(fp32_flops=80e9, bf16_flops=1e9, ratios=(0.0125,)))
    no_fp16 = Fp16Probe(fp32_s=0.010, fp16_s=0.012, pack_s=0.020, rows=16, params=1)
    cached_fp16_probe(cpu, cache, layer=layer, probe=lambda layer: no_fp16)
    pays = MlasProbe(fp32_s=0.010, mlas_s=0.006, pack_s=0.020, rows=16, params=1)  # break-even 5 tokens
    cached_mlas_probe(cpu, cache, layer=layer, probe=lambda layer: pays)
    # 12 tokens: F.linear 120 ms, fp16 weights 2 x 50 + 12 x 9 = 208 ms, the graph 2 x 20 + 12 x 4 = 88 ms
    graph = GraphProbe(fp32_s=0.010, fp16_s=0.009, graph_s=0.004, fp16_pack_s=0.050, graph_pack_s=0.020)
    cached_graph_probe(config, cpu, cache, probe=lambda config: graph)
    return pays, graph


def _run_auto(tiny_assets, tmp_path, extra=None):
    model, data = tiny_assets
    cache = tmp_path / "cache" / "hardware.json"
    pays, graph = _seed_cpu_probes(model, cache)
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    overrides = TWO_GRADED_STEPS | (extra or {})
    recipe.write_text(recipe_text(model, data, out, overrides))
    result = run_rlkit("run", str(recipe), env=rlkit_env(RLKIT_CACHE=str(cache.parent)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = json.loads((out / "run_info.json").read_text())["resolved"]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps)
    return result, resolved, steps, pays, graph


def test_auto_decodes_as_one_graph_where_the_whole_step_probe_says_it_pays(tiny_assets, tmp_path):
    """``linears: auto`` and ``dtype: auto`` (the defaults) through ``rlkit run`` on a machine whose probes
    say bf16 is slow and the one-graph step is the cheapest of the three decodes (the tiny Qwen2 is one the
    graph takes, so the probe of the whole step decides, not the per-linear ones; everything but the seeded
    readings is real)."""
    from rlkit.hardware.mlas import MLAS_PAYBACK_MARGIN
    from rlkit.rollout.graph_probe import graph_choice

    result, resolved, steps, _, graph = _run_auto(tiny_assets, tmp_path)
    why = graph_choice(graph, 12, margin=MLAS_PAYBACK_MARGIN, reduced=True)[2]
    assert why.endswith("-> float32 as one onnxruntime graph") and why in result.stdout
    assert (resolved["decode_dtype"], resolved["decode_linears"]) == ("float32", "onnxruntime")
    assert resolved["decode_linears_reason"] == why
    assert all(r["rollout/onnxruntime_graph_step"] == 1.0 for r in steps)
    assert all(r["rollout/mlas_repacked_linears"] > 0 for r in steps)


def test_auto_weighs_per_linear_probes_where_the_graph_cannot_decode(tiny_assets, tmp_path):
    """With a LoRA adapter the graph would leave the adapter out, so the whole-step probe is not asked: the
    per-linear probes decide (ONNX Runtime's linears pay) and the run decodes on per-linear sessions."""
    from rlkit.hardware import mlas_decode_pays

    result, resolved, steps, pays, _ = _run_auto(tiny_assets, tmp_path, {"actor.lora": {"rank": 4}})
    why = mlas_decode_pays(pays, 12)[1]
    assert "rollout decode float32 on onnxruntime linears" in result.stdout and why in result.stdout
    assert (resolved["decode_linears"], resolved["decode_linears_reason"]) == ("onnxruntime", why)
    # the frozen base's linears packed once (at the first generate); the adapter runs in torch
    assert steps[0]["rollout/mlas_repacked_linears"] > 0 and steps[1]["rollout/mlas_repacked_linears"] == 0
    assert all(r.get("rollout/onnxruntime_graph_step", 0.0) == 0.0 for r in steps)
    assert all(r["actor/lora_trainable_params"] > 0 for r in steps)
