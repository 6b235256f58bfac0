"""Grouped eager attention (rlkit.model.attention): transformers' eager attention's numbers (to the rounding
of a GEMM that sums in another order) without copying a KV head per query head; what the bf16 actor trains
with on a CPU."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from rlkit.model.attention import (
    GROUPED_EAGER,
    cpu_bf16_attention,
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


def test_a_model_trains_with_it_as_with_eager(tmp_path):
    """A tiny Llama (4 query heads over 2 KV heads) set to the grouped attention: the logits and weight
    gradients of transformers' eager, on a left-padded batch (fp32: to float rounding); bf16 on a CPU picks
    it for the model types it covers and eager for others."""
    cfg = ModelConfig(path=str(build_tiny_model(tmp_path / "llama", arch="llama", kv_heads=2)))
    model = load_model(cfg, tokenizer=load_tokenizer(cfg))
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    runs = {}
    for name in ("eager", grouped_eager_name()):
        model.set_attn_implementation(name)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits * mask[..., None]).square().mean().backward()
        runs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (logits_e, grads_e), (logits_g, grads_g) = runs.values()
    torch.testing.assert_close(logits_g, logits_e, rtol=1e-5, atol=1e-6)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_g[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert grads_g["model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0
    assert cpu_bf16_attention(model) == GROUPED_EAGER and eager_kind(GROUPED_EAGER) and eager_kind("eager")
    model.config.model_type = "gemma2"  # soft-capped attention: not covered
    assert cpu_bf16_attention(model) == "eager" and not eager_kind("sdpa")
