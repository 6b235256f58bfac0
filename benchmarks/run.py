"""Side-by-side GRPO benchmark: rlkit vs TRL's GRPOTrainer on identical work (docs/benchmarks.md).

    python benchmarks/run.py                        # tiny Qwen2 + SmolLM2-135M, fp32 + bf16, 2 rounds
    python benchmarks/run.py --models tiny --dtypes fp32 --rounds 1

Makes TRL's virtual environment on first use (``benchmarks/.venv-trl``: torch 2.13 CPU + trl 1.16 from
the package index), builds the tiny model and the prompts under ``benchmarks/.work``, then for every
model × dtype runs alternating rounds (ABBA: rlkit, TRL, TRL, rlkit, ...), one process per run, one torch
thread per process (``--base-src``: a third, older rlkit in the rotation). Each process measures its own matmul peak, skips ``--warmup`` steps and times
``--steps``. Prints a Markdown table and writes the raw numbers to ``benchmarks/results/``.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import hardware, hardware_line  # noqa: E402

WORK = HERE / ".work"
TRL_VENV = HERE / ".venv-trl"
TRL_PINS = ["torch==2.13.0", "trl==1.16.0"]

# model -> (prompts, group, tokens): tiny measures framework cost, SmolLM2 a real model's compute.
WORKLOADS = {"tiny": (8, 8, 32), "smollm2": (4, 4, 32)}


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    probe = [str(python), "-c", "import torch, trl; assert '+cpu' in torch.__version__ or not torch.cuda.is_available();"
             "print(torch.__version__, trl.__version__)"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"making {TRL_VENV} ({' '.join(TRL_PINS)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    subprocess.run(probe, check=True)
    return python


def prepare(models: list[str]) -> tuple[dict[str, str], str]:
    """Model folders by name and the prompts' parquet file (built once, cached under .work)."""
    paths = {}
    if "tiny" in models:
        tiny = WORK / "tiny-qwen2"
        if not (tiny / "config.json").exists():
            from rlkit.models.tiny import build_tiny_model

            build_tiny_model(tiny, "qwen2")
        paths["tiny"] = str(tiny)
    if "smollm2" in models:
        from rlkit.models.smollm2 import smollm2_dir

        paths["smollm2"] = str(smollm2_dir())
    data = WORK / "arithmetic"
    if not (data / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "rlkit", "data", "arithmetic", "--output", str(data),
                        "--train-size", "64", "--test-size", "8"], check=True)
    return paths, str(data / "train.parquet")


def run_one(framework: str, python: str, model: str, name: str, dtype: str, data: str, args, out: Path) -> dict:
    prompts, group, tokens = WORKLOADS[name]
    script = HERE / ("trl_grpo.py" if framework == "trl" else "rlkit_grpo.py")
    cmd = [python, str(script), "--model", model, "--model-name", name, "--dtype", dtype, "--data", data,
           "--prompts", str(prompts), "--group", str(group), "--tokens", str(tokens), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if framework == "rlkit@base":  # another rlkit version (a worktree's src/) ahead of the installed one
        env["PYTHONPATH"] = str(Path(args.base_src).resolve())
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{framework} {name} {dtype} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(f"  {framework:5s} {name} {dtype}: {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(out.read_text())


def summarise(runs: list[dict]) -> dict:
    """Medians over every measured step of every run of one framework × model × dtype."""
    steps = [s for r in runs for s in r["steps"]]
    for s in steps:
        if "worker_gen" in s:  # rlkit: step time outside the worker's gen and update (dispatch, Ray, reward, adv, logging)
            s["overhead"] = s["step"] - s["worker_gen"] - s["worker_update_actor"]
    w = runs[0]["workload"]
    med = {k: statistics.median(s[k] for s in steps if k in s) for k in sorted({k for s in steps for k in s})}
    update = med.get("update_actor", med.get("update"))
    peak = statistics.median(r["peak_flops"] for r in runs)
    out = {"step": med["step"], "gen": med["gen"], "update": update, "n_steps": len(steps),
           "gen_tok_s": w["prompts"] * w["group"] * w["tokens"] / med["gen"],
           "update_flops_s": runs[0]["update_flops"] / update, "peak_flops": peak,
           "startup_s": statistics.median(r["startup_s"] for r in runs), "phases": med}
    out["update_peak_frac"] = out["update_flops_s"] / peak
    if "overhead" in med:
        out["overhead_s"] = med["overhead"]
        out["overhead_frac"] = statistics.median(s["overhead"] / s["step"] for s in steps)
    return out


def table(summary: dict) -> str:
    lines = ["| model | dtype | rlkit step s | TRL step s | rlkit/TRL | gen tok/s rlkit / TRL | update GFLOP/s rlkit / TRL "
             "(% of peak) | peak GFLOP/s | rlkit overhead | start-up s rlkit / TRL |", "|" + "---|" * 10]
    for key, s in summary.items():
        r, t = s["rlkit"], s["trl"]
        if "rlkit@base" in s:
            b = s["rlkit@base"]
            lines.append(
                f"| {key[0]} | {key[1]} (rlkit@base) | {b['step']:.2f} | {t['step']:.2f} | {b['step'] / t['step']:.2f} | "
                f"{b['gen_tok_s']:.0f} / - | {b['update_flops_s'] / 1e9:.1f} ({100 * b['update_peak_frac']:.0f}%) / - | "
                f"{b['peak_flops'] / 1e9:.0f} | {b['overhead_s']:.2f} s ({100 * b['overhead_frac']:.1f}%) | "
                f"{b['startup_s']:.0f} / - |")
        lines.append(
            f"| {key[0]} | {key[1]} | {r['step']:.2f} | {t['step']:.2f} | **{r['step'] / t['step']:.2f}** | "
            f"{r['gen_tok_s']:.0f} / {t['gen_tok_s']:.0f} | {r['update_flops_s'] / 1e9:.1f} "
            f"({100 * r['update_peak_frac']:.0f}%) / {t['update_flops_s'] / 1e9:.1f} ({100 * t['update_peak_frac']:.0f}%) | "
            f"{r['peak_flops'] / 1e9:.0f} | {r['overhead_s']:.2f} s ({100 * r['overhead_frac']:.1f}%) | "
            f"{r['startup_s']:.0f} / {t['startup_s']:.0f} |")
    lines += ["", "rlkit phases (median s): | model | dtype | " + " | ".join(PHASES) + " |", "|" + "---|" * (2 + len(PHASES))]
    for key, s in summary.items():
        for fw in [f for f in ("rlkit@base", "rlkit") if f in s]:
            ph = s[fw]["phases"]
            lines.append(f"| {key[0]} | {key[1]}{' (base)' if fw != 'rlkit' else ''} | "
                         + " | ".join(f"{ph[p]:.3f}" if p in ph else "-" for p in PHASES) + " |")
    return "\n".join(lines)


PHASES = ["step", "gen", "worker_gen", "reward", "old_log_prob", "adv", "update_actor", "worker_update_actor",
          "sync_weights", "overhead"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=2, help="runs per framework, alternating (ABBA)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per run")
    parser.add_argument("--label", default="", help="name of this run in benchmarks/results/")
    parser.add_argument("--base-src", default="", help="also run rlkit from this src/ folder (e.g. a git worktree "
                        "of an older commit: before/after in one invocation), reported as rlkit@base")
    args = parser.parse_args()
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    print(hardware_line() + f"; load average at the start {os.getloadavg()[0]:.2f}", flush=True)
    trl_python = str(ensure_trl_venv())
    paths, data = prepare(models)
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{args.label}" if args.label else "")
    raw_dir = WORK / "raw" / stamp
    results: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for name in models:
        for dtype in dtypes:
            frameworks = ["rlkit", "trl"] + (["rlkit@base"] if args.base_src else [])
            runs: dict[str, list[dict]] = {fw: [] for fw in frameworks}
            for r in range(args.rounds):
                order = frameworks if r % 2 == 0 else frameworks[::-1]
                for fw in order:
                    python = trl_python if fw == "trl" else sys.executable
                    out = raw_dir / f"{name}-{dtype}-{fw}-{r}.json"
                    runs[fw].append(run_one(fw, python, paths[name], name, dtype, data, args, out))
            results[(name, dtype)] = runs
    summary = {key: {fw: summarise(rs) for fw, rs in runs.items()} for key, runs in results.items()}
    machine = hardware()
    md = hardware_line(machine) + f"; load average at the end {os.getloadavg()[0]:.2f}\n\n" + table(summary)
    print(md)
    res_dir = HERE / "results"
    res_dir.mkdir(exist_ok=True)
    record = {"stamp": stamp, "args": vars(args), "workloads": WORKLOADS, "hardware": machine,
              "summary": {f"{k[0]}-{k[1]}": v for k, v in summary.items()}}
    (res_dir / f"{stamp}.json").write_text(json.dumps(record, indent=1))
    (res_dir / f"{stamp}.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
