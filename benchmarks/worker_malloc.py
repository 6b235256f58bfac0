"""Does the C allocator of rlkit's Ray workers cost step time? rlkit's harness step (``rlkit_grpo.py``: the
real Runtime, the Ray worker, Trainer.step) under different allocator environments, one process per run,
variants alternating, with the worker's minor page faults per step (``/proc/<pid>/stat``).

    python benchmarks/worker_malloc.py --reps 2 [--mimalloc /path/to/libmimalloc.so]

Variants (``--variants``, default all): ``glibc`` (the defaults; ``resources.allocator: system``),
``keep-freed`` (the driver's ``GLIBC_TUNABLES``: one arena, no mmap'd blocks, no heap trim), ``rlkit-auto``
(``resources.allocator: auto``: rlkit starts its workers with those tunables), and with ``--mimalloc`` the
library preloaded (``LD_PRELOAD``, ``MIMALLOC_PURGE_DELAY=-1``: freed
memory kept). The driver's environment is the workers' (a local Ray cluster inherits it). Workload: smollm2
(``--prompts`` x ``--group`` samples x ``--tokens`` tokens, default 4 x 4 x 32, fp32), 1 warm-up and
``--steps`` measured steps per run, the variants' order reversed every other rep. Writes
``benchmarks/results/<stamp>-worker-malloc.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Report, machine_line, matmul_peak_flops, memory_bandwidth  # noqa: E402

KEEP_FREED = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"


def variants(mimalloc: str | None, chosen: str) -> dict[str, tuple[dict[str, str], str]]:
    """name -> (the driver's extra environment, rlkit's resources.allocator)."""
    out = {
        "glibc": ({}, "system"),
        "keep-freed": ({"GLIBC_TUNABLES": KEEP_FREED}, "system"),
        "rlkit-auto": ({}, "auto"),  # rlkit starts its workers with the tunables (rlkit.hardware.allocator)
    }
    if mimalloc:
        out["mimalloc"] = ({"LD_PRELOAD": mimalloc, "MIMALLOC_PURGE_DELAY": "-1"}, "system")
    names = chosen.split(",") if chosen else list(out)
    unknown = [n for n in names if n not in out]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(out)}")
    return {name: out[name] for name in names}


def one_run(
    model: str,
    data: str,
    steps: int,
    variant: tuple[dict[str, str], str],
    shape: tuple[int, int, int],
    *,
    model_name: str = "smollm2",
    dtype: str = "fp32",
    warmup: int = 1,
) -> list[dict]:
    extra, allocator = variant
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} | extra
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(HERE / "rlkit_grpo.py"), "--model", model, "--model-name", model_name]
        prompts, group, tokens = (str(n) for n in shape)
        cmd += ["--dtype", dtype, "--data", data, "--prompts", prompts, "--group", group, "--tokens", tokens]
        cmd += [
            "--allocator",
            allocator,
            "--max-prompt-length",
            "1024",
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--out",
            str(out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"run failed ({extra}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["steps"]


def report_run(report: Report, rep: int, name: str, steps: list[dict]) -> None:
    """One run's line: each measured step's seconds and the worker's minor faults."""
    cells = [f"{s['step']:.2f} s / {s.get('worker_minor_faults', -1)}" for s in steps]
    report(f"rep {rep + 1} {name}: step s / worker faults: {', '.join(cells)}")


def report_medians(
    report: Report, runs: dict[str, list[list[dict]]], column: str, labels: dict[str, str]
) -> dict:
    """The table of each variant's medians over all its runs' steps (step, gen, update, worker faults), its
    first column headed ``column`` with ``labels[name]``; returns {name: medians}."""
    report(f"| {column} | step s (median) | gen s | update s | worker faults per step (median) | runs |")
    report("|---|---:|---:|---:|---:|---:|")
    summary = {}
    for name, per_run in runs.items():
        steps = [s for run in per_run for s in run]
        med = {k: statistics.median(s[k] for s in steps) for k in ("step", "gen", "update_actor")}
        med["faults"] = statistics.median(s.get("worker_minor_faults", -1) for s in steps)
        summary[name] = med
        report(
            f"| {labels[name]} | {med['step']:.3f} | {med['gen']:.3f} | {med['update_actor']:.3f} | "
            f"{med['faults']:.0f} | {len(per_run)} |"
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=2, help="runs per variant, alternating")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--mimalloc", default=None, help="libmimalloc.so to preload, a third variant")
    parser.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens (eos ignored)")
    args = parser.parse_args()
    from rlkit.model.smollm2 import smollm2_dir

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    data = HERE / ".work" / "arithmetic" / "train.parquet"
    if not data.exists():
        raise SystemExit(f"{data} is missing: run benchmarks/run.py once (it writes the workload's data)")
    report = Report("worker-malloc")
    report(machine_line(matmul_peak_flops("fp32"), memory_bandwidth()))
    runs: dict[str, list[list[dict]]] = {name: [] for name in variants(args.mimalloc, args.variants)}
    shape = (args.prompts, args.group, args.tokens)
    for rep in range(args.reps):
        order = list(variants(args.mimalloc, args.variants).items())
        for name, variant in order if rep % 2 == 0 else order[::-1]:  # ABBA: neither variant always first
            steps = one_run(str(smollm2_dir()), str(data), args.steps, variant, shape)
            runs[name].append(steps)
            report_run(report, rep, name, steps)
    summary = report_medians(report, runs, "allocator", {name: name for name in runs})
    report.save({"variants": variants(args.mimalloc, args.variants), "runs": runs, "median": summary})


if __name__ == "__main__":
    main()
