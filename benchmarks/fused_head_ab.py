"""A/B of the fused LM head (``rlkit.algos.fused_head``) against the same module at an earlier commit,
interleaved in one process: forward and backward of the head alone, at the shapes of an update's micro-batch.

    OMP_NUM_THREADS=1 python benchmarks/fused_head_ab.py --base 86905c5 --rows 512,2048 --reps 4

SmolLM2-135M's head (vocabulary 49,152, hidden 576; random weights, tied-embedding-sized), ``rows`` response
tokens, log-prob with entropy, the loss's gradient to the hidden states and the weight, in fp32 and under bf16
autocast, with the logits recomputed in backward and kept (``keep_logits_bytes`` 0 and ``KEEP_LOGITS_BYTES``,
where they fit). Per case the median seconds of ``reps`` alternating calls each and the largest gradient
difference. Writes ``benchmarks/results/<stamp>-fused-head-ab.{json,md}``. Written for session 14's change:
every slice's [N, v] working memory in buffers reused from slice to slice (base: fresh tensors per slice).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_record, module_at, one_thread, save_results  # noqa: E402

VOCAB, HIDDEN = 49152, 576


def call(module, weight, hidden, labels, bf16: bool, keep: int):
    """(seconds, (hidden's gradient, weight's gradient)) of one forward and backward of ``module`` 's head."""
    import torch

    weight.grad = hidden.grad = None
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = module.head_outputs(hidden, weight, labels, with_entropy=True, keep_logits_bytes=keep)
    out["log_prob"].sum().backward()
    return time.perf_counter() - start, (hidden.grad.clone(), weight.grad.clone())


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the commit whose fused_head.py is the A side")
    parser.add_argument("--rows", default="512,2048")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    import torch

    from rlkit.algos import fused_head

    base = module_at(args.base, "src/rlkit/algos/fused_head.py", "fused_head_base")
    record = machine_record(1)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).requires_grad_()
    lines = [
        f"| rows | matmuls | logits | base ({args.base}) s | this tree s | this / base | gradient max diff |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    cases = []
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(rows, HIDDEN, generator=gen).requires_grad_()
        labels = torch.randint(0, VOCAB, (rows,), generator=gen)
        for bf16 in (False, True):
            for keep in (0, fused_head.KEEP_LOGITS_BYTES):
                if keep and rows * VOCAB * 4 > keep:
                    continue  # the logits do not fit: the same as recomputing

                case = (weight, hidden, labels, bf16, keep)
                call(base, *case), call(fused_head, *case)  # warm-up
                times: dict[str, list[float]] = {"base": [], "this": []}
                for rep in range(args.reps):
                    order = (("base", base), ("this", fused_head))
                    for name, module in order if rep % 2 == 0 else order[::-1]:
                        seconds, grads = call(module, *case)
                        times[name].append(seconds)
                        if name == "base":
                            base_grads = grads
                        else:
                            this_grads = grads
                diff = max((a - b).abs().max().item() for a, b in zip(base_grads, this_grads, strict=True))
                a, b = statistics.median(times["base"]), statistics.median(times["this"])
                kind, logits = ("bf16" if bf16 else "fp32"), ("kept" if keep else "recomputed")
                lines.append(f"| {rows} | {kind} | {logits} | {a:.3f} | {b:.3f} | {b / a:.3f} | {diff:.1e} |")
                print(lines[-1], flush=True)
                cases.append(
                    {"rows": rows, "matmuls": kind, "logits": logits, "times": times, "grad_diff": diff}
                )
    print(
        "results:",
        save_results("fused-head-ab", {"args": vars(args), "cases": cases}, "\n".join(lines), machine=record),
    )


if __name__ == "__main__":
    main()
