"""The lean decode step (rlkit.rollout.lean_step) against the model's own forward in the fast loop: the same
tokens and log-probs to float rounding, with rows ending at different steps (dropped mid-way), left-padded
prompts of different lengths and grouped KV heads; on the tiny Qwen2 and a tiny Llama, Qwen3 (q/k norms) and
Mistral, fp32 and through the fp16 and bf16 decode copies. Only the prefill runs the model's forward on the
lean path."""

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


def assert_close_rollouts(lean, full, tolerance: float = 1e-4) -> None:
    assert torch.equal(lean["responses"], full["responses"])
    assert torch.equal(lean["response_mask"], full["response_mask"])
    torch.testing.assert_close(
        lean["rollout_log_probs"], full["rollout_log_probs"], atol=tolerance, rtol=tolerance
    )


# The bf16 copy rounds every GEMM input to bf16 (8 bits of mantissa): where the lean step's fp32 ops (one
# F.rms_norm, its rotary) and the forward's differ in the last fp32 bit, an input can round to the
# neighbouring bf16 value, one ulp (2**-8 relative) of one element, and which inputs sit on such a boundary
# depends on the CPU's bf16 kernel (AMX: 9e-4 at worst in a log-prob; Zen 4: under 1e-4). Any real
# difference in what the step computes changes the sampled tokens, compared exactly above.
BF16_COPY_TOLERANCE = 5e-3


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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_the_lean_step_decodes_through_a_packed_decode_copy(request, arch, precision):
    """Both packed copies fuse q/k/v and gate/up into one GEMM each (the fp16 copy's for fbgemm, the bf16
    copy's for oneDNN), which the lean step calls itself (Qwen3's q/k norms on their outputs); it decodes what
    the copy's own forward decodes."""
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy

    fused = precision == "bfloat16"  # bf16: the copy's rounding, a looser tolerance
    if fused and bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())
    tok, model = _models(request, arch)
    packed = (Bf16DecodeCopy if fused else Fp16DecodeCopy)(model).module
    step = lean_step_for(packed)
    assert all(layer.qkv is not None and layer.gate_up is not None for layer in step.layers)
    kw = {"n": 4, **CASES["sampled"]}
    eos = ending_tokens(tok, packed, **kw)
    (lean, lean_rows), (full, _) = (
        generate(tok, packed, fast=True, lean=on, eos=eos, **kw) for on in (True, False)
    )
    assert_close_rollouts(lean, full, BF16_COPY_TOLERANCE if fused else 1e-4)
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


def test_a_groups_prompt_is_attended_once_for_its_rows(tok_and_model, monkeypatch):
    """3 prompts × 4 rows in group order: the lean step attends through the group's own prompt K/V
    (rlkit.rollout.shared_prompt) at every step before rows are dropped, and decodes what it decodes with SDPA
    over every row's copy (same tokens, log-probs to float rounding). Its Python loop, where the calls can be
    counted; the scripted one is compared with it in test_scripted_step.py."""
    from rlkit.rollout import lean_step

    tok, model = tok_and_model
    calls: list[int] = []
    real = lean_step.shared_prompt_attention
    monkeypatch.setattr(
        lean_step, "shared_prompt_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    kw = {"n": 4, **CASES["sampled"]}
    eos = ending_tokens(tok, model, **kw)
    shared, _ = generate(tok, model, fast=True, lean=True, scripted=False, eos=eos, **kw)
    used = len(calls)
    monkeypatch.setattr(lean_step, "worth_sharing", lambda *a: False)
    apart, _ = generate(tok, model, fast=True, lean=True, scripted=False, eos=eos, **kw)
    layers = model.config.num_hidden_layers
    assert used >= layers and used % layers == 0 and len(calls) == used  # used, then not
    assert set(calls) == {12}  # only while every group's rows are all in the batch
    lengths = apart["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended apart: the batch was compacted, sharing ended
    assert_close_rollouts(shared, apart)


@pytest.mark.parametrize(("groups", "n", "heads", "kv_heads"), [(2, 4, 9, 3), (3, 2, 4, 2), (1, 5, 2, 2)])
def test_shared_prompt_attention_is_sdpa_over_the_rows_copies(groups, n, heads, kv_heads):
    """Against SDPA over every row's copy of its group's prompt, left padding masked per group."""
    import torch.nn.functional as F

    from rlkit.rollout.shared_prompt import shared_prompt_attention

    torch.manual_seed(0)
    a, d, p, t = groups * n, 8, 7, 3
    prompt_keys, prompt_values = torch.randn(2, groups, kv_heads, p, d).unbind(0)
    own_keys, own_values = torch.randn(2, a, kv_heads, t, d).unbind(0)
    keys = torch.cat([prompt_keys.repeat_interleave(n, 0), own_keys], dim=2)  # [A, Hkv, P + t, D]
    values = torch.cat([prompt_values.repeat_interleave(n, 0), own_values], dim=2)
    mask = torch.ones(a, p + t, dtype=torch.bool)
    for g in range(groups):
        mask[g * n : (g + 1) * n, : g + 1] = False  # group g's prompt is left-padded by g + 1
    q = torch.randn(a, heads, 1, d)
    bias = torch.zeros(a, p + t).masked_fill_(~mask, float("-inf"))
    got = shared_prompt_attention(
        q, keys, values, prompt_keys, prompt_values, bias[::n, None, None, :p], bias[:, None, None, p:], 0.3
    )
    want = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[:, None, None, :], scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_prompts_are_kept_only_for_rows_in_group_order_and_dropped_rows_end_them():
    from rlkit.rollout.decode import SlabCache
    from rlkit.rollout.shared_prompt import MIN_SAVED_FRACTION, SharedPrompt, worth_sharing

    keys = [torch.zeros(2, 1, 10, 4)]
    assert SharedPrompt.of(torch.tensor([0, 0, 1, 1]), keys, keys).rows_per_group == 2
    assert SharedPrompt.of(torch.tensor([0, 1, 0, 1]), keys, keys) is None  # interleaved
    assert SharedPrompt.of(torch.tensor([0, 0, 0, 1]), keys, keys) is None  # unequal groups
    assert SharedPrompt.of(torch.tensor([0, 1]), keys, keys) is None  # one row each: nothing shared
    two = [torch.stack([torch.zeros(1, 10, 4), torch.ones(1, 10, 4)])]
    swapped = SharedPrompt.of(torch.tensor([1, 1, 0, 0]), two, two)  # prompt 1 sorts first among the rows
    assert swapped.keys[0][0].eq(1).all() and swapped.values[0][1].eq(0).all()  # in the rows' group order
    shared = SharedPrompt.of(torch.tensor([0, 0, 1, 1]), keys, keys)
    # saved share (4 - 2) · 10 / (4 · L): 0.5 at L = 10 (the first step), under it at L = 11
    assert MIN_SAVED_FRACTION == 0.5
    assert worth_sharing(shared, 4, 10) and not worth_sharing(shared, 4, 11)
    assert not worth_sharing(shared, 3, 10) and not worth_sharing(None, 4, 10)

    cache = SlabCache(num_layers=1, capacity=12)
    cache.layers[0].update(torch.randn(2, 1, 10, 4), torch.randn(2, 1, 10, 4))
    cache.repeat_rows(torch.tensor([0, 0, 1, 1]), keep_prompts=True)
    assert cache.shared_prompt.groups == 2 and cache.shared_prompt.length == 10
    assert torch.equal(cache.shared_prompt.keys[0][1], cache.layers[0].keys[2])  # the prompt's own K
    cache.batch_select_indices(torch.tensor([0, 1, 2]))
    assert cache.shared_prompt is None
