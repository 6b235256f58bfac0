"""The harness step of two rlkit source trees, one process per run, alternating: an earlier commit (A) against
the working tree (B), through the real Runtime and Ray worker (``rlkit_grpo.py``), with the worker's minor
page faults per step.

    python benchmarks/ab_trees.py --base HEAD --reps 3

Where ``ab.py`` toggles one change in-process on the main thread, this measures it where a run executes it:
in a Ray worker's method thread, whose allocations glibc reuses differently (docs/benchmarks.md, "Three more
levers on AVX2"). A's tree is ``git worktree add`` of ``--base`` in a temporary folder; each run puts its
tree's ``src`` first on ``PYTHONPATH``, which the local Ray cluster's workers inherit (a Ray task started
so imported ``rlkit`` from that tree). ``--workload``: one of the harness's (``run.py``'s ``WORKLOADS``:
tiny, smollm2, smollm2-64, smollm2-256, smollm2-long), in ``--dtype`` (a harness dtype: fp32, fp32auto,
bf16; default fp32); ``--warmup`` (3, as the harness) and ``--steps`` measured steps per run. The table's
gen and update are the driver's phase times, ``worker gen``/``worker update`` the worker's own: their
difference is what a role call costs.
Writes ``benchmarks/results/<stamp>-ab-trees.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import HARNESS_DTYPES, Report, machine_line, matmul_peak_flops, memory_bandwidth  # noqa: E402
from run import LONG_PROMPT_WORKLOADS, WORKLOADS, long_prompt_file  # noqa: E402
from worker_malloc import one_run, report_medians, report_run  # noqa: E402


def _rev(tree: Path, rev: str = "HEAD") -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="HEAD", help="A: this commit (B: the working tree)")
    parser.add_argument("--reps", type=int, default=3, help="runs per tree, alternating A B, B A, ...")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="smollm2")
    parser.add_argument(
        "--dtype",
        choices=tuple(HARNESS_DTYPES),
        default="fp32",
        help="the harness dtype (common.HARNESS_DTYPES)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per run (as run.py)")
    args = parser.parse_args()
    from rlkit.model.smollm2 import smollm2_dir

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_name, *shape = WORKLOADS[args.workload]
    data = HERE / ".work" / "arithmetic" / "train.parquet"
    model = str(smollm2_dir()) if model_name == "smollm2" else str(HERE / ".work" / "tiny-qwen2")
    for needed in (data, Path(model)):
        if not needed.exists():
            raise SystemExit(
                f"{needed} is missing: run benchmarks/run.py once (it writes the workloads' files)"
            )
    if args.workload in LONG_PROMPT_WORKLOADS:
        data = long_prompt_file(data, model)
    repo = HERE.parent
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "src"], capture_output=True, text=True
    )
    report = Report("ab-trees")
    report(machine_line(matmul_peak_flops("fp32"), memory_bandwidth()))
    names = {
        "A": f"{_rev(repo, args.base)}",
        "B": f"{_rev(repo)}{' + changes' if dirty.stdout.strip() else ''}",
    }
    report(f"A: commit {names['A']}; B: the working tree, {names['B']}; {args.workload}, {args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(base), args.base],
            check=True,
            capture_output=True,
        )
        trees = {"A": base, "B": repo}
        runs: dict[str, list[list[dict]]] = {"A": [], "B": []}
        try:
            for rep in range(args.reps):
                for name in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                    env = {"PYTHONPATH": str(trees[name] / "src")}
                    steps = one_run(
                        model,
                        str(data),
                        args.steps,
                        (env, "auto"),
                        tuple(shape),
                        model_name=model_name,
                        dtype=args.dtype,
                        warmup=args.warmup,
                    )
                    runs[name].append(steps)
                    report_run(report, rep, name, steps)
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(base)], check=False)
    summary = report_medians(report, runs, "tree", {name: f"{name}: {names[name]}" for name in runs})
    ratio = summary["B"]["update_actor"] / summary["A"]["update_actor"]
    report(f"B/A: step {summary['B']['step'] / summary['A']['step']:.3f}, update {ratio:.3f}")
    report("| tree | gen − worker gen ms (median) | update − worker update ms (median) |")
    report("|---|---:|---:|")
    for name, per_run in runs.items():
        steps = [s for run in per_run for s in run]
        gaps = [
            statistics.median((s[phase] - s[f"worker_{phase}"]) * 1e3 for s in steps)
            for phase in ("gen", "update_actor")
        ]
        report(f"| {name}: {names[name]} | {gaps[0]:.1f} | {gaps[1]:.1f} |")
    report.save({"trees": names, "runs": runs, "median": summary})


if __name__ == "__main__":
    main()
