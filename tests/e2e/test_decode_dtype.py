"""``rollout.backend.dtype: auto`` through ``rlkit run`` on a machine whose probes say bf16 is slow and fp16
decode weights pay back within the run's responses: the run decodes with fbgemm fp16 weights, repacks them
after every weight sync, logs why and how far the rollout's log-probs moved from the actor's.

The hardware cache the run reads (``RLKIT_CACHE``) is this test's own: it holds this machine's key with the
probe readings given below, as a machine of that kind would have measured them. Everything else is real:
the packing, the fp16 GEMMs, the Ray worker and the update."""

from __future__ import annotations

import json
import math

import pytest
from rlkit_harness import TWO_GRADED_STEPS, recipe_text, records, rlkit_env
from rlkit_harness import run as run_rlkit

from rlkit.hardware import (
    Fp16Probe,
    MatmulProbe,
    cached_fp16_probe,
    cached_probe,
    cpu_info,
    fp16_decode_pays,
    fp16_weights_unavailable,
    layer_shapes,
)

pytestmark = pytest.mark.skipif(
    fp16_weights_unavailable() is not None, reason="no fbgemm in this torch build"
)

# bf16 at 1/80 of fp32: slow on any CPU (below the band: rlkit.hardware.cpu); fp16 weights save 4 ms a token
# against 20 ms of packing, so they pay back after 5 tokens and auto asks for 2 x 5 = 10 <= 12 (the responses
# stay short enough for the graded reward, capped at 40 characters, to vary)
SLOW_BF16 = MatmulProbe(fp32_flops=80e9, bf16_flops=1e9, ratios=(0.0125,))
PAYS = Fp16Probe(fp32_s=0.010, fp16_s=0.006, pack_s=0.020, rows=16, params=11_272_192)


# the whole decode step (rlkit.rollout.graph_probe), which decides where linears are auto and the graph could
# decode the model: 12 tokens cost F.linear 120 ms, fp16 weights 2 x 20 + 12 x 4 = 88 ms, the graph 2 x 50 +
# 12 x 8 = 196 ms
FP16_CHEAPEST = dict(fp32_s=0.010, fp16_s=0.004, graph_s=0.008, fp16_pack_s=0.020, graph_pack_s=0.050)


def _run_two_steps(tiny_assets, out, cache, backend: dict):
    """``rlkit run`` of 2 steps (2 prompts × 4, 12 tokens, graded rewards) with ``rollout.backend`` and the
    hardware cache ``cache``; the finished process (asserted to have succeeded)."""
    model, data = tiny_assets
    overrides = TWO_GRADED_STEPS | {"rollout.backend": backend}
    recipe = out.parent / "recipe.yaml"
    recipe.write_text(recipe_text(model, data, out, overrides))
    result = run_rlkit("run", str(recipe), env=rlkit_env(RLKIT_CACHE=str(cache)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("linears", ["torch", "auto"])
def test_auto_decodes_with_fp16_weights_where_they_pay(tiny_assets, tmp_path, linears):
    """``linears: torch``: the per-linear fp16 probe decides the dtype; ``linears: auto`` (the default): the
    tiny Qwen2 is a model the one-graph step takes, so the probe of the whole step decides, here for fp16."""
    model, _ = tiny_assets
    cache = tmp_path / "cache"
    cpu = cpu_info()
    cached_probe(cpu, cache / "hardware.json", probe=lambda: SLOW_BF16)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    layer = layer_shapes(config.to_dict())  # auto probes the run's model's own decoder layer
    cached_fp16_probe(cpu, cache / "hardware.json", layer=layer, probe=lambda layer: PAYS)
    from rlkit.rollout.graph_probe import GraphProbe, cached_graph_probe, graph_choice

    graph = GraphProbe(**FP16_CHEAPEST)
    cached_graph_probe(config.to_dict(), cpu, cache / "hardware.json", probe=lambda config: graph)
    out = tmp_path / "out"
    result = _run_two_steps(tiny_assets, out, cache, {"name": "hf", "linears": linears})

    resolved = json.loads((out / "run_info.json").read_text())["resolved"]
    if linears == "torch":
        why = fp16_decode_pays(PAYS, 12)[1]
        assert (resolved["decode_dtype"], resolved["decode_reason"]) == ("float16", why)
    else:
        from rlkit.hardware.mlas import MLAS_PAYBACK_MARGIN

        why = graph_choice(graph, 12, margin=MLAS_PAYBACK_MARGIN, reduced=True)[2]
        assert why.endswith("-> float16 weights")
        assert (resolved["decode_dtype"], resolved["decode_linears"]) == ("float16", "torch")
        assert resolved["decode_linears_reason"] == why
    assert "rollout decode float16" in result.stdout and why in result.stdout

    # q, k, v, o, gate, up, down per layer and the LM head: every one packed at step 1 (the copy is made)
    # and again at step 2 (after the weight sync that followed step 1's update)
    linears = 7 * config.num_hidden_layers + 1
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for step in steps:
        assert step["rollout/fp16_repacked_linears"] == linears
        assert step["rollout/lean_step"] == 1.0
        assert step["rollout/scripted_layers"] == 1.0  # fbgemm's matrices called from TorchScript
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"])
        assert step["critic/score/min"] < step["critic/score/max"]  # graded rewards vary: a real gradient
        # the fp16-weight policy is not the fp32 actor's: the mismatch is measured, small and non-zero
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert 0 < step["training/rollout_probs_diff_max"] < 0.05


# the whole decode step on a CPU with native bf16 (Zen 4's kind): 12 tokens cost F.linear 120 ms, fp16 weights
# 2 x 20 + 12 x 6 = 112 ms, the graph 2 x 50 + 12 x 8 = 196 ms, bf16 weights 2 x 2 + 12 x 4 = 52 ms
BF16_CHEAPEST = FP16_CHEAPEST | dict(fp16_s=0.006, bf16_s=0.004, bf16_pack_s=0.002)


def test_auto_decodes_with_bf16_weights_where_the_whole_step_probe_finds_them_cheapest(tiny_assets, tmp_path):
    """A recipe that says nothing about the decode, on a machine that trains in fp32 and whose probe of the
    whole decode step found oneDNN-packed bf16 weights cheapest: the run decodes with them (fp32 activations,
    KV cache and sampling), repacks them after every weight sync, says why, and logs how far the rollout's
    log-probs moved from the fp32 actor's."""
    from rlkit.rollout.bf16_weights import bf16_weights_unavailable

    if bf16_weights_unavailable():
        pytest.skip(bf16_weights_unavailable())
    model, _ = tiny_assets
    cache = tmp_path / "cache"
    cpu = cpu_info()
    cached_probe(cpu, cache / "hardware.json", probe=lambda: SLOW_BF16)  # auto trains in fp32 on any CPU
    from transformers import AutoConfig

    from rlkit.hardware.mlas import MLAS_PAYBACK_MARGIN
    from rlkit.rollout.graph_probe import GraphProbe, cached_graph_probe, graph_choice

    config = AutoConfig.from_pretrained(model)
    graph = GraphProbe(**BF16_CHEAPEST)
    cached_graph_probe(config.to_dict(), cpu, cache / "hardware.json", probe=lambda config: graph)
    out = tmp_path / "out"
    result = _run_two_steps(tiny_assets, out, cache, {"name": "hf"})  # dtype and linears: auto

    resolved = json.loads((out / "run_info.json").read_text())["resolved"]
    why = graph_choice(graph, 12, margin=MLAS_PAYBACK_MARGIN, reduced=True)[2]
    assert why.endswith("-> bfloat16 weights")
    assert (resolved["mixed_precision"], resolved["decode_dtype"], resolved["decode_linears"]) == (
        "fp32",
        "bfloat16",
        "torch",
    )
    assert resolved["decode_linears_reason"] == why
    assert "rollout decode bfloat16" in result.stdout and why in result.stdout

    linears = 7 * config.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer and the LM head
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for step in steps:
        assert step["rollout/bf16_repacked_linears"] == linears  # packed at step 1, repacked after the sync
        assert step["rollout/lean_step"] == 1.0
        assert step["rollout/scripted_layers"] == 1.0  # its layers under TorchScript (rollout.scripted_step)
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"])
        assert step["critic/score/min"] < step["critic/score/max"]  # graded rewards vary: a real gradient
        # the bf16-weight policy is not the fp32 actor's: the mismatch is measured, small and non-zero
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert 0 < step["training/rollout_probs_diff_max"] < 0.05
