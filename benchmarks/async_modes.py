"""sync vs one_step_off vs async on the quickstart-sized SmolLM2 run (recipes/grpo_async.yaml), 2 cores.

    python benchmarks/async_modes.py                          # 3 modes x 2 seeds x 12 steps, greedy val every 2 steps
    python benchmarks/async_modes.py --seeds 1 --steps 2 --smoke   # a check of the harness (tiny model, minutes)

Each run is a real `python -m rlkit run recipes/grpo_async.yaml` in a subprocess, one after another (never
side by side: they would share the 2 cores). What differs between the modes, and nothing else:

- sync: one pool `train` of 2 CPUs, one worker with 2 torch threads generating and training in turn
  (the hybrid engine; the quickstart's layout);
- one_step_off / async: pool `train` (1 CPU, 1 thread: the actor) and pool `generate` (1 CPU, 1 thread: the
  rollout), so generation runs on one core while training runs on the other; async keeps
  trainer.max_staleness (2) batches generated ahead, one_step_off one.

Reported per mode and seed: samples/s (train_batch_size x rollout.n over timing_s/step; validation is
outside the step), mean s/step over the steps after the first (the first has nothing generated ahead),
the run's wall time, and greedy validation (val-core/.../score/mean@1) at every validated step. Written
to benchmarks/results/<time>-async-modes.{json,md} with the machine line (CPU model, flags, torch, matmul
GFLOP/s) and the load average before and after; with matplotlib, a plot of the validation curves beside it.
Run it on a quiet machine: other processes on the 2 cores change every number here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_async.yaml"
MODES = ("sync", "one_step_off", "async")
VAL_KEY = "val-core/rlkit/arithmetic/score/mean@1"

# overrides that make recipes/grpo_async.yaml (async, two 1-CPU pools) into each mode
MODE_OVERRIDES = {
    # sync is the quickstart as it is: on-policy, so no rollout correction (and no old-log-prob pass it forces)
    "sync": ["trainer.mode=sync", "~trainer.max_staleness", "~resources.roles.rollout", "~resources.pools.generate",
             "resources.pools.train.cpus_per_bundle=2", "~algorithm.rollout_correction"],
    "one_step_off": ["trainer.mode=one_step_off", "~trainer.max_staleness"],
    "async": [],
}


def run_one(mode: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"{mode}-seed{seed}"
    overrides = MODE_OVERRIDES[mode] + [
        f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}", "trainer.save_freq=-1", f"trainer.output_dir={out}",
        "trainer.resume=never", f"trainer.experiment_name=async_modes_{mode}_seed{seed}",
        "resources.threads_per_worker=auto",
        "tracking.backends=[console, jsonl]"]
    if args.smoke:
        overrides = ["--smoke", *overrides, "trainer.val_before_train=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlkit", "run", str(RECIPE), *overrides], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    metrics_file = out / "metrics.jsonl"
    if not metrics_file.exists():  # --smoke writes under outputs/smoke/<recipe> of the working folder
        metrics_file = workdir / "outputs" / "smoke" / RECIPE.stem / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [r for r in rows if "training/global_step" in r]
    per_step = [r["timing_s/step"] for r in steps]
    later = per_step[1:] or per_step
    n_samples = args.samples_per_step
    samples = [n_samples / t for t in later]
    return {
        "mode": mode, "seed": seed, "wall_s": wall, "steps": len(steps),
        "s_per_step_mean": statistics.mean(later), "s_per_step": per_step,
        "samples_per_s": statistics.mean(samples),
        "gen_wait_s": [r.get("timing_s/gen") for r in steps], "gen_worker_s": [r.get("perf/worker_s/gen") for r in steps],
        "staleness_mean": [r.get("async/staleness_mean", 0.0) for r in steps],
        "dropped_stale": sum(r.get("async/dropped_stale", 0.0) for r in steps),
        "val": [(r["step"], r[VAL_KEY]) for r in rows if VAL_KEY in r],
        "score": [r.get("critic/score/mean") for r in steps],
    }


def table(results: list[dict]) -> str:
    lines = ["| mode | seed | samples/s | s/step (steps 2..) | wall s | staleness (mean over steps) | dropped | "
             "greedy val by step |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        val = ", ".join(f"{s}: {v:.2f}" for s, v in r["val"])
        lines.append(f"| {r['mode']} | {r['seed']} | {r['samples_per_s']:.2f} | {r['s_per_step_mean']:.2f} | "
                     f"{r['wall_s']:.0f} | {statistics.mean(r['staleness_mean']):.2f} | {r['dropped_stale']:.0f} | {val} |")
    by_mode = {m: [r["samples_per_s"] for r in results if r["mode"] == m] for m in MODES}
    base = statistics.mean(by_mode["sync"]) if by_mode["sync"] else None
    if base:
        ratios = ", ".join(f"{m} {statistics.mean(v) / base:.2f}x" for m, v in by_mode.items() if v)
        lines.append(f"\nthroughput against sync: {ratios}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r["val"]:
            steps, values = zip(*r["val"], strict=True)
            ax.plot(steps, values, marker="o", label=f"{r['mode']} seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("greedy validation score")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--test-freq", type=int, default=2, help="greedy validation every N steps (and before training)")
    p.add_argument("--samples-per-step", type=int, default=64, help="train_batch_size x rollout.n of the recipe")
    p.add_argument("--smoke", action="store_true", help="tiny model instead of SmolLM2 (checks the harness only)")
    p.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / ".work" / "async_modes")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args()
    if args.smoke:
        args.samples_per_step = 16  # --smoke: 4 prompts x 4
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not (args.workdir / "data" / "arithmetic" / "train.parquet").exists() and not args.smoke:
        subprocess.run([sys.executable, "-m", "rlkit", "data", "arithmetic", "--output", "data/arithmetic"],
                       cwd=args.workdir, check=True)
    machine = hardware_line()
    load_before = os.getloadavg()
    print(machine, f"\nload average before: {load_before}", flush=True)
    results = []
    for seed in args.seeds:
        for mode in args.modes:  # interleaved by seed, so slow drift in the machine's load hits every mode
            results.append(run_one(mode, seed, args, args.workdir))
            r = results[-1]
            print(f"{mode} seed {seed}: {r['samples_per_s']:.2f} samples/s, {r['s_per_step_mean']:.2f} s/step, "
                  f"val {r['val']}", flush=True)
    load_after = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"{stamp}-async-modes{'-smoke' if args.smoke else ''}"
    text = table(results)
    command = "python benchmarks/async_modes.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "load_before": load_before,
                                                    "load_after": load_after, "command": command,
                                                    "results": results}, indent=1))
    md = f"`{command}`\n\n{machine}\n\nload average before {load_before}, after {load_after}\n\n{text}\n"
    if plot(results, out.with_suffix(".png")):
        md += f"\n![greedy validation]({out.with_suffix('.png').name})\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"written: {out}.json / .md")


if __name__ == "__main__":
    main()
