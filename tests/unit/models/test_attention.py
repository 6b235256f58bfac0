"""Grouped eager attention (rlkit.model.attention): transformers' eager attention's numbers (to the rounding
of a GEMM that sums in another order) without copying a KV head per query head, a long causal pass in
blocks; what the actor trains with on a CPU."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from rlkit.model import attention
from rlkit.model.attention import (
    CAUSAL_BLOCK,
    GROUPED_EAGER,
    causal_blocks,
    cpu_training_attention,
    eager_kind,
    grouped_eager_attention,
    grouped_eager_name,
)
from rlkit.model.load import load_model, load_tokenizer
from rlkit.model.tiny import build_tiny_model
from rlkit.recipe.schema import ModelConfig


class _Attn(torch.nn.Module):  # what the attention functions read from the calling module
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(dtype, mask: str, b=3, heads=6, kv_heads=2, t=5, length=7, d=8):
    torch.manual_seed(0)
    # the query as the model hands it: [B, T, H, D] projected, transposed to [B, H, T, D] (not contiguous)
    q = torch.randn(b, t, heads, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, kv_heads, length, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv_heads, length, d, dtype=dtype, requires_grad=True)
    if mask == "none":
        return q, k, v, None
    rows = 1 if mask == "shared" else heads
    additive = torch.zeros(b, rows, t, length, dtype=dtype)
    additive[0, :, :, :2] = torch.finfo(dtype).min  # left padding of row 0
    additive[:, :, :, length - t : length] += torch.triu(torch.full((t, t), torch.finfo(dtype).min), 1).to(
        dtype
    )
    additive[1] += torch.randn(rows, t, length).to(dtype)  # a bias that differs per head where it can
    return q, k, v, additive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["shared", "per_head", "none"])
def test_equals_transformers_eager_attention(dtype, mask):
    """Outputs, probabilities and the gradients of query, key and value equal eager attention's (repeat_kv,
    then [B, H, T, L] scores) to the dtype's rounding, for a mask shared by the heads, one per head, and
    none (a GEMM over G·T rows may sum in another order than one over T)."""
    results = []
    for fn in (eager_attention_forward, grouped_eager_attention):
        q, k, v, m = _inputs(dtype, mask)
        out, probs = fn(_Attn(3), q, k, v, m, scaling=0.3, dropout=0.0)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results.append((out, probs, q.grad, k.grad, v.grad))
    (out_e, probs_e, *grads_e), (out_g, probs_g, *grads_g) = results
    assert out_g.shape == (3, 5, 6, 8) and out_g.is_contiguous()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(out_g, out_e, **tol)
    # [B, Hkv, G·T, L] is [B, H, T, L] in order
    torch.testing.assert_close(probs_g.reshape(probs_e.shape), probs_e, **tol)
    for got, want in zip(grads_g, grads_e, strict=True):
        torch.testing.assert_close(got, want, **tol)
    assert grads_g[1].abs().sum() > 0 and grads_g[2].abs().sum() > 0


def _causal_inputs(dtype, t: int, length: int, b=2, heads=6, kv_heads=2, d=8, pad=3):
    """Inputs of a causal layer: ``t`` queries, the last of ``length`` positions; row 0 left-padded."""
    torch.manual_seed(0)
    q = torch.randn(b, t, heads, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, kv_heads, length, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv_heads, length, d, dtype=dtype, requires_grad=True)
    low = torch.finfo(dtype).min
    additive = torch.zeros(b, 1, t, length, dtype=dtype)
    additive[:, :, :, length - t :] = torch.triu(torch.full((t, t), low), 1).to(dtype)
    additive[0, :, :, :pad] = low
    return q, k, v, additive


def test_causal_blocks_cover_the_queries_and_skip_only_masked_keys():
    """Blocks of CAUSAL_BLOCK queries, a short tail joined to the last; each reads keys up to its last
    query's position; one block where the layer is not causal, the mask is None or boolean, the queries are
    few, or the mask lets a query see a later key."""
    attn = _Attn(3)
    *_, mask = _causal_inputs(torch.float32, 526, 526)
    assert CAUSAL_BLOCK == 128
    assert causal_blocks(attn, 526, 526, mask) == [
        (0, 128, 128),
        (128, 256, 256),
        (256, 384, 384),
        (384, 526, 526),
    ]
    *_, mask = _causal_inputs(torch.float32, 300, 344)  # 44 prompt positions before 300 queries
    assert causal_blocks(attn, 300, 344, mask) == [(0, 128, 172), (128, 300, 344)]
    whole = [(0, 526, 526)]
    *_, mask = _causal_inputs(torch.float32, 526, 526)
    assert causal_blocks(attn, 255, 255, mask[:, :, :255, :255]) == [(0, 255, 255)]
    assert causal_blocks(attn, 526, 526, None) == whole
    assert causal_blocks(attn, 526, 526, mask == 0) == whole
    attn.is_causal = False
    assert causal_blocks(attn, 526, 526, mask) == whole
    attn.is_causal = True
    mask[1, 0, 5, 400] = 0.0  # query 5 of row 1 sees key 400
    assert causal_blocks(attn, 526, 526, mask) == whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [300, 344])
def test_causal_blocks_give_eager_attention(dtype, length):
    """300 queries (3 blocks' worth) over their own keys and over a 44-position prefix: the outputs and the
    gradients of query, key and value equal eager attention's full matrix (bitwise in bf16 on the machines
    measured; to rounding), except a query that sees no key (row 0's left padding), whose output nothing
    reads; no probabilities are returned."""
    results = []
    for fn in (eager_attention_forward, grouped_eager_attention):
        q, k, v, m = _causal_inputs(dtype, 300, length)
        out, probs = fn(_Attn(3), q, k, v, m, scaling=0.3, dropout=0.0)
        seen = torch.ones(out.shape[:2], dtype=torch.bool)
        seen[0, : max(0, 3 - (length - 300))] = False  # row 0's padding queries (no key to see)
        (
            out.float() * seen[..., None, None] * torch.linspace(-1, 1, out.numel()).view(out.shape)
        ).sum().backward()
        results.append((out[seen], probs, q.grad, k.grad, v.grad))
    (out_e, _, *grads_e), (out_g, probs_g, *grads_g) = results
    assert probs_g is None
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(out_g, out_e, **tol)
    for got, want in zip(grads_g, grads_e, strict=True):
        torch.testing.assert_close(got, want, **tol)
    assert grads_g[1][:, :, -1].abs().sum() > 0  # the last key, which only the last block reads


@pytest.mark.parametrize("length", [5, 300])
def test_a_model_trains_with_it_as_with_eager(tmp_path, length, monkeypatch):
    """A tiny Llama (4 query heads over 2 KV heads) set to the grouped attention: the logits and weight
    gradients of transformers' eager, on a left-padded batch (fp32: to float rounding), with 5 positions and
    with 300 (causal blocks); an actor on a CPU picks it for the model types it covers, else eager for bf16
    and the model's own for fp32."""
    cfg = ModelConfig(path=str(build_tiny_model(tmp_path / "llama", arch="llama", kv_heads=2)))
    model = load_model(cfg, tokenizer=load_tokenizer(cfg))
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(5, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :2] = 0
    ids[1, :2] = 0
    blocks = []
    monkeypatch.setattr(
        attention, "causal_blocks", lambda *a: blocks.append(len(found := causal_blocks(*a))) or found
    )
    runs = {}
    for name in ("eager", grouped_eager_name()):
        model.set_attn_implementation(name)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits * mask[..., None]).square().mean().backward()
        runs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (logits_e, grads_e), (logits_g, grads_g) = runs.values()
    # a padding position sees no key: its logits (read by nothing) may differ with causal blocks
    torch.testing.assert_close(logits_g[mask.bool()], logits_e[mask.bool()], rtol=1e-5, atol=1e-6)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_g[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert grads_g["model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0
    assert blocks and set(blocks) == {1 if length < 2 * CAUSAL_BLOCK else 2}, blocks  # every layer
    assert (
        cpu_training_attention(model, bf16=True) == cpu_training_attention(model, bf16=False) == GROUPED_EAGER
    )
    assert eager_kind(GROUPED_EAGER) and eager_kind("eager")
    model.config.model_type = "gemma2"  # soft-capped attention: not covered
    assert cpu_training_attention(model, bf16=True) == "eager" and not eager_kind("sdpa")
    assert cpu_training_attention(model, bf16=False) is None  # the model's own (SDPA) stays
