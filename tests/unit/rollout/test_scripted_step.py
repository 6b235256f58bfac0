"""The lean step's layers under TorchScript (rlkit.rollout.scripted_step) against its Python loop: the same
operators in the same order, so the same tokens and the same log-probs bit for bit — fp32 on four model
families (Qwen2's q/k/v biases, Qwen3's q/k norms, grouped KV heads), through the bf16 decode copy's fused
oneDNN GEMMs and the fp16 copy's fbgemm ones, and with a group's prompt read once for its rows; where it
cannot run (a LoRA adapter, MLAS weights, no TorchScript) the Python loop runs."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decode import CASES, ending_tokens, generate
from test_lean_step import ARCHS, _models, other_archs  # noqa: F401  (the fixture)

from rlkit.rollout import scripted_step
from rlkit.rollout.lean_step import lean_step_for


def assert_identical(a, b) -> None:
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["response_mask"], b["response_mask"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_scripted_layers_decode_exactly_what_the_python_loop_decodes(request, arch):
    tok, model = _models(request, arch)
    kw = {"n": 2, **CASES["sampled"]}
    eos = ending_tokens(tok, model, **kw)
    (scripted, rows), (loop, _) = (
        generate(tok, model, fast=True, lean=True, scripted=on, fused_glue=False, eos=eos, **kw)
        for on in (True, False)
    )
    assert_identical(scripted, loop)
    lengths = loop["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended apart: the slabs were compacted under the script
    assert len(rows) == 1  # the model's forward ran the prefill only
    assert scripted.meta["metrics"]["rollout/scripted_layers"] == 1.0
    assert scripted.meta["metrics"]["rollout/lean_step"] == 1.0
    assert loop.meta["metrics"]["rollout/scripted_layers"] == 0.0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("weights", ["bf16", "fp16"])
def test_the_scripted_layers_run_a_packed_copys_fused_gemms(request, arch, weights):
    """The bf16 copy's oneDNN-packed matrices and the fp16 copy's fbgemm ones (q/k/v and gate/up one matrix
    each; fbgemm adds its biases itself) called from the script: the same tokens and log-probs bit for bit as
    the Python loop over the same copy."""
    from rlkit.hardware import fp16_weights_unavailable
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy

    copy_cls, unavailable = {
        "bf16": (Bf16DecodeCopy, bf16_weights_unavailable),
        "fp16": (Fp16DecodeCopy, fp16_weights_unavailable),
    }[weights]
    if unavailable():
        pytest.skip(unavailable())
    tok, model = _models(request, arch)
    packed = copy_cls(model).module
    step = lean_step_for(packed, scripted=True)
    assert step.scripted is not None and step.scripted.kind == weights
    assert step.scripted.packed == (weights == "bf16")  # the loops' oneDNN path
    parts = step.scripted.parts
    held, empty = ("half", "weights") if weights == "fp16" else ("weights", "half")
    assert [len(g) for g in parts[held][:4]] == [1, 1, 1, 1] and parts[empty][:4] == [[], [], [], []]
    kw = {"n": 2, **CASES["temperature_top_k_top_p"]}
    (scripted, _), (loop, _) = (
        generate(tok, packed, fast=True, lean=True, scripted=on, fused_glue=False, **kw)
        for on in (True, False)
    )
    assert_identical(scripted, loop)
    assert scripted.meta["metrics"]["rollout/scripted_layers"] == 1.0
    assert loop.meta["metrics"]["rollout/scripted_layers"] == 0.0


def test_the_scripted_layers_read_a_groups_prompt_once(tok_and_model, monkeypatch):
    """3 prompts × 4 rows: the shared-prompt attention runs inside the script (the Python loop's function is
    never called) and decodes exactly what the Python loop's shared-prompt attention decodes."""
    from rlkit.rollout import lean_step

    tok, model = tok_and_model
    calls: list[int] = []
    real = lean_step.shared_prompt_attention
    monkeypatch.setattr(
        lean_step, "shared_prompt_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    shared_steps: list[bool] = []
    real_call = scripted_step.ScriptedLayers.__call__

    def counting(self, x, cos, sin, attend, cache, shared, *biases):
        shared_steps.append(shared is not None)
        return real_call(self, x, cos, sin, attend, cache, shared, *biases)

    monkeypatch.setattr(scripted_step.ScriptedLayers, "__call__", counting)
    kw = {"n": 4, "fused_glue": False, **CASES["sampled"]}
    scripted, _ = generate(tok, model, fast=True, lean=True, scripted=True, **kw)
    assert calls == [] and any(shared_steps)  # shared inside the script
    loop, _ = generate(tok, model, fast=True, lean=True, scripted=False, **kw)
    assert calls  # the Python loop shared too
    assert_identical(scripted, loop)


def test_weights_the_script_does_not_take_run_the_python_loop(tok_and_model):
    """A LoRA adapter's layers and ONNX Runtime's MLAS linears are modules the script cannot call: the lean
    step keeps its Python loop and says so (``rollout/scripted_layers`` 0)."""
    from rlkit.hardware import onnxruntime_unavailable
    from rlkit.model.lora import apply_lora
    from rlkit.recipe.schema import LoraConfig

    tok, model = tok_and_model
    assert lean_step_for(model, scripted=True).scripted is not None
    lora, _ = apply_lora(copy.deepcopy(model), LoraConfig(rank=4))
    others = [lora.eval()]
    if onnxruntime_unavailable() is None:
        from rlkit.rollout.mlas_weights import MlasDecodeCopy

        others.append(MlasDecodeCopy(model).module)
    for other in others:
        step = lean_step_for(other, scripted=True)
        assert step is not None and step.scripted is None
        out, _ = generate(tok, other, fast=True, lean=True, scripted=True, n=2, do_sample=False)
        assert out.meta["metrics"]["rollout/lean_step"] == 1.0
        assert out.meta["metrics"]["rollout/scripted_layers"] == 0.0


def test_without_torchscript_the_python_loop_runs_with_a_warning(tok_and_model, monkeypatch):
    tok, model = tok_and_model
    kw = {"n": 2, **CASES["sampled"]}
    loop, _ = generate(tok, model, fast=True, lean=True, scripted=False, **kw)

    def no_source(fn):
        raise OSError("could not get source code")

    monkeypatch.setattr(torch.jit, "script", no_source)
    scripted_step.scripted_layer_loop.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be compiled by TorchScript"):
            assert lean_step_for(model, scripted=True).scripted is None
        out, _ = generate(tok, model, fast=True, lean=True, scripted=True, **kw)
    finally:
        scripted_step.scripted_layer_loop.cache_clear()
    assert out.meta["metrics"]["rollout/scripted_layers"] == 0.0
    assert_identical(out, loop)


@pytest.mark.parametrize("scripted", [True, False])
def test_a_step_past_the_slabs_capacity_is_an_error_on_both_loops(tok_and_model, scripted):
    """Both loops advance the slab through ``SlabLayer.advance``, which refuses a position past its capacity
    before anything is written."""
    from rlkit.errors import RlkitError
    from rlkit.model.kv_cache import cache_argument
    from rlkit.rollout.decode import SlabCache, slab_layers

    _, model = tok_and_model
    ids = torch.randint(0, 50, (2, 4))
    mask = torch.ones(2, 4, dtype=torch.long)
    cache = SlabCache(slab_layers(model), capacity=4)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_argument(model, cache))
        step = lean_step_for(model, scripted=scripted)
        assert (step.scripted is not None) == scripted
        before = cache.layers[0].key_slab.clone()
        with pytest.raises(RlkitError, match="the KV cache holds 4 positions, a step needs 5"):
            step(cache, ids[:, -1:], torch.tensor([4, 4]), torch.ones(2, 5, dtype=torch.long))
    assert torch.equal(cache.layers[0].key_slab, before) and cache.layers[0].length == 4
