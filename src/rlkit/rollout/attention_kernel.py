"""A compiled CPU kernel for the lean decode step's attention (``DecodePlan.attention_kernel``, default on).

At a decode step each row's query heads attend over its cached positions. torch's CPU SDPA spends 57–111 ns
per (row, KV head, position) there on an Intel Xeon with AMX whether the cache is cold or in L2 — time spent
computing small dot products and softmaxes, not reading the cache (docs/benchmarks.md, "session 30"). The
operator ``rlkit::decode_attention`` (``kernels/decode_attention.cpp``) computes the same attention per (row,
KV head): the scores of its query heads for 8 or 16 positions at a time in vector registers over keys kept
transposed (:class:`rlkit.rollout.decode.SlabLayer`'s ``key_slab_t``, written beside the keys; the fused layer
loop writes it a whole block of positions at a time and the kernel reads the positions after the last whole
block from the key slab, ``rlkit.rollout.scripted_step``), a vectorised
softmax, and the weighted sum of the value rows with the outputs held in registers (written fp32, or in the
fused loop over the bf16 decode copy rounded to bf16 for its packed output projection, ``bf16_out``: the bits
torch's cast would give, without a cast operator per layer): 0.56–0.68× SDPA's time per
step of 30 layers at 8–16 rows on that machine, cold, timed alone; in a whole SmolLM2 generate
(``benchmarks/ab.py --change kernel``) 0.94–0.96× at 64 tokens and 0.82–0.94× at 256 — attention is a smaller
share of a real step than of attention timed on its own.

The operator's schema is defined, and the C++ file compiled for this CPU with the step's other operators,
by ``rlkit.rollout.cpu_kernels`` (on first use, cached per machine and torch version). Where that cannot be
(no x86-64 CPU with AVX2 and FMA, no ``g++``, a failed compile), the step attends with SDPA as before and
says why once. Where it can, a probe (:class:`KernelAttentionProbe`, timed once per machine and cached beside
the other hardware probes) keeps it only where it is at most :data:`KERNEL_MAX_RATIO` of SDPA's time
(:func:`kernel_pays`).

Over the bf16 KV cache (``rlkit.rollout.bf16_kv``, chosen for long decodes) the same operator reads bf16 keys
and values, widened to fp32 as they are loaded (half the bytes; the arithmetic stays fp32, where the SDPA it
replaces there computes in bf16): 0.78–0.83× the fp32 kernel's time and 0.41–0.70× bf16 SDPA's per step of
30 cold layers at 8–16 rows and 76–560 positions on the AMX machine
(``benchmarks/decode_attention_kernel.py``; docs/benchmarks.md, "sessions 31–32").

Numerics: fp32 arithmetic; another summation order and a polynomial ``exp`` (1–2 ulp), so the outputs agree
with SDPA's to float rounding (within 1e-6 on random caches), not bit for bit; the two lean loops (Python and
TorchScript, torch's glue) call the same operator on the same transposed keys, so they agree bit for bit with
each other (``tests/unit/rollout/test_attention_kernel.py``); the fused loop's last positions, read from the
key slab, are dot products summed in another order (float rounding again).

Shapes: ``A`` rows, ``H``/``Hkv`` query/KV heads, ``D`` head size, ``C`` slab capacity, ``L`` filled
positions.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlkit.rollout import cpu_kernels  # noqa: F401  (defines rlkit::decode_attention)
from rlkit.rollout.cold_timing import time_cold_layers

__all__ = [
    "KERNEL_MAX_RATIO",
    "KernelAttentionProbe",
    "attends_with_kernel",
    "cached_kernel_probe",
    "decode_attention",
    "kernel_fits",
    "kernel_pays",
    "padded_capacity",
    "probe_kernel",
]

# the kernel only where this CPU's probe timed it at most this share of SDPA's time (AMX, session 30:
# 0.56-0.68 over 30 cold layers at 8-16 rows; benchmarks/decode_attention_kernel.py): a margin for the probe's
# spread, so a machine where it merely ties keeps SDPA
KERNEL_MAX_RATIO = 0.9
HEAD_SIZES = (16, 32, 64, 128)  # the kernel's instantiations (kernels/decode_attention.cpp)
MAX_QUERY_HEADS_PER_KV_HEAD = 8
SLAB_ALIGN = 16  # key_slab_t's capacity is a multiple of this: a vector block may read past the filled length
PROBE_ROWS, PROBE_POSITIONS, PROBE_LAYERS, PROBE_REPS = 8, 128, 8, 5
PROBE_EVICT_BYTES = 8 * 2**20  # read before each layer's attention: its K/V come from memory, as in a step


def padded_capacity(capacity: int) -> int:
    """``key_slab_t``'s positions for a slab of ``capacity``: rounded up to :data:`SLAB_ALIGN`."""
    return -(-capacity // SLAB_ALIGN) * SLAB_ALIGN


def decode_attention(
    q: torch.Tensor,
    keys_t: torch.Tensor,
    values: torch.Tensor,
    attend: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """SDPA's output ``[A, H, 1, D]`` for queries ``q [A, H, 1, D]`` over the first ``length`` positions of
    ``keys_t [A, Hkv, D, C]`` (transposed keys) and ``values [A, Hkv, C, D]`` (both fp32 or both bf16) where
    ``attend [A, 1, 1, L]`` (bool) is true; query head ``h`` reads KV head ``h // (H / Hkv)``. Needs the
    kernel loaded (``rlkit.rollout.cpu_kernels.kernel_unavailable()`` None)."""
    return torch.ops.rlkit.decode_attention(q, keys_t, values, attend, length, scale)


@dataclass(frozen=True)
class KernelAttentionProbe:
    """One decode step's attention on this CPU, ``PROBE_LAYERS`` layers of distinct cold K/V at ``rows`` ×
    ``positions`` (median seconds of ``PROBE_REPS`` interleaved reps): SDPA with ``enable_gqa`` (the lean
    step's) and the kernel."""

    sdpa_s: float
    kernel_s: float
    rows: int = PROBE_ROWS
    positions: int = PROBE_POSITIONS

    @property
    def pays(self) -> bool:
        """The kernel attends in at most ``KERNEL_MAX_RATIO`` of SDPA's time."""
        return self.kernel_s <= KERNEL_MAX_RATIO * self.sdpa_s

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> KernelAttentionProbe:
        return cls(
            sdpa_s=float(entry["sdpa_s"]),
            kernel_s=float(entry["kernel_s"]),
            rows=int(entry["rows"]),
            positions=int(entry["positions"]),
        )


def probe_kernel(heads: int, kv_heads: int, dim: int) -> KernelAttentionProbe:
    """Time SDPA and the kernel (:class:`KernelAttentionProbe`) for ``heads``/``kv_heads`` heads of ``dim`` on
    this process's torch threads (a fraction of a second); each layer's attention is timed after
    ``PROBE_EVICT_BYTES`` of other memory is read. Needs the kernel loaded."""
    generator = torch.Generator().manual_seed(0)
    capacity = padded_capacity(PROBE_POSITIONS)
    keys = [
        torch.randn(PROBE_ROWS, kv_heads, capacity, dim, generator=generator) for _ in range(PROBE_LAYERS)
    ]
    keys_t = [k.transpose(-1, -2).contiguous() for k in keys]
    values = [
        torch.randn(PROBE_ROWS, kv_heads, capacity, dim, generator=generator) for _ in range(PROBE_LAYERS)
    ]
    q = torch.randn(PROBE_ROWS, heads, 1, dim, generator=generator)
    attend = torch.ones(PROBE_ROWS, 1, 1, PROBE_POSITIONS, dtype=torch.bool)
    scale = dim**-0.5

    def sdpa(layer: int) -> None:
        k, v = keys[layer][:, :, :PROBE_POSITIONS], values[layer][:, :, :PROBE_POSITIONS]
        F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale, enable_gqa=True)

    def kernel(layer: int) -> None:
        decode_attention(q, keys_t[layer], values[layer], attend, PROBE_POSITIONS, scale)

    times = time_cold_layers(
        sdpa, kernel, layers=PROBE_LAYERS, evict_bytes=PROBE_EVICT_BYTES, reps=PROBE_REPS
    )
    return KernelAttentionProbe(*times)


def cached_kernel_probe(
    heads: int, kv_heads: int, dim: int, cache_path: Path | None = None, *, probe=probe_kernel
) -> KernelAttentionProbe:
    """The probe for these heads on this CPU and torch version from the hardware cache
    (``rlkit.hardware.cpu.cached_entry``), or measured now and added to it."""
    from rlkit.hardware import cached_entry, cpu_info

    return cached_entry(
        f"decode-attention-kernel-{heads}-{kv_heads}-{dim}",
        cpu_info(),
        lambda: asdict(probe(heads, kv_heads, dim)),
        KernelAttentionProbe.from_entry,
        cache_path,
    )


def kernel_pays(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether this CPU's probe (:func:`cached_kernel_probe`, read once per process and cache file) finds the
    kernel worth it for these heads."""
    from rlkit.hardware import default_cache_path

    return _pays(heads, kv_heads, dim, default_cache_path())


@functools.cache
def _pays(heads: int, kv_heads: int, dim: int, cache_path: Path) -> bool:
    return cached_kernel_probe(heads, kv_heads, dim, cache_path).pays


def attends_with_kernel(cache) -> bool:
    """Whether a lean step over ``cache`` (``rlkit.rollout.decode.SlabCache``) attends with the kernel: its
    slabs keep their keys transposed too (the decode asked for them: ``DecodePlan.attention_kernel``), fp32 or
    bf16 (``rlkit.rollout.bf16_kv``'s cache)."""
    slab = cache.layers[0].key_slab_t if cache.layers else None
    return slab is not None and slab.dtype in (torch.float32, torch.bfloat16)


def kernel_fits(lean) -> bool:
    """Whether lean step ``lean`` (``rlkit.rollout.lean_step.LeanStep``) has heads the kernel is built for, on
    the CPU, with fp32 states (its queries, and its K/V unless the bf16 KV cache holds them)."""
    layers = getattr(lean, "layers", None)
    if not layers or lean.kv_heads <= 0 or lean.heads % lean.kv_heads:
        return False
    if lean.dim not in HEAD_SIZES or lean.heads // lean.kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD:
        return False
    embedding = lean.model.embed_tokens.weight
    return embedding.device.type == "cpu" and embedding.dtype == torch.float32
