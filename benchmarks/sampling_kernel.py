"""rlkit's compiled next-token draw (``rlkit::sample_rows``, ``rlkit.rollout.sampling.sample_next(...,
fused=True)``) against torch's path in the same function, one decode step's draw alone, at SmolLM2's
vocabulary.

    OMP_NUM_THREADS=1 python benchmarks/sampling_kernel.py [--reps 30]

For each rows × logits dtype (fp32: the fp32 decode's head; bf16: the bf16 decode copy's, which the kernel
reads as it is and torch's path widens first) and temperature 1 with no top-k/top-p (the harness's and GRPO's
usual draw), both paths draw from the same logits and uniforms, interleaved, the order reversed every other
rep: ``cold`` (the logits written just before, then 64 MiB of other memory read, as after the LM head's GEMM
over its weights) and ``hot`` (the same logits drawn again). Also the share of draws where the two paths'
tokens differ (only draws within float rounding of a token boundary may:
tests/unit/rollout/test_fused_sampling.py).
Writes ``benchmarks/results/<stamp>-sampling-kernel.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB = 49152  # SmolLM2's
SHAPES = [
    (8, torch.float32),
    (8, torch.bfloat16),
    (16, torch.float32),
    (16, torch.bfloat16),
    (64, torch.bfloat16),
]
EVICT_BYTES = 64 * 2**20


def measure(
    rows: int, dtype: torch.dtype, reps: int, vocab: int = VOCAB, evict_bytes: int = EVICT_BYTES
) -> dict:
    """Per-draw ms (median of ``reps``) of torch's path and the kernel, cold and hot, and how many of
    ``reps × rows`` draws picked different tokens."""
    from rlkit.rollout.sampling import sample_next

    torch.manual_seed(0)
    logits = (3 * torch.randn(rows, vocab)).to(dtype)
    evict = torch.randn(evict_bytes // 4)
    args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "do_sample": True, "generator": None}

    def draw(fused: bool, u: torch.Tensor, cold: bool) -> tuple[float, torch.Tensor]:
        if cold:
            logits.add_(0)  # written, as the head's GEMM writes them
            evict.sum()
        start = time.perf_counter()
        tokens, _ = sample_next(logits, uniform=u, fused=fused, **args)
        return (time.perf_counter() - start) * 1e3, tokens

    runs = [(fused, cold) for cold in (True, False) for fused in (False, True)]
    u = torch.rand(rows, 1, dtype=torch.float64)
    for run in runs:
        draw(run[0], u, run[1])
    times: dict[tuple[bool, bool], list[float]] = {run: [] for run in runs}
    differ = 0
    for r in range(reps):
        u = torch.rand(rows, 1, dtype=torch.float64)
        tokens = {}
        for fused, cold in runs if r % 2 == 0 else runs[::-1]:
            ms, tokens[fused] = draw(fused, u, cold)
            times[(fused, cold)].append(ms)
        differ += int((tokens[True] != tokens[False]).sum())
    ms = {
        f"{'kernel' if f else 'torch'}_{'cold' if c else 'hot'}": statistics.median(t)
        for (f, c), t in times.items()
    }
    return {
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "ms": ms,
        "draws": reps * rows,
        "differ": differ,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    from common import kernel_report

    report, library = kernel_report(
        "sampling-kernel", "sampling_kernel.py", f"vocabulary {VOCAB}, {args.reps} reps, median"
    )
    report(
        "| rows | logits | torch cold ms | kernel cold ms | kernel / torch cold | torch hot ms | "
        "kernel hot ms | kernel / torch hot | draws differing |"
    )
    report("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    results = [measure(rows, dtype, args.reps) for rows, dtype in SHAPES]
    for r in results:
        ms = r["ms"]
        report(
            f"| {r['rows']} | {r['dtype']} | {ms['torch_cold']:.2f} | {ms['kernel_cold']:.2f} | "
            f"{ms['kernel_cold'] / ms['torch_cold']:.2f} | {ms['torch_hot']:.2f} | {ms['kernel_hot']:.2f} | "
            f"{ms['kernel_hot'] / ms['torch_hot']:.2f} | {r['differ']} of {r['draws']} |"
        )
    report.save({"reps": args.reps, "vocab": VOCAB, "library": library.name, "results": results})


if __name__ == "__main__":
    main()
