"""One ONNX Runtime graph per decode step (rlkit.rollout.ort_step: ``rollout.backend.linears: onnxruntime``
on a model the lean step accepts) against the fp32 lean step: the same tokens and log-probs to float
rounding, with rows ending at different steps (the batch compacted mid-way), left-padded prompts of different
lengths and grouped KV heads, on the tiny Qwen2 and a tiny Llama, Qwen3 (q/k norms) and Mistral. The model's
forward runs the prefill only; a model the graph does not take decodes on per-linear sessions instead."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_decode import CASES, ending_tokens, generate
from test_lean_step import ARCHS, _models, assert_close_rollouts, other_archs  # noqa: F401 - a fixture

from rlkit.builtin.params import HFRolloutParams
from rlkit.hardware import onnxruntime_unavailable
from rlkit.rollout.hf import HFRollout

pytestmark = pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")

ON_ORT = functools.partial(HFRollout, params=HFRolloutParams(dtype="float32", linears="onnxruntime"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["greedy", "sampled", "temperature_top_k_top_p"])
def test_the_graph_step_decodes_what_the_fp32_lean_step_decodes(request, arch, case):
    tok, model = _models(request, arch)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped KV heads
    kw = {"n": 4, **CASES[case]}
    eos = ending_tokens(tok, model, **kw)
    (graph, graph_rows), (lean, _) = (
        generate(tok, model, fast=True, lean=True, eos=eos, cls=cls, **kw) for cls in (ON_ORT, HFRollout)
    )
    assert_close_rollouts(graph, lean)
    lengths = graph["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps: the batch was compacted
    assert len(graph_rows) == 1  # the model's forward ran the prefill only
    metrics = graph.meta["metrics"]
    assert metrics["rollout/onnxruntime_graph_step"] == 1.0 and metrics["rollout/lean_step"] == 1.0
    assert metrics["rollout/mlas_repacked_linears"] == 7 * model.config.num_hidden_layers + 1
    assert metrics["perf/decode_weights_s"] > 0  # the graph's session was built for this generate
    assert "rollout/onnxruntime_graph_step" not in lean.meta["metrics"]
    assert lean.meta["metrics"]["perf/decode_weights_s"] >= 0  # the module itself decoded


def test_the_graph_step_follows_the_plan_off_the_lean_step(tok_and_model):
    """``DecodePlan(lean_step=False)`` decodes through the model's forward, graph or not."""
    tok, model = tok_and_model
    slab, rows = generate(tok, model, fast=True, lean=False, cls=ON_ORT, n=2, do_sample=False)
    assert slab.meta["metrics"]["rollout/onnxruntime_graph_step"] == 0.0 and len(rows) > 1


def test_a_model_the_graph_does_not_take_decodes_on_per_linear_sessions(tok_and_model):
    tok, model = tok_and_model
    model = copy.deepcopy(model)
    model.config.hidden_act = "gelu"  # not the graph's SiLU (the module itself still runs SiLU)
    kw = {"n": 3, **CASES["sampled"]}
    (got, _), (want, _) = (
        generate(tok, model, fast=True, lean=True, cls=cls, **kw) for cls in (ON_ORT, HFRollout)
    )
    assert_close_rollouts(got, want)
    metrics = got.meta["metrics"]
    assert "rollout/onnxruntime_graph_step" not in metrics
    assert metrics["rollout/mlas_repacked_linears"] == sum(
        type(m) is torch.nn.Linear for m in model.modules()
    )


def test_a_lora_model_decodes_its_adapter_on_per_linear_sessions(tok_and_model):
    """PEFT's layers in the projections: the graph would compute the base weights alone, so the model decodes
    on per-linear sessions, the adapter in torch, and the adapter shapes what it decodes."""
    from rlkit.model.lora import apply_lora
    from rlkit.recipe.schema import LoraConfig

    tok, model = tok_and_model
    torch.manual_seed(0)
    lora, _ = apply_lora(copy.deepcopy(model), LoraConfig(rank=4))
    with torch.no_grad():  # lora_B starts at 0 (no change); move it so the adapter matters
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    kw = {"n": 2, **CASES["sampled"]}
    (got, _), (want, _) = (
        generate(tok, lora.eval(), fast=True, lean=True, cls=cls, **kw) for cls in (ON_ORT, HFRollout)
    )
    assert_close_rollouts(got, want)
    assert "rollout/onnxruntime_graph_step" not in got.meta["metrics"]
    assert got.meta["metrics"]["rollout/mlas_repacked_linears"] > 0
    base = generate(tok, model, fast=True, lean=True, cls=ON_ORT, **kw)[0]
    assert not torch.equal(base["rollout_log_probs"], got["rollout_log_probs"])  # the adapter took part


def test_a_bf16_module_decodes_on_per_linear_sessions(tok_and_model):
    """The prefill runs the module itself, so a bf16 module would fill a bf16 cache the fp32 graph cannot
    read (it ran on it unnoticed before the check): it decodes on the copy's per-linear sessions instead."""
    tok, model = tok_and_model
    half = copy.deepcopy(model).to(torch.bfloat16)
    got, _ = generate(tok, half, fast=True, lean=True, cls=ON_ORT, n=2, do_sample=False)
    assert "rollout/onnxruntime_graph_step" not in got.meta["metrics"]
    assert got.meta["metrics"]["rollout/mlas_repacked_linears"] > 0 and got["response_mask"].sum() > 0
