"""One decode step's attention over the slab cache, in every eager formulation torch offers, against the
time its K/V bytes take to read.

    OMP_NUM_THREADS=1 python benchmarks/decode_attention.py [--reps 8]

The lean decode step (``rlkit.rollout.lean_step``, ``rlkit.rollout.scripted_step``) attends with
``F.scaled_dot_product_attention(..., enable_gqa=True)`` over each row's slab views ``[A, Hkv, L, D]``
(``rlkit.rollout.decode.SlabLayer``). At 8-16 rows that attention is a quarter of a SmolLM2 step on one
core (``decode_profile.py``). This asks whether another formulation reads the same cache faster:

- ``sdpa_gqa``: what the step runs (the query heads of one KV head expanded by SDPA);
- ``sdpa_grouped``: the ``H / Hkv`` query heads of a KV head as that many query positions of one head
  (``q.view(A, Hkv, H / Hkv, D)``: no expansion; the same numbers within float rounding);
- ``matmul``: scores, mask, softmax and the weighted sum as batched matmuls (``shared_prompt``'s ops);
- ``bf16_kv``: ``sdpa_grouped`` over a bf16 copy of the cache (half the bytes; K/V rounded to bf16), as
  ``rlkit.rollout.bf16_kv.kv_attention`` runs it where the decode keeps bf16 K/V (session 29).

SmolLM2's heads (9 query, 3 KV, 64 wide), 30 layers with distinct caches and a layer's weights' worth of
bytes (9 MiB) read between two layers' attention, so each layer's cache is as cold as in a real step. The
bound is the fp32 cache's bytes over the measured read bandwidth (``common.memory_bandwidth``). Variants run
interleaved, the order reversed every other rep; medians per step (30 layers). Writes
``benchmarks/results/<stamp>-decode-attention.{json,md}``.
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
from shared_prompt_attention import DIM, HEADS, KV_HEADS, LAYERS  # noqa: E402  (SmolLM2's heads, one place)

SHAPES = [(8, 108), (16, 76), (16, 108), (8, 300), (8, 560)]  # (rows, filled positions L)
VARIANTS = ("sdpa_gqa", "sdpa_grouped", "matmul", "bf16_kv")
LAYER_BYTES = 9 * 2**20  # ~ a SmolLM2 layer's bf16 weights, read between two layers' attention


def measure(
    rows: int, length: int, reps: int, bandwidth: float, layers: int = LAYERS, evict_bytes: int = LAYER_BYTES
) -> dict:
    """Per-step ms of every variant at one shape (median of ``reps``; ``layers`` per step, ``evict_bytes``
    read between two), the bound and the largest difference of each variant's output from ``sdpa_gqa``'s."""
    from rlkit.rollout.bf16_kv import kv_attention

    torch.manual_seed(0)
    per = HEADS // KV_HEADS
    capacity = length + 32  # views into a larger slab, as the step reads them
    keys = [torch.randn(rows, KV_HEADS, capacity, DIM) for _ in range(layers)]
    values = [torch.randn(rows, KV_HEADS, capacity, DIM) for _ in range(layers)]
    keys16, values16 = [k.bfloat16() for k in keys], [v.bfloat16() for v in values]
    evict = [torch.randn(evict_bytes // 4) for _ in range(layers)]
    q = torch.randn(rows, HEADS, 1, DIM)
    attend = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    attend[0, ..., :3] = False  # one row left-padded
    scale = DIM**-0.5

    def attention(variant: str, i: int) -> torch.Tensor:
        k, v = keys[i][:, :, :length], values[i][:, :, :length]
        grouped = q.view(rows, KV_HEADS, per, DIM)
        if variant == "sdpa_gqa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale, enable_gqa=True)
        if variant == "sdpa_grouped":
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=attend, scale=scale)
        elif variant == "matmul":
            scores = torch.matmul(grouped, k.transpose(-1, -2)).mul_(scale)
            scores.masked_fill_(~attend, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
        else:  # bf16_kv: rlkit's own (rlkit.rollout.bf16_kv), already [A, H, 1, D] in fp32
            return kv_attention(q, keys16[i][:, :, :length], values16[i][:, :, :length], attend, scale)
        return out.reshape(rows, HEADS, 1, DIM)

    def step(variant: str) -> float:
        spent = 0.0
        for i in range(layers):
            evict[i].sum()  # the layer's weights stream through the caches
            start = time.perf_counter()
            attention(variant, i)
            spent += time.perf_counter() - start
        return spent * 1e3

    for variant in VARIANTS:
        step(variant)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(reps):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            times[variant].append(step(variant))
    reference = attention("sdpa_gqa", 0)
    kv_bytes = 2 * rows * KV_HEADS * length * DIM * 4 * layers
    return {
        "rows": rows,
        "L": length,
        "ms": {v: statistics.median(t) for v, t in times.items()},
        "bound_ms": kv_bytes / bandwidth * 1e3,
        "max_abs_diff": {v: float((attention(v, 0) - reference).abs().max()) for v in VARIANTS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    from common import Report, hardware_line, memory_bandwidth, one_thread

    one_thread()
    bandwidth = memory_bandwidth()
    report = Report("decode-attention")
    report(hardware_line(), f"| read bandwidth {bandwidth / 1e9:.1f} GB/s | {args.reps} reps, median")
    report(
        "| rows × L | K/V bytes' bound ms | "
        + " | ".join(f"{v} ms" for v in VARIANTS)
        + " | best / sdpa_gqa | sdpa_gqa / bound | max abs diff (grouped, matmul, bf16_kv) |"
    )
    report("|---|---:|" + "---:|" * len(VARIANTS) + "---:|---:|---|")
    results = []
    for rows, length in SHAPES:
        r = measure(rows, length, args.reps, bandwidth)
        results.append(r)
        ms = r["ms"]
        diffs = ", ".join(f"{r['max_abs_diff'][v]:.0e}" for v in VARIANTS[1:])
        report(
            f"| {rows} × {length} | {r['bound_ms']:.2f} | "
            + " | ".join(f"{ms[v]:.2f}" for v in VARIANTS)
            + f" | {min(ms.values()) / ms['sdpa_gqa']:.2f}"
            + f" | {ms['sdpa_gqa'] / r['bound_ms']:.1f}× | {diffs} |"
        )
    report.save({"args": vars(args), "bandwidth": bandwidth, "shapes": results})


if __name__ == "__main__":
    main()
