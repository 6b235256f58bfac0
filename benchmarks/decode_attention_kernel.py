"""rlkit's compiled decode attention kernel (``rlkit.rollout.attention_kernel``) against the SDPA the lean
step runs otherwise, one step's attention alone, at SmolLM2's heads.

    OMP_NUM_THREADS=1 python benchmarks/decode_attention_kernel.py [--reps 8]

Builds (or reads from ``$RLKIT_CACHE/kernels``) the kernel for this CPU, checks it against SDPA and times both
per step of 30 layers, interleaved, the order reversed every other rep: ``cold`` (each layer's cache read
after 9 MiB of other memory, as in ``decode_attention.py``) and ``hot`` (one layer's cache, L2-resident,
called 30 times), over fp32 K/V and over a bf16 KV cache (``rlkit.rollout.bf16_kv``: SDPA in bf16 as the lean
step runs it there, and the kernel reading bf16). Each time is also given per (row, KV head, position): what
one position of one KV head costs, whatever the bytes. Attention alone, called from Python: in a whole decode
(``ab.py --change kernel``) SDPA's share of a step is smaller than this suggests (docs/benchmarks.md, "session
30"). Session 30's first version of this script timed a spike of the kernel (AVX-512 only) built from its own
copy of the source; the results files ``*-decode-attention-kernel`` before 2026-12-07 04:30 are that spike's.
Writes ``benchmarks/results/<stamp>-decode-attention-kernel.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_prompt_attention import DIM, HEADS, KV_HEADS, LAYERS  # noqa: E402  (SmolLM2's heads)

SHAPES = [(8, 76), (8, 108), (16, 76), (16, 108), (8, 300), (8, 560)]  # (rows, filled positions L)
VARIANTS = ("sdpa", "kernel", "sdpa16", "kernel16")  # fp32 K/V: SDPA, the kernel; bf16 K/V: the same two
EVICT_BYTES = 9 * 2**20  # ~ a SmolLM2 layer's bf16 weights, read between two layers' attention


def unavailable() -> str | None:
    """Why the kernel cannot run here (``rlkit.rollout.cpu_kernels.kernel_unavailable``), or None."""
    from rlkit.rollout.cpu_kernels import kernel_unavailable

    return kernel_unavailable()


def measure(rows: int, length: int, reps: int, layers: int = LAYERS, evict_bytes: int = EVICT_BYTES) -> dict:
    """Per-step ms (median of ``reps``) of SDPA and the kernel, cold and hot, and the kernel's largest
    difference from SDPA."""
    from rlkit.rollout.attention_kernel import decode_attention, padded_capacity
    from rlkit.rollout.bf16_kv import kv_attention

    torch.manual_seed(0)
    capacity = padded_capacity(length + 32)
    keys = [torch.randn(rows, KV_HEADS, capacity, DIM) for _ in range(layers)]
    keys_t = [k.transpose(-1, -2).contiguous() for k in keys]  # [A, Hkv, D, C]
    values = [torch.randn(rows, KV_HEADS, capacity, DIM) for _ in range(layers)]
    # the bf16 KV cache (rlkit.rollout.bf16_kv): SDPA in bf16 as the lean step runs it, or the kernel on it
    keys16 = [k.bfloat16() for k in keys]
    keys16_t = [k.transpose(-1, -2).contiguous() for k in keys16]
    values16 = [v.bfloat16() for v in values]
    evict = [torch.randn(evict_bytes // 4) for _ in range(layers)]
    q = torch.randn(rows, HEADS, 1, DIM)
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[0, :3] = False  # one row left-padded
    attend = mask[:, None, None, :]
    scale = DIM**-0.5

    def attention(variant: str, i: int) -> torch.Tensor:
        if variant == "sdpa":
            k, v = keys[i][:, :, :length], values[i][:, :, :length]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale, enable_gqa=True)
        if variant == "sdpa16":
            return kv_attention(q, keys16[i][:, :, :length], values16[i][:, :, :length], attend, scale)
        if variant == "kernel16":
            return decode_attention(q, keys16_t[i], values16[i], attend, length, scale)
        return decode_attention(q, keys_t[i], values[i], attend, length, scale)

    def step(variant: str, cold: bool) -> float:
        spent = 0.0
        for i in range(layers):
            if cold:
                evict[i].sum()
            start = time.perf_counter()
            attention(variant, i if cold else 0)
            spent += time.perf_counter() - start
        return spent * 1e3

    runs = [(variant, cold) for cold in (True, False) for variant in VARIANTS]
    for run in runs:
        step(*run)
    times: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
    for r in range(reps):
        for run in runs if r % 2 == 0 else runs[::-1]:
            times[run].append(step(*run))
    ms = {
        f"{variant}_{'cold' if cold else 'hot'}": statistics.median(t) for (variant, cold), t in times.items()
    }
    pairs_positions = rows * KV_HEADS * length * layers
    return {
        "rows": rows,
        "L": length,
        "ms": ms,
        "ns_per_pair_position": {k: v * 1e6 / pairs_positions for k, v in ms.items()},
        "max_abs_diff": float((attention("kernel", 0) - attention("sdpa", 0)).abs().max()),
        # the bf16 cache's two paths against each other (the same rounded K/V; SDPA's bf16 arithmetic)
        "max_abs_diff_bf16": float((attention("kernel16", 0) - attention("sdpa16", 0)).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    from common import kernel_report

    report, library = kernel_report(
        "decode-attention-kernel", "decode_attention_kernel.py", f"{args.reps} reps, median, 30 layers a step"
    )
    report(
        "| rows × L | SDPA cold ms | kernel cold ms | kernel / SDPA cold | SDPA hot ms | kernel hot ms | "
        "kernel / SDPA hot | ns per (row, KV head, position): SDPA / kernel, hot | max abs diff |"
    )
    report("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    results = [measure(rows, length, args.reps) for rows, length in SHAPES]
    for r in results:
        ms, ns = r["ms"], r["ns_per_pair_position"]
        report(
            f"| {r['rows']} × {r['L']} | {ms['sdpa_cold']:.2f} | {ms['kernel_cold']:.2f} | "
            f"{ms['kernel_cold'] / ms['sdpa_cold']:.2f} | {ms['sdpa_hot']:.2f} | {ms['kernel_hot']:.2f} | "
            f"{ms['kernel_hot'] / ms['sdpa_hot']:.2f} | {ns['sdpa_hot']:.0f} / {ns['kernel_hot']:.0f} | "
            f"{r['max_abs_diff']:.0e} |"
        )
    report(
        "Over a bf16 KV cache (rlkit.rollout.bf16_kv): SDPA in bf16 (what the lean step runs there) and the "
        "kernel reading bf16, against the kernel over fp32 K/V"
    )
    report(
        "| rows × L | bf16 SDPA cold ms | bf16 kernel cold ms | bf16 kernel / fp32 kernel, cold | "
        "bf16 kernel / bf16 SDPA, cold | bf16 kernel hot ms | bf16 kernel / fp32 kernel, hot | "
        "max abs diff, bf16 kernel − bf16 SDPA |"
    )
    report("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ms = r["ms"]
        report(
            f"| {r['rows']} × {r['L']} | {ms['sdpa16_cold']:.2f} | {ms['kernel16_cold']:.2f} | "
            f"{ms['kernel16_cold'] / ms['kernel_cold']:.2f} | "
            f"{ms['kernel16_cold'] / ms['sdpa16_cold']:.2f} | "
            f"{ms['kernel16_hot']:.2f} | {ms['kernel16_hot'] / ms['kernel_hot']:.2f} | "
            f"{r['max_abs_diff_bf16']:.0e} |"
        )
    report.save({"args": vars(args), "kernel": library.name, "shapes": results})


if __name__ == "__main__":
    main()
