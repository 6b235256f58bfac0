"""The bf16 decode copy's repack after an update (``Bf16DecodeCopy.refresh``) as rlkit packs (A: a fresh bf16
copy of each weight, a fused group's members concatenated, then oneDNN's reorder) against each weight rounded
into a staging buffer reused from one weight to the next (B: no fresh memory, no concatenation, the matrix
still in cache when the reorder reads it); measured in session 34, not built (docs/benchmarks.md).

    OMP_NUM_THREADS=1 python benchmarks/bf16_repack.py --model smollm2 --reps 7

A full fine-tune repacks every linear once per step: SmolLM2-135M's 134 M weights read in fp32, rounded to
bf16 and reordered into oneDNN's blocked layout (0.22-0.29 s of a harness step on AMX, session 33). Two copies
of one model, one packing each way (B patched into the classes' ``pack`` for its refreshes only),
refreshed with every trainable weight moved, interleaved A B B A; then the two copies' logits compared (the
same rounded weights: bit-identical). One torch thread. Writes ``benchmarks/results/<stamp>-bf16-repack.*``.
Needs a CPU where oneDNN packs bf16 (``bf16_weights_unavailable()`` None).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line, machine_record, one_thread, repack_model, save_results  # noqa: E402

_STAGING: dict = {}  # the staging buffer (B's), for one refresh


def rounded_to_bf16(weights: list):
    """``weights`` (each ``[out_i, in]``) stacked and rounded to bf16 into a staging buffer reused from one
    weight to the next (grown to the largest): ``[sum(out_i), in]``, valid until the next call."""
    import torch

    rows, width = sum(w.shape[0] for w in weights), weights[0].shape[1]
    buffer = _STAGING.get("buffer")
    if buffer is None or buffer.numel() < rows * width:
        buffer = _STAGING["buffer"] = torch.empty(rows * width, dtype=torch.bfloat16)
    out = buffer[: rows * width].view(rows, width)
    start = 0
    for weight in weights:
        out[start : start + weight.shape[0]].copy_(weight.detach())
        start += weight.shape[0]
    return out


def staged_pack_linear(self, linear, name: str = "") -> None:
    """B's ``Bf16Linear.pack``: the weight rounded into the staging buffer, then oneDNN's reorder."""
    import torch

    with torch.no_grad():
        self.packed = torch.ops.mkldnn._reorder_linear_weight(rounded_to_bf16([linear.weight]))
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()


def staged_pack_fused(self, linears, names=()) -> None:
    """B's ``Bf16FusedLinear.pack``: the members rounded into the staging buffer's rows (no concatenation),
    then the reorder; the biases as rlkit keeps them (fp32, zeros for a member without one)."""
    import torch

    with torch.no_grad():
        weights = [linear.weight for linear in linears]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(rounded_to_bf16(weights))
        biases = [
            linear.bias.detach().float() if linear.bias is not None else torch.zeros(linear.out_features)
            for linear in linears
        ]
        self.bias = None if all(linear.bias is None for linear in linears) else torch.cat(biases)


@contextlib.contextmanager
def staged_packing():
    """Both packed classes packing B's way inside the block; the staging buffer dropped after it."""
    from rlkit.rollout import bf16_weights as bw

    saved = bw.Bf16Linear.pack, bw.Bf16FusedLinear.pack
    bw.Bf16Linear.pack, bw.Bf16FusedLinear.pack = staged_pack_linear, staged_pack_fused
    try:
        yield
    finally:
        bw.Bf16Linear.pack, bw.Bf16FusedLinear.pack = saved
        _STAGING.clear()


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 or an HF folder")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    import torch

    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable

    if bf16_weights_unavailable() is not None:
        raise SystemExit(f"bf16_repack.py: {bf16_weights_unavailable()}")
    tok, model, params = repack_model(args.model)
    fresh = Bf16DecodeCopy(model)
    with staged_packing():
        staged = Bf16DecodeCopy(model)
    ways = {"fresh": fresh, "staged": staged}
    fresh.refresh(model)  # (a copy's first refresh packs nothing: its construction just packed)
    with staged_packing():
        staged.refresh(model)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.reps):
        for name in ways if rep % 2 == 0 else list(ways)[::-1]:
            patch = staged_packing() if name == "staged" else contextlib.nullcontext()
            with patch:
                start = time.perf_counter()
                ways[name].refresh(model, trainable_moved=True)
                times[name].append(time.perf_counter() - start)
    ids = tok(["What is 2 + 3? Answer with only the number."], return_tensors="pt")
    with torch.no_grad():
        identical = torch.equal(fresh.module(**ids).logits, staged.module(**ids).logits)
    machine = machine_record(1)
    a, b = statistics.median(times["fresh"]), statistics.median(times["staged"])
    lines = [
        "| packing | refresh s (median) | ns per weight | fastest rep s |",
        "|---|---:|---:|---:|",
        f"| A (rlkit): a fresh bf16 copy of each weight, fused groups concatenated | {a:.3f} | "
        f"{a / params * 1e9:.2f} | {min(times['fresh']):.3f} |",
        f"| B: rounded into a reused staging buffer | {b:.3f} | {b / params * 1e9:.2f} | "
        f"{min(times['staged']):.3f} |",
    ]
    text = (
        f"{hardware_line(machine)}\n\n{len(staged.units)} packed units, {params / 1e6:.1f} M weights "
        f"({args.model}); "
        f"{args.reps} reps each, interleaved; B/A {b / a:.3f} (medians), "
        f"{min(times['staged']) / min(times['fresh']):.3f} (fastest); logits bit-identical: {identical}\n\n"
        + "\n".join(lines)
    )
    print(text)
    record = {"args": vars(args), "params": params, "times_s": times, "ratio": b / a, "identical": identical}
    print("results:", save_results("bf16-repack", record, text, machine=machine))
    if not identical:
        raise SystemExit("the two packings' copies compute different logits")


if __name__ == "__main__":
    main()
