"""sync vs one_step_off vs async on the quickstart-sized SmolLM2 run (recipes/grpo_async.yaml), 2 cores.

    # 3 modes x seeds 1 2 x 12 steps, greedy validation every 2 steps
    python benchmarks/async_modes.py
    # a workload, 2 configs
    python benchmarks/async_modes.py --modes sync async --response-length 128 --bypass on off
    # a check of the harness (tiny model, minutes)
    python benchmarks/async_modes.py --seeds 1 --steps 2 --smoke

Each run is a real `python -m rlkit run recipes/grpo_async.yaml` in a subprocess, one after another (never
side by side: they would share the 2 cores). What differs between the modes, and nothing else:

- sync: one pool `train` of 2 CPUs, one worker with 2 torch threads generating and training in turn
  (the hybrid engine; the quickstart's layout), on-policy, so no rollout correction;
- one_step_off / async: pool `train` (1 CPU, 1 thread: the actor) and pool `generate` (1 CPU, 1 thread: the
  rollout), so generation runs on one core while training runs on the other; async keeps
  trainer.max_staleness (2) batches generated ahead, one_step_off one. Their rollout correction is
  ``--correction`` (none, or decoupled) x ``--bypass`` (on: the rollout's log-probs are pi_old and the actor's
  old-log-prob pass is skipped; off: decoupled PPO with cap 5, which forces that pass); every combination
  given is run (bypass applies to decoupled only).

Workload: ``--response-length`` (data.max_response_length, 16), ``--n`` (rollout.n, 8), ``--batch``
(data.train_batch_size, prompts per step, 8); the same for every mode.

Reported per run: samples/s (train_batch_size x rollout.n over timing_s/step; validation is outside the
step), mean s/step over the steps after the first (the first has nothing generated ahead), the phase times
(gen wait, generation on the worker, old-log-prob pass, update), the run's wall time, and greedy validation
(val-core/.../score/mean@1) at every validated step. Written to
benchmarks/results/<time>-async-modes.{json,md} with the machine line (CPU model, flags, torch, matmul
GFLOP/s) and the load average before and after; with matplotlib, a plot beside it: samples/s per configuration
(mean over seeds, each seed a dot) and the validation curves. Run it on a quiet machine: other processes on
the 2 cores change every number here.
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
    # sync is the quickstart as it is: on-policy, so no rollout correction (and no old-log-prob pass it
    # forces)
    "sync": [
        "trainer.mode=sync",
        "~trainer.max_staleness",
        "~resources.roles.rollout",
        "~resources.pools.generate",
        "resources.pools.train.cpus_per_bundle=2",
    ],
    "one_step_off": ["trainer.mode=one_step_off", "~trainer.max_staleness"],
    "async": [],
}
# (correction, bypass) -> the recipe's algorithm.rollout_correction
CORRECTIONS = {
    ("none", False): "~algorithm.rollout_correction",
    ("decoupled", False): "algorithm.rollout_correction={name: decoupled, cap: 5.0}",
    ("decoupled", True): "algorithm.rollout_correction={name: decoupled, bypass: true}",
}


def configs(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(mode, correction, bypass) of every run per seed, in order; sync always runs without a correction."""
    out = []
    for mode in args.modes:
        if mode == "sync":
            out.append((mode, "none", False))
            continue
        for corr in args.correction:
            for bypass in sorted({b == "on" for b in args.bypass} if corr == "decoupled" else {False}):
                out.append((mode, corr, bypass))
    return out


def label(mode: str, corr: str, bypass: bool) -> str:
    return mode if mode == "sync" else f"{mode} ({corr}{', bypass' if bypass else ''})"


def run_one(mode: str, corr: str, bypass: bool, seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    name = f"{mode}-{corr}{'-bypass' if bypass else ''}-seed{seed}"
    out = workdir / name
    overrides = (
        MODE_OVERRIDES[mode]
        + [CORRECTIONS[(corr, bypass)]]
        + [
            f"data.max_response_length={args.response_length}",
            f"rollout.n={args.n}",
            f"data.train_batch_size={args.batch}",
            f"trainer.seed={seed}",
            f"data.seed={seed}",
            f"trainer.total_steps={args.steps}",
            f"trainer.test_freq={args.test_freq}",
            "trainer.save_freq=-1",
            f"trainer.output_dir={out}",
            "trainer.resume=never",
            f"trainer.experiment_name=async_modes_{name}",
            "resources.threads_per_worker=auto",
            "tracking.backends=[console, jsonl]",
        ]
    )
    if args.smoke:
        overrides = ["--smoke", *overrides, "trainer.val_before_train=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlkit", "run", str(RECIPE), *overrides],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    metrics_file = out / "metrics.jsonl"
    if not metrics_file.exists():  # --smoke writes under outputs/smoke/<recipe> of the working folder
        metrics_file = workdir / "outputs" / "smoke" / RECIPE.stem / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [r for r in rows if "training/global_step" in r]
    per_step = [r["timing_s/step"] for r in steps]
    later = per_step[1:] or per_step
    n_samples = 16 if args.smoke else args.batch * args.n  # --smoke: 4 prompts x 4
    samples = [n_samples / t for t in later]
    return {
        "mode": mode,
        "correction": corr,
        "bypass": bypass,
        "label": label(mode, corr, bypass),
        "seed": seed,
        "wall_s": wall,
        "steps": len(steps),
        "samples_per_step": n_samples,
        "s_per_step_mean": statistics.mean(later),
        "s_per_step": per_step,
        "samples_per_s": statistics.mean(samples),
        "gen_wait_s": [r.get("timing_s/gen") for r in steps],
        "gen_worker_s": [r.get("perf/worker_s/gen") for r in steps],
        "old_log_prob_s": [r.get("timing_s/old_log_prob") for r in steps],
        "update_s": [r.get("timing_s/update_actor") for r in steps],
        "response_length_mean": [r.get("response_length/mean") for r in steps],
        "bypass_flag": [r.get("rollout_corr/bypass") for r in steps],
        "staleness_mean": [r.get("async/staleness_mean", 0.0) for r in steps],
        "dropped_stale": sum(r.get("async/dropped_stale", 0.0) for r in steps),
        "val": [(r["step"], r[VAL_KEY]) for r in rows if VAL_KEY in r],
        "score": [r.get("critic/score/mean") for r in steps],
    }


def _mean_later(values: list) -> float:
    """Mean over the steps after the first (nan when the phase never ran)."""
    later = [v for v in values[1:] if v is not None]
    return statistics.mean(later) if later else float("nan")


def table(results: list[dict]) -> str:
    lines = [
        "| configuration | seed | samples/s | s/step (steps 2..) | gen wait / on worker s | old-log-prob s | "
        "update s | response len | wall s | staleness | dropped | greedy val by step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        val = ", ".join(f"{s}: {v:.2f}" for s, v in r["val"])
        lines.append(
            f"| {r['label']} | {r['seed']} | {r['samples_per_s']:.2f} | {r['s_per_step_mean']:.2f} | "
            f"{_mean_later(r['gen_wait_s']):.2f} / {_mean_later(r['gen_worker_s']):.2f} | "
            f"{_mean_later(r['old_log_prob_s']):.2f} | {_mean_later(r['update_s']):.2f} | "
            f"{_mean_later(r['response_length_mean']):.1f} | {r['wall_s']:.0f} | "
            f"{statistics.mean(r['staleness_mean']):.2f} | {r['dropped_stale']:.0f} | {val} |"
        )
    by_label = throughput_by_label(results)
    base = statistics.mean(by_label["sync"]) if by_label.get("sync") else None
    if base:
        ratios = ", ".join(f"{k} {statistics.mean(v) / base:.2f}x" for k, v in by_label.items())
        lines.append(f"\nthroughput against sync (mean over seeds): {ratios}")
    return "\n".join(lines)


def throughput_by_label(results: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in results:
        out.setdefault(r["label"], []).append(r["samples_per_s"])
    return out


def plot(results: list[dict], path: Path) -> bool:
    """Left: samples/s per configuration (bar = mean over seeds, dots = seeds). Right: greedy validation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_label = throughput_by_label(results)
    names = list(by_label)
    bars.bar(range(len(names)), [statistics.mean(by_label[k]) for k in names], color="lightsteelblue")
    for i, k in enumerate(names):
        bars.plot([i] * len(by_label[k]), by_label[k], "k.", markersize=8)
    bars.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    bars.set_ylabel("samples / s (steps 2..)")
    bars.set_title("throughput per configuration")
    for r in results:
        if r["val"]:
            steps, values = zip(*r["val"], strict=True)
            curves.plot(steps, values, marker="o", label=f"{r['label']} seed {r['seed']}")
    curves.set_xlabel("step")
    curves.set_ylabel("greedy validation score")
    curves.set_title("learning curves")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument(
        "--correction",
        nargs="+",
        default=["decoupled"],
        choices=("none", "decoupled"),
        help="one_step_off / async: the rollout correction (sync runs without one)",
    )
    p.add_argument(
        "--bypass",
        nargs="+",
        default=["on"],
        choices=("on", "off"),
        help="decoupled in bypass mode (no old-log-prob pass) and/or not (cap 5, with the pass)",
    )
    p.add_argument("--response-length", type=int, default=16, help="data.max_response_length")
    p.add_argument("--n", type=int, default=8, help="rollout.n (group size)")
    p.add_argument("--batch", type=int, default=8, help="data.train_batch_size (prompts per step)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--test-freq", type=int, default=2, help="greedy validation every N steps (and before training)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny model instead of SmolLM2 (checks the harness only)"
    )
    p.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / ".work" / "async_modes")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not (args.workdir / "data" / "arithmetic" / "train.parquet").exists() and not args.smoke:
        subprocess.run(
            [sys.executable, "-m", "rlkit", "data", "arithmetic", "--output", "data/arithmetic"],
            cwd=args.workdir,
            check=True,
        )
    machine = hardware_line()
    load_before = os.getloadavg()
    print(machine, f"\nload average before: {load_before}", flush=True)
    results = []
    for seed in args.seeds:
        # interleaved by seed: slow drift in the load hits every mode
        for mode, corr, bypass in configs(args):
            results.append(run_one(mode, corr, bypass, seed, args, args.workdir))
            r = results[-1]
            print(
                f"{r['label']} seed {seed}: {r['samples_per_s']:.2f} samples/s, {r['s_per_step_mean']:.2f} "
                f"s/step, val {r['val']}",
                flush=True,
            )
    load_after = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"{stamp}-async-modes{'-smoke' if args.smoke else ''}"
    text = table(results)
    command = "python benchmarks/async_modes.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "machine": machine,
                "load_before": load_before,
                "load_after": load_after,
                "command": command,
                "results": results,
            },
            indent=1,
        )
    )
    md = f"`{command}`\n\n{machine}\n\nload average before {load_before}, after {load_after}\n\n{text}\n"
    if plot(results, out.with_suffix(".png")):
        md += f"\n![throughput and greedy validation]({out.with_suffix('.png').name})\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"written: {out}.json / .md")


if __name__ == "__main__":
    main()
