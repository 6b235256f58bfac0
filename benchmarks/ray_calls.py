"""What one role call costs in Ray with a CPU step's batch as its argument and result: Ray's default
(arguments and results over 100 KiB through the shared-memory object store) against rlkit's local-cluster
setting (``RAY_max_direct_call_object_size`` 1 MiB: up to that size inside the call itself).

    python benchmarks/ray_calls.py [--calls 200] [--rounds 2]

Each variant is a fresh local Ray cluster in its own process (Ray reads the setting when it starts), run
A B … B A over ``--rounds``; each process times ``--calls`` calls of an actor method that returns its
argument: a bare int, and ``rlkit.batch.Batch`` es shaped like the tiny harness workload's (64 rows × 67
positions, 155 kB pickled) and like a SmolLM2-256 step's (8 × 300, 0.3 MB), after 20 warm-up calls. Each
batch twice: as rlkit pickles it (``Batch.__reduce__``: host tensors as numpy arrays, protocol-5 buffers)
and ``tensors pickled by torch`` (the TensorDict and torch's tensor pickling, rlkit before session 17).
Results: ``benchmarks/results/<stamp>-ray-calls.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_record, save_results  # noqa: E402

VARIANTS = {"ray default": None, "rlkit (1 MiB inline)": str(1 << 20)}
SHAPES = {"tiny step (64 × 67)": (64, 35, 32), "smollm2-256 step (8 × 300)": (8, 44, 256)}

CHILD = r"""
import json, sys, time
import numpy as np, ray, torch
from rlkit.batch import Batch

calls = int(sys.argv[1])
shapes = json.loads(sys.argv[2])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error")


def batch(b, p, t):
    ids = torch.zeros(b, p + t, dtype=torch.long)
    f = torch.zeros(b, t)
    return Batch(
        {"input_ids": ids, "attention_mask": ids.clone(), "position_ids": ids.clone(),
         "responses": torch.zeros(b, t, dtype=torch.long), "response_mask": f.clone(),
         "rollout_log_probs": f.clone(), "advantages": f.clone(), "old_log_prob": f.clone()},
        {"uid": np.array([str(i) for i in range(b)], dtype=object)},
        {"temperature": 1.0},
    )


@ray.remote(num_cpus=1)
class Echo:
    def echo(self, x):
        return x


echo = Echo.remote()
out = {}
args = [("bare int", 1)] + [(k, batch(*v)) for k, v in shapes.items()]
# what a Batch pickled as before Batch.__reduce__: its fields (the TensorDict: torch's tensor pickling)
args += [
    (f"{k}, tensors pickled by torch", (b.tensors, b.non_tensors, b.meta))
    for k, b in ((k, batch(*v)) for k, v in shapes.items())
]
for name, arg in args:
    for _ in range(20):
        ray.get(echo.echo.remote(arg))
    start = time.perf_counter()
    for _ in range(calls):
        ray.get(echo.echo.remote(arg))
    out[name] = (time.perf_counter() - start) / calls * 1e3
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    machine = machine_record()
    ms: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else list(VARIANTS)[::-1]:
            env = {k: v for k, v in os.environ.items() if k != "RAY_max_direct_call_object_size"}
            if VARIANTS[variant] is not None:
                env["RAY_max_direct_call_object_size"] = VARIANTS[variant]
            env |= {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.calls), json.dumps(SHAPES)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            for name, value in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                ms[variant].setdefault(name, []).append(value)
            print(variant, {k: round(v[-1], 2) for k, v in ms[variant].items()}, flush=True)
    names = list(ms[next(iter(VARIANTS))])
    lines = [
        "| call argument and result | " + " | ".join(f"{v} ms" for v in VARIANTS) + " | ratio |",
        "|---|" + "---:|" * (len(VARIANTS) + 1),
    ]
    medians = {v: {n: statistics.median(ms[v][n]) for n in names} for v in VARIANTS}
    base, ours = list(VARIANTS)
    for n in names:
        a, b = medians[base][n], medians[ours][n]
        lines.append(f"| {n} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    text = "\n".join(lines)
    print(text)
    record = {"args": vars(args), "ms": ms, "medians": medians}
    print("results:", save_results("ray-calls", record, text, machine=machine))


if __name__ == "__main__":
    main()
