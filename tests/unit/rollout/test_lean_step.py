"""The lean decode step (rlkit.rollout.lean_step) against the model's own forward in the fast loop: the same
tokens and log-probs to float rounding, with rows ending at different steps (dropped mid-way), left-padded
prompts of different lengths and grouped KV heads; on the tiny Qwen2 and a tiny Llama, Qwen3 (q/k norms) and
Mistral, fp32 and through the fp16 decode copy. Only the prefill runs the model's forward on the lean path."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import perturbed_model
from test_decode import CASES, ending_tokens, generate

from rlkit.model.tiny import build_tiny_model
from rlkit.rollout.lean_step import lean_step_for


@pytest.fixture(scope="module")
def other_archs(tmp_path_factory):
    """(tokenizer, model) per architecture other than the shared tiny Qwen2, built on first use."""
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            path = build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch=arch, seed=1)
            built[arch] = perturbed_model(path, seed=1)
        return built[arch]

    return get


def _models(request, arch: str):
    if arch == "qwen2":
        return request.getfixturevalue("tok_and_model")
    return request.getfixturevalue("other_archs")(arch)


ARCHS = ["qwen2", "llama", "qwen3", "mistral"]


def assert_close_rollouts(lean, full) -> None:
    assert torch.equal(lean["responses"], full["responses"])
    assert torch.equal(lean["response_mask"], full["response_mask"])
    torch.testing.assert_close(lean["rollout_log_probs"], full["rollout_log_probs"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["greedy", "sampled", "temperature_top_k_top_p"])
def test_the_lean_step_decodes_what_the_models_forward_decodes(request, arch, case):
    tok, model = _models(request, arch)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped KV heads
    kw = {"n": 4, **CASES[case]}
    eos = ending_tokens(tok, model, **kw)
    (lean, lean_rows), (full, full_rows) = (
        generate(tok, model, fast=True, lean=on, eos=eos, **kw) for on in (True, False)
    )
    assert_close_rollouts(lean, full)
    lengths = full["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps: the batch was compacted
    assert min(full_rows[1:]) < len(full)
    assert len(lean_rows) == 1 < len(full_rows)  # on the lean path the model's forward ran the prefill only
    assert lean.meta["metrics"]["rollout/lean_step"] == 1.0
    assert full.meta["metrics"]["rollout/lean_step"] == 0.0


def test_the_lean_step_decodes_through_the_fp16_decode_copy(tok_and_model):
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy

    tok, model = tok_and_model
    copy16 = Fp16DecodeCopy(model).module
    kw = {"n": 4, **CASES["sampled"]}
    eos = ending_tokens(tok, copy16, **kw)
    (lean, lean_rows), (full, _) = (
        generate(tok, copy16, fast=True, lean=on, eos=eos, **kw) for on in (True, False)
    )
    assert_close_rollouts(lean, full)
    assert len(lean_rows) == 1


@pytest.mark.parametrize(
    ("arch", "setting"),
    [
        ("llama", {"pretraining_tp": 2}),
        ("qwen2", {"use_sliding_window": True}),
        ("qwen2", {"sliding_window": 8, "layer_types": None}),
        ("qwen3", {"use_sliding_window": True}),
        ("mistral", {"sliding_window": 8}),
    ],
)
def test_models_the_step_does_not_fit_decode_through_their_forward(request, arch, setting):
    """A tensor-parallel split of the projections, a sliding window or a non-full-attention layer changes
    what attention computes: the lean step declines and the loop runs the model's forward."""
    tok, model = _models(request, arch)
    assert lean_step_for(model) is not None
    other = copy.deepcopy(model)
    for name, value in setting.items():
        if value is None:  # one sliding-window layer among full-attention ones
            value = ["full_attention"] * (other.config.num_hidden_layers - 1) + ["sliding_attention"]
        setattr(other.config, name, value)
    assert lean_step_for(other) is None
    if "layer_types" not in setting:  # (the model maps its masks per layer type when it is built)
        out, rows = generate(tok, other, fast=True, lean=True, n=2, do_sample=False)
        assert len(rows) > 1  # every token through the model's forward
        assert out.meta["metrics"]["rollout/lean_step"] == 0.0


def test_an_fsdp_sharded_model_decodes_through_its_forward(tok_and_model, gloo_world1):
    from torch.distributed.fsdp import fully_shard

    _, model = tok_and_model
    sharded = copy.deepcopy(model)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert lean_step_for(sharded) is None


def test_other_model_classes_decode_through_their_forward(tok_and_model):
    _, model = tok_and_model

    class Custom(type(model)):  # same modules, defined outside transformers: its forward may differ
        pass

    other = copy.deepcopy(model)
    other.__class__ = Custom
    assert lean_step_for(other) is None


def test_the_lean_step_decodes_through_a_lora_adapter(tok_and_model):
    """The actor's LoRA model is the transformers model with PEFT layers in its linears: the lean step calls
    them, so the adapter shapes what it decodes."""
    from rlkit.model.lora import apply_lora
    from rlkit.recipe.schema import LoraConfig

    tok, model = tok_and_model
    torch.manual_seed(0)
    lora, _ = apply_lora(copy.deepcopy(model), LoraConfig(rank=4))
    with torch.no_grad():  # lora_B starts at 0 (no change); move it so the adapter matters
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    assert lean_step_for(lora) is not None
    kw = {"n": 2, **CASES["sampled"]}
    (lean, lean_rows), (full, _) = (
        generate(tok, lora.eval(), fast=True, lean=on, **kw) for on in (True, False)
    )
    assert_close_rollouts(lean, full)
    assert len(lean_rows) == 1
    base = generate(tok, model, fast=True, lean=True, **kw)[0]
    assert not torch.equal(base["rollout_log_probs"], lean["rollout_log_probs"])  # the adapter took part
