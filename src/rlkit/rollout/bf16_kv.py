"""A bf16 KV cache for the bf16 decode copy's lean step, once a decode's cache is long.

The bf16 decode copy (``rlkit.rollout.bf16_weights``) keeps activations fp32 and rounds each linear's input
to bf16; its slab cache (``rlkit.rollout.decode.SlabCache``) holds fp32 K/V, and attention reads all of it at
every step: at 8 rows × 512 tokens of SmolLM2 a quarter of the step (docs/benchmarks.md, session 28). With
``DecodePlan.bf16_kv_from`` (default :data:`BF16_KV_MIN_POSITIONS`) a decode under that copy whose steps
attend over at least that many positions on average (prompt width + ``max_new_tokens`` / 2) holds its K/V in
bf16, half the bytes to read: the prefill
writes its fp32 states rounded to bf16 (and attends over its own fp32 ones, as before), and every later step
attends in bf16 — the query rounded to bf16, scores, softmax and sums accumulated in fp32 by torch's CPU flash
kernel, the output handed to the output projection, which rounds its input to bf16 anyway. Attention:

- :func:`kv_attention`: SDPA with the query heads grouped per KV head (``[A, Hkv, H / Hkv, D]``; no
  ``enable_gqa``), the form that was fastest over a bf16 cache (``benchmarks/decode_attention.py``).
- :func:`shared_prompt_sdpa`: a group's shared prompt read once for its rows (``rlkit.rollout.shared_prompt``)
  as two SDPA calls — the group's queries over its prompt, each row's over its own positions — merged by the
  log-sum-exps the CPU flash kernel returns (``aten::_scaled_dot_product_flash_attention_for_cpu``): fp32
  scores over bf16 K/V, where the explicit-score form would round its scores to bf16 (torch's CPU ``bmm``
  has no fp32 output for bf16 inputs).

Both run in the lean step's Python loop and in its TorchScript loop (``rlkit.rollout.scripted_step``), the
same ops, so the two decode the same tokens bit for bit. The rollout's log-probs are those of this decode
(bf16 K/V rounding on top of the copy's bf16 weights); ``algorithm.rollout_correction`` corrects for the
difference from the actor's, as it does for the weights. Where it pays is measured in docs/benchmarks.md ("A
bf16 KV cache", ``benchmarks/ab.py --change bf16kv``).

Shapes: ``A`` rows, ``H``/``Hkv`` query/KV heads, ``D`` head size, ``L`` filled positions, ``g`` groups, ``P``
the shared prompt's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BF16_KV_MIN_POSITIONS", "bf16_kv_cache_fits", "kv_attention", "shared_prompt_sdpa"]

# the mean positions a step attends over (prompt width + max_new_tokens / 2) from which the bf16 copy keeps
# bf16 K/V. Measured on AMX, SmolLM2, 2 prompts x 4 rows (benchmarks/ab.py --change bf16kv --phase gen): a
# whole generate 0.82x at 526-token prompts x 64 tokens (mean ~560), 1.07x (within its reps' noise; fastest
# reps equal) at 44 x 256 (mean ~172), 0.995x at 44 x 64; one step's attention breaks even between 108 and
# 300 positions (benchmarks/decode_attention.py)
BF16_KV_MIN_POSITIONS = 256


def bf16_kv_cache_fits(lean) -> bool:
    """Whether lean step ``lean`` (``rlkit.rollout.lean_step.LeanStep``) can decode over a bf16 cache: on the
    CPU, every projection of every layer the bf16 decode copy's oneDNN-packed linear (which rounds its input
    to bf16, so attention's output loses nothing more in bf16)."""
    from rlkit.rollout.bf16_weights import Bf16FusedLinear, Bf16Linear

    def packed(linear) -> bool:
        return type(linear) is Bf16Linear or type(getattr(linear, "group", None)) is Bf16FusedLinear

    layers = getattr(lean, "layers", None)
    if not layers or lean.model.embed_tokens.weight.device.type != "cpu":
        return False
    return all(
        packed(linear)
        for layer in layers
        for linear in (
            layer.q_proj,
            layer.k_proj,
            layer.v_proj,
            layer.o_proj,
            layer.gate_proj,
            layer.up_proj,
            layer.down_proj,
        )
    )


def kv_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA's output ``[A, H, 1, D]`` (in ``q``'s dtype) for queries ``q [A, H, 1, D]`` over ``keys``,
    ``values [A, Hkv, L, D]`` in their dtype, boolean mask ``attend [A, 1, 1, L]``; query head ``h`` reads KV
    head ``h // (H / Hkv)``."""
    a, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(a, kv_heads, heads // kv_heads, d).to(keys.dtype)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=attend, scale=scale)
    return out.to(q.dtype).view(a, heads, 1, d)


def shared_prompt_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    prompt_bias: torch.Tensor,
    response_bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``rlkit.rollout.shared_prompt.shared_prompt_attention``'s output ``[A, H, 1, D]`` (same arguments) as
    two SDPA calls in the K/V's dtype (the queries and additive masks cast to it) merged in fp32 by their
    log-sum-exps, returned in ``q``'s dtype."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    a, heads, _, d = q.shape
    g, kv_heads, p = prompt_keys.shape[0], prompt_keys.shape[1], prompt_keys.shape[2]
    n, per, dtype = a // g, heads // kv_heads, prompt_keys.dtype
    by_row = q.reshape(a, kv_heads, per, d).to(dtype)  # [A, Hkv, per, D]
    by_group = by_row.view(g, n, kv_heads, per, d).transpose(1, 2).reshape(g, kv_heads, n * per, d)
    prompt_out, prompt_lse = flash(
        by_group, prompt_keys, prompt_values, 0.0, False, attn_mask=prompt_bias.to(dtype), scale=scale
    )  # [g, Hkv, n · per, D], [g, Hkv, n · per]
    prompt_out = prompt_out.view(g, kv_heads, n, per, d).transpose(1, 2).reshape(a, kv_heads, per, d)
    prompt_lse = prompt_lse.view(g, kv_heads, n, per).transpose(1, 2).reshape(a, kv_heads, per)
    own_out, own_lse = flash(
        by_row, keys[:, :, p:], values[:, :, p:], 0.0, False, attn_mask=response_bias.to(dtype), scale=scale
    )  # [A, Hkv, per, D], [A, Hkv, per]
    lse = torch.logaddexp(prompt_lse, own_lse)  # [A, Hkv, per], fp32
    out = (
        prompt_out.float() * (prompt_lse - lse).exp()[..., None]
        + own_out.float() * (own_lse - lse).exp()[..., None]
    )
    return out.to(q.dtype).reshape(a, heads, 1, d)
