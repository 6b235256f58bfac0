"""The fp16 decode copy's repack after an update (``Fp16DecodeCopy.refresh``), on 1 and 2 torch threads.

    python benchmarks/fp16_repack.py --model smollm2 --reps 3

A full fine-tune repacks every linear once per step (``rlkit.rollout.fp16_weights``). fbgemm's packing is
single-threaded C++; with more than one torch thread the copy packs on a pool of that many threads. This
times one refresh with every trainable weight moved, at each thread count in ``--threads``, interleaved
A B B A, then fbgemm's packing of the same weights alone split over as many Python threads, and checks that
the copies compute bit-identical logits. Writes
``benchmarks/results/<stamp>-fp16-repack.*``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line, machine_record, repack_model, save_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 or an HF folder")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import torch

    from rlkit.rollout.fp16_weights import Fp16DecodeCopy

    tok, model, params = repack_model(args.model)
    counts = [int(t) for t in args.threads.split(",")]
    copies = {n: Fp16DecodeCopy(model) for n in counts}
    for fp16 in copies.values():
        fp16.refresh(model)  # the construction's packing
    times: dict[int, list[float]] = {n: [] for n in counts}
    for rep in range(args.reps):
        for n in counts if rep % 2 == 0 else counts[::-1]:
            torch.set_num_threads(n)
            start = time.perf_counter()
            copies[n].refresh(model, trainable_moved=True)
            times[n].append(time.perf_counter() - start)
            assert copies[n].repacked == sum(len(unit) for unit in copies[n].units)
    # fbgemm's packing alone, the same weights split over n Python threads (no range check, no copies)
    weights = [m.weight.detach().float().contiguous() for m in model.modules() if type(m) is torch.nn.Linear]
    pack_only: dict[int, list[float]] = {n: [] for n in counts}
    for rep in range(args.reps):
        for n in counts if rep % 2 == 0 else counts[::-1]:
            torch.set_num_threads(n)
            pack_only[n].append(_pack_threads(weights, n))
    torch.set_num_threads(1)
    ids = tok(["What is 2 + 3?"], return_tensors="pt")
    with torch.no_grad():
        logits = {n: copies[n].module(**ids).logits for n in counts}
    identical = all(torch.equal(logits[counts[0]], logits[n]) for n in counts)
    machine = machine_record(1)
    lines = [
        "| torch threads | refresh s (median) | ns per parameter | vs 1 thread | fbgemm packing alone s "
        "| vs 1 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    base, base_pack = statistics.median(times[counts[0]]), statistics.median(pack_only[counts[0]])
    for n in counts:
        t, p = statistics.median(times[n]), statistics.median(pack_only[n])
        lines.append(
            f"| {n} | {t:.3f} | {t / params * 1e9:.1f} | {t / base:.2f} | {p:.3f} | {p / base_pack:.2f} |"
        )
    linears = sum(len(unit) for unit in copies[counts[0]].units)
    text = (
        f"{hardware_line(machine)}\n\n{linears} linears, {params / 1e6:.1f} M weights "
        f"({args.model}); {args.reps} reps each, interleaved; logits bit-identical across thread counts: "
        f"{identical}\n\n" + "\n".join(lines)
    )
    print(text)
    record = {
        "args": vars(args),
        "params": params,
        "times_s": times,
        "pack_only_s": pack_only,
        "identical": identical,
    }
    print("results:", save_results("fp16-repack", record, text, machine=machine))
    if not identical:
        raise SystemExit("the copies differ across thread counts")


def _pack_threads(weights: list, n: int) -> float:
    """Seconds to pack ``weights`` with fbgemm on ``n`` threads (round-robin split)."""
    import threading

    import torch

    def work(part):
        for w in part:
            torch.ops.quantized.linear_prepack_fp16(w, None)

    threads = [threading.Thread(target=work, args=(weights[i::n],)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
