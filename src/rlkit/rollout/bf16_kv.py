"""A bf16 KV cache for the bf16 decode copy's lean step, once a decode's cache is long.

The bf16 decode copy (``rlkit.rollout.bf16_weights``) keeps activations fp32 and rounds each linear's input to
bf16; its slab cache (``rlkit.rollout.decode.SlabCache``) holds fp32 K/V, and attention reads all of it at
every step: at 8 rows × 512 tokens of SmolLM2 a quarter of the step (docs/benchmarks.md, session 28). With
``DecodePlan.bf16_kv_from`` (default :data:`BF16_KV_MIN_POSITIONS`) a decode under that copy whose steps
attend over at least that many positions on average (prompt width + ``max_new_tokens`` / 2) holds its K/V in
bf16, half the bytes to read — where this CPU attends over bf16 K/V fast (``DecodePlan.bf16_kv_probe``:
:class:`KvAttentionProbe`, timed once per machine and cached beside the other hardware probes; torch's CPU
SDPA in bf16 was 5–8× slower than in fp32 on a Zen 4 in session 15, 0.8× on AMX). The prefill writes its fp32
states rounded to bf16 (and attends over its own fp32 ones, as before), and every later step attends in bf16 —
the query rounded to bf16, scores, softmax and sums accumulated in fp32 by torch's CPU flash kernel, the
output handed to the output projection, which rounds its input to bf16 anyway. Attention:

- :func:`kv_attention`: SDPA with the query heads grouped per KV head (``[A, Hkv, H / Hkv, D]``; no
  ``enable_gqa``), the form that was fastest over a bf16 cache (``benchmarks/decode_attention.py``).
- :func:`shared_prompt_sdpa`: a group's shared prompt read once for its rows (``rlkit.rollout.shared_prompt``)
  as two SDPA calls — the group's queries over its prompt, each row's over its own positions — merged by the
  log-sum-exps the CPU flash kernel returns (``aten::_scaled_dot_product_flash_attention_for_cpu``): fp32
  scores over bf16 K/V, where the explicit-score form would round its scores to bf16 (torch's CPU ``bmm``
  has no fp32 output for bf16 inputs).
- Where the compiled attention kernel attends (``rlkit.rollout.attention_kernel``), it reads the bf16 cache
  itself in place of :func:`kv_attention` (its keys kept transposed in bf16 too), widening each value to fp32
  as it loads it: fp32 arithmetic over half the bytes. Then whether bf16 K/V pay is asked of the kernel over
  each cache (``probe_kv_attention(..., kernel=True)``, cached under its own key): 0.78–0.81× the fp32
  kernel's time at 8 rows × 512 positions of SmolLM2 on AMX, where SDPA's probe read 0.85–0.94.

Both run in the lean step's Python loop and in its TorchScript loop (``rlkit.rollout.scripted_step``), the
same ops, so the two decode the same tokens bit for bit. The rollout's log-probs are those of this decode
(bf16 K/V rounding on top of the copy's bf16 weights); ``algorithm.rollout_correction`` corrects for the
difference from the actor's, as it does for the weights. Where it pays is measured in docs/benchmarks.md ("A
bf16 KV cache", ``benchmarks/ab.py --change bf16kv``).

Shapes: ``A`` rows, ``H``/``Hkv`` query/KV heads, ``D`` head size, ``L`` filled positions, ``g`` groups, ``P``
the shared prompt's width.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlkit.rollout.cold_timing import time_cold_layers

__all__ = [
    "BF16_KV_MAX_RATIO",
    "BF16_KV_MIN_POSITIONS",
    "KvAttentionProbe",
    "bf16_kv_cache_fits",
    "bf16_kv_pays",
    "cached_kv_attention_probe",
    "kv_attention",
    "probe_kv_attention",
    "shared_prompt_sdpa",
]

# the mean positions a step attends over (prompt width + max_new_tokens / 2) from which the bf16 copy keeps
# bf16 K/V. Measured on AMX, SmolLM2, 2 prompts x 2 rows (benchmarks/ab.py --change bf16kv --phase gen): a
# whole generate 0.82-1.02x at 526-token prompts x 64 tokens (mean ~560; 0.92x over 9 reps at 4 rows; a noisy
# host), 0.95x at 44 x 512 (mean ~300), 1.07x (within its reps' noise; fastest
# reps equal) at 44 x 256 (mean ~172), 0.995x at 44 x 64; one step's attention breaks even between 108 and
# 300 positions (benchmarks/decode_attention.py)
BF16_KV_MIN_POSITIONS = 256

# bf16 K/V only where this CPU's probe (KvAttentionProbe) timed attention over them at most this share of
# the fp32 attention's time: measurably faster, the margin above the probe's own spread. On AMX the probe read
# 0.88-0.89 on a quiet host (0.73-0.77 with the other core busy; benchmarks/decode_attention.py, 8 rows x
# 300-560 positions: 0.79-0.85); on Zen 4, session 15 timed torch's CPU SDPA in bf16 5-8x slower than fp32
BF16_KV_MAX_RATIO = 0.95
PROBE_ROWS, PROBE_POSITIONS, PROBE_LAYERS, PROBE_REPS = 8, 512, 8, 5
PROBE_EVICT_BYTES = 32 * 2**20  # read before each layer's attention (probe_kv_attention; 256 MiB in all)


@dataclass(frozen=True)
class KvAttentionProbe:
    """One decode step's attention on this CPU at ``rows`` rows over ``positions`` positions, ``PROBE_LAYERS``
    layers of distinct K/V (median seconds of ``PROBE_REPS`` interleaved reps): fp32 K/V with SDPA over
    ``enable_gqa`` (the lean step's), and bf16 K/V with :func:`kv_attention` — or, where the step attends
    through rlkit's compiled kernel (``rlkit.rollout.attention_kernel``), the kernel over each."""

    fp32_s: float
    bf16_s: float
    rows: int = PROBE_ROWS
    positions: int = PROBE_POSITIONS

    @property
    def pays(self) -> bool:
        """bf16 K/V attend in at most ``BF16_KV_MAX_RATIO`` of the fp32 time."""
        return self.bf16_s <= BF16_KV_MAX_RATIO * self.fp32_s

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> KvAttentionProbe:
        return cls(
            fp32_s=float(entry["fp32_s"]),
            bf16_s=float(entry["bf16_s"]),
            rows=int(entry["rows"]),
            positions=int(entry["positions"]),
        )


def probe_kv_attention(heads: int, kv_heads: int, dim: int, kernel: bool = False) -> KvAttentionProbe:
    """Time both attentions (:class:`KvAttentionProbe`) for a model of ``heads``/``kv_heads`` heads of
    ``dim``, on this process's torch threads (a fraction of a second); ``kernel``: both through rlkit's
    compiled kernel over keys kept transposed (loaded here; an error where it cannot be). Each layer's
    attention is timed on its own, after ``PROBE_EVICT_BYTES`` of other memory is read (a decode layer's
    weights stream through the caches between two attentions), so its K/V come from memory as in a real
    step, not from a large L3."""
    generator = torch.Generator().manual_seed(0)
    shape = (PROBE_ROWS, kv_heads, PROBE_POSITIONS, dim)
    keys = [torch.randn(shape, generator=generator) for _ in range(PROBE_LAYERS)]
    values = [torch.randn(shape, generator=generator) for _ in range(PROBE_LAYERS)]
    keys16, values16 = [k.bfloat16() for k in keys], [v.bfloat16() for v in values]
    q = torch.randn(PROBE_ROWS, heads, 1, dim, generator=generator)
    attend = torch.ones(PROBE_ROWS, 1, 1, PROBE_POSITIONS, dtype=torch.bool)
    scale = dim**-0.5

    def fp32(layer: int) -> None:
        F.scaled_dot_product_attention(
            q, keys[layer], values[layer], attn_mask=attend, scale=scale, enable_gqa=True
        )

    def bf16(layer: int) -> None:
        kv_attention(q, keys16[layer], values16[layer], attend, scale)

    if kernel:
        from rlkit.rollout.attention_kernel import decode_attention  # (it imports nothing of this module)
        from rlkit.rollout.cpu_kernels import kernel_unavailable

        why = kernel_unavailable()  # loads the library
        if why is not None:
            raise RuntimeError(f"rlkit.rollout.bf16_kv: cannot probe the kernel over bf16 K/V: {why}")
        keys_t = [k.transpose(-1, -2).contiguous() for k in keys]  # PROBE_POSITIONS: a multiple of 16
        keys16_t = [k.transpose(-1, -2).contiguous() for k in keys16]

        def fp32(layer: int) -> None:
            decode_attention(q, keys_t[layer], values[layer], attend, PROBE_POSITIONS, scale)

        def bf16(layer: int) -> None:
            decode_attention(q, keys16_t[layer], values16[layer], attend, PROBE_POSITIONS, scale)

    times = time_cold_layers(fp32, bf16, layers=PROBE_LAYERS, evict_bytes=PROBE_EVICT_BYTES, reps=PROBE_REPS)
    return KvAttentionProbe(*times)


def cached_kv_attention_probe(
    heads: int,
    kv_heads: int,
    dim: int,
    cache_path: Path | None = None,
    *,
    probe=probe_kv_attention,
    kernel: bool = False,
) -> KvAttentionProbe:
    """The probe for these heads (``kernel``: through the compiled kernel) on this CPU and torch version from
    the hardware cache (``rlkit.hardware.cpu.cached_entry``: ``$RLKIT_CACHE/hardware.json``), or measured now
    and added to it: one machine decides the same way on every run."""
    from rlkit.hardware import cached_entry, cpu_info

    return cached_entry(
        f"bf16-kv-attention-{'kernel' if kernel else 'cold'}-{heads}-{kv_heads}-{dim}",
        cpu_info(),
        lambda: asdict(probe(heads, kv_heads, dim, kernel)),
        KvAttentionProbe.from_entry,
        cache_path,
    )


def bf16_kv_pays(heads: int, kv_heads: int, dim: int, kernel: bool = False) -> bool:
    """Whether this CPU's probe (:func:`cached_kv_attention_probe`, read once per process and cache file)
    finds bf16 K/V worth it for these heads, attended as the step will attend them (``kernel``: through the
    compiled kernel, else SDPA)."""
    from rlkit.hardware import default_cache_path

    return _pays(heads, kv_heads, dim, default_cache_path(), kernel)


@functools.cache
def _pays(heads: int, kv_heads: int, dim: int, cache_path: Path, kernel: bool = False) -> bool:
    return cached_kv_attention_probe(heads, kv_heads, dim, cache_path, kernel=kernel).pays


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
