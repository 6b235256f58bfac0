"""Side-by-side GRPO benchmark: rlkit vs TRL's GRPOTrainer on identical work (docs/benchmarks.md).

    python benchmarks/run.py                        # tiny Qwen2 + SmolLM2-135M, fp32 + bf16, 2 rounds
    python benchmarks/run.py --workloads tiny --dtypes fp32 --rounds 1
    python benchmarks/run.py --workloads smollm2,smollm2-64,smollm2-256 --dtypes fp32   # the cost curve
    python benchmarks/run.py --workloads smollm2-256 --dtypes fp16w   # rlkit's fp16 decode weights, TRL fp32
    python benchmarks/run.py --workloads smollm2-long --dtypes fp32,bf16   # prompts of >= 512 tokens

Makes TRL's virtual environment on first use (``benchmarks/.venv-trl``: torch 2.13 CPU + trl 1.16 from
the package index), builds the tiny model and the prompts under ``benchmarks/.work``, then for every
model × dtype runs alternating rounds (ABBA: rlkit, TRL, TRL, rlkit, ...), one process per run, one torch
thread per process (``--base-src``: a third, older rlkit in the rotation). Each process measures its own
matmul peak, skips ``--warmup`` steps and times ``--steps``. Prints a Markdown table and writes the raw
numbers to ``benchmarks/results/``.

Beside each measurement: the machine (CPU model, flags, matmul peaks, memory read bandwidth), the rooflines
(decode: bytes read per generated token and the generation's time bound at the measured bandwidth; update:
FLOPs and their time bound at the measured matmul peak, model FLOPs for both toolkits and the FLOPs rlkit
executes), and the cost curve: step and generation time per generated token, workloads by completion length.
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
from common import (  # noqa: E402
    HARNESS_DTYPES,
    decode_roofline,
    executed_update_flops,
    hardware,
    machine_line,
    matmul_peak_flops,
    memory_bandwidth,
    model_shape,
    save_results,
    trains_in_bf16,
)

WORK = HERE / ".work"
TRL_VENV = HERE / ".venv-trl"
TRL_PINS = ["torch==2.13.0", "trl==1.16.0"]

# workload -> (model, prompts, group, tokens): tiny measures framework cost, SmolLM2 a real model's compute;
# smollm2-64 / -256 grow the completions (the decode loop's share of the step grows with them);
# smollm2-long has prompts of at least LONG_PROMPT_TOKENS (the prefill's share grows, and every decode step
# attends over the long context).
WORKLOADS = {
    "tiny": ("tiny", 8, 8, 32),
    "smollm2": ("smollm2", 4, 4, 32),
    "smollm2-64": ("smollm2", 2, 4, 64),
    "smollm2-256": ("smollm2", 2, 4, 256),
    "smollm2-long": ("smollm2", 2, 4, 64),
}
# every workload issue 30's goal names: the harness set, and smollm2-64 (2 × 4 × 64), the issue's own ("ours")
DEFAULT_WORKLOADS = "tiny,smollm2,smollm2-64,smollm2-256,smollm2-long"
LONG_PROMPT_WORKLOADS = {"smollm2-long"}  # these read the long-prompt parquet file
LONG_PROMPT_TOKENS = 512
MAX_PROMPT_LENGTH = 1024  # both toolkits: no prompt of any workload is cut


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    probe = [
        str(python),
        "-c",
        "import torch, trl; assert '+cpu' in torch.__version__ or not torch.cuda.is_available();"
        "print(torch.__version__, trl.__version__)",
    ]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"making {TRL_VENV} ({' '.join(TRL_PINS)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    subprocess.run(probe, check=True)
    return python


def prepare(models: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Model folders by name and the prompts' parquet files, ``short`` and ``long`` (built once, cached under
    .work; ``long`` only where SmolLM2 is among ``models``: its tokenizer measures the prompts)."""
    paths = {}
    if "tiny" in models:
        tiny = WORK / "tiny-qwen2"
        if not (tiny / "config.json").exists():
            from rlkit.model.tiny import build_tiny_model

            build_tiny_model(tiny, "qwen2")
        paths["tiny"] = str(tiny)
    if "smollm2" in models:
        from rlkit.model.smollm2 import smollm2_dir

        paths["smollm2"] = str(smollm2_dir())
    data = WORK / "arithmetic"
    if not (data / "train.parquet").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rlkit",
                "data",
                "arithmetic",
                "--output",
                str(data),
                "--train-size",
                "64",
                "--test-size",
                "8",
            ],
            check=True,
        )
    files = {"short": str(data / "train.parquet")}
    if "smollm2" in models:
        files["long"] = str(long_prompt_file(data / "train.parquet", paths["smollm2"]))
    return paths, files


def long_prompt_file(short: Path, model: str) -> Path:
    """The arithmetic rows with a block of worked sums before each question, at least
    ``LONG_PROMPT_TOKENS`` tokens once the model's chat template is applied (each row its own sums, seeded
    by its index); the question and its answer are the row's own, so both toolkits' reward is unchanged."""
    import random

    import pandas as pd
    from transformers import AutoTokenizer

    out = short.with_name(f"train-long{LONG_PROMPT_TOKENS}.parquet")
    if out.exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = pd.read_parquet(short)
    prompts = []
    for index, prompt in enumerate(rows["prompt"]):
        rng = random.Random(index)
        messages = [dict(m) for m in prompt]
        question = messages[-1]["content"]
        worked = ["Worked examples:"]
        while True:
            messages[-1]["content"] = "\n".join([*worked, "", question])
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= LONG_PROMPT_TOKENS:
                break
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            worked.append(f"What is {a} + {b}? {a + b}")
        prompts.append(messages)
    rows["prompt"] = prompts
    rows.to_parquet(out)
    return out


def run_one(
    framework: str, python: str, model: str, name: str, dtype: str, data: str, args, out: Path
) -> dict:
    model_name, prompts, group, tokens = WORKLOADS[name]
    script = HERE / ("trl_grpo.py" if framework == "trl" else "rlkit_grpo.py")
    cmd = [
        python,
        str(script),
        "--model",
        model,
        "--model-name",
        model_name,
        "--dtype",
        dtype,
        "--data",
        data,
        "--prompts",
        str(prompts),
        "--max-prompt-length",
        str(MAX_PROMPT_LENGTH),
        "--group",
        str(group),
        "--tokens",
        str(tokens),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        str(out),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if framework == "rlkit@base":  # another rlkit version (a worktree's src/) ahead of the installed one
        env["PYTHONPATH"] = str(Path(args.base_src).resolve())
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{framework} {name} {dtype} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(f"  {framework:5s} {name} {dtype}: {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(out.read_text())


def summarise(runs: list[dict], model_dir: str) -> dict:
    """Medians over every measured step of every run of one framework × workload × dtype, with the
    rooflines."""
    steps = [s for r in runs for s in r["steps"]]
    for s in steps:
        # rlkit: step time outside the worker's gen and update (dispatch, Ray, reward, adv, logging)
        if "worker_gen" in s:
            s["overhead"] = s["step"] - s["worker_gen"] - s["worker_update_actor"]
    w = runs[0]["workload"]
    med = {k: statistics.median(s[k] for s in steps if k in s) for k in sorted({k for s in steps for k in s})}
    update = med.get("update_actor", med.get("update"))
    peak = statistics.median(r["peak_flops"] for r in runs)
    generated = w["prompts"] * w["group"] * w["tokens"]
    out = {
        "step": med["step"],
        "gen": med["gen"],
        "update": update,
        "n_steps": len(steps),
        "gen_tok_s": generated / med["gen"],
        "step_ms_per_token": 1e3 * med["step"] / generated,
        "gen_ms_per_token": 1e3 * med["gen"] / generated,
        "update_flops_s": runs[0]["update_flops"] / update,
        "peak_flops": peak,
        "startup_s": statistics.median(r["startup_s"] for r in runs),
        "phases": med,
        "decode": runs[0].get("decode", ""),
    }
    out["update_peak_frac"] = out["update_flops_s"] / peak
    out |= rooflines(runs, model_dir, med, peak)
    if "overhead" in med:
        out["overhead_s"] = med["overhead"]
        out["overhead_frac"] = statistics.median(s["overhead"] / s["step"] for s in steps)
    return out


def rooflines(runs: list[dict], model_dir: str, med: dict, peak: float) -> dict:
    """``bounds`` of one framework × workload × dtype, from the runs' recorded bandwidth and model."""
    bandwidth = statistics.median(r.get("bandwidth", 0.0) for r in runs) or memory_bandwidth()
    shape = model_shape(model_dir, runs[0]["n_params"])
    # rlkit's resolved decode dtype and linears, and the matmul peak of its decode's arithmetic
    med = med | {k: runs[0][k] for k in ("decode", "decode_peak_flops") if runs[0].get(k)}
    return bounds(
        runs[0]["workload"], runs[0]["framework"], shape, med, peak, bandwidth, runs[0]["update_flops"]
    )


def decode_bytes(dtype: str, framework: str, decode_dtype: str) -> tuple[int, int]:
    """(bytes per weight, bytes per KV-cache element) of a run's decode for its bound. rlkit: the decode it
    recorded (``decode_dtype``, since session 15: bf16 and fp16 weights 2 bytes, its KV cache fp32 with
    either; its arithmetic's peak is ``decode_peak_flops``); earlier rlkit runs (none recorded) and TRL: a
    row that trains in bf16 decodes and caches in bf16, rlkit's fp16w row decodes fp16 weights."""
    rlkit = framework.startswith("rlkit")
    if rlkit and decode_dtype:
        return (2 if decode_dtype in ("bfloat16", "float16") else 4), 4
    half = trains_in_bf16(dtype) or (rlkit and dtype == "fp16w")
    return (2 if half else 4), (2 if trains_in_bf16(dtype) else 4)


def bounds(
    w: dict, framework: str, shape, med: dict, peak: float, bandwidth: float, model_flops: float
) -> dict:
    """Decode: the generation's bound, per step max(bytes / bandwidth, FLOPs / peak), prefill included
    (``common.decode_roofline``; fp32 weights, or the bf16 / fp16 decode copy); update: model FLOPs (6 ·
    params · all tokens, both toolkits) and executed FLOPs (``rlkit.model.flops``: rlkit in the cheapest of
    its layouts, TRL padded rows with logits on the completion positions), with their bounds at the peak.
    ``peak``: the best-of 1024² matmul probe the run recorded (an achieved rate, so "% of peak" may pass 100 %
    on model FLOPs; on executed FLOPs it cannot pass the matmul's own rate)."""
    completions = w["prompts"] * w["group"]
    prompt_mean = (med["tokens"] - completions * w["tokens"]) / completions
    rlkit = framework.startswith("rlkit")
    weight_bytes, kv = decode_bytes(w["dtype"], framework, str(med.get("decode", "")).split(" ")[0])
    decode = decode_roofline(
        shape,
        completions,
        prompt_mean,
        w["tokens"],
        weight_bytes,
        bandwidth,
        med.get("decode_peak_flops") or peak,
        prompts=w["prompts"],
        kv_bytes=kv,
    )
    update = med.get("update_actor", med.get("update"))
    width = med.get("prompt_max", round(prompt_mean))
    executed, layout = executed_update_flops(
        shape,
        prompts=w["prompts"],
        completions=completions,
        prompt_width=width,
        tokens=w["tokens"],
        layout="best" if rlkit else "padded",
        head_rows=None if rlkit else completions * (w["tokens"] + 1),
    )
    steps = decode["decode_steps"]
    kind = (
        "compute"
        if decode["compute_bound_steps"] == steps
        else "bandwidth"
        if decode["compute_bound_steps"] == 0
        else f"compute {decode['compute_bound_steps']}/{steps}"
    )
    return {
        "bandwidth": bandwidth,
        "decode_bytes_per_token": decode["bytes_per_token"],
        "gen_bound_s": decode["gen_bound_s"],
        "prefill_bound_s": decode["prefill_bound_s"],
        "gen_bound_kind": kind,
        "gen_roofline_frac": decode["gen_bound_s"] / med["gen"],
        "update_model_flops": model_flops,
        "update_bound_s": model_flops / peak,
        "update_executed_flops": executed,
        "update_layout": layout,
        "update_executed_bound_s": executed / peak,
        "update_executed_frac": executed / peak / update,
    }


def table(summary: dict) -> str:
    lines = [
        "| workload | dtype | rlkit step s | TRL step s | rlkit/TRL | gen tok/s rlkit / TRL | update GFLOP/s "
        "rlkit / TRL (% of peak) | peak GFLOP/s | rlkit overhead | start-up s rlkit / TRL |",
        "|" + "---|" * 10,
    ]
    for key, s in summary.items():
        r, t = s["rlkit"], s["trl"]
        if "rlkit@base" in s:
            b = s["rlkit@base"]
            lines.append(
                f"| {key[0]} | {key[1]} (rlkit@base) | {b['step']:.2f} | {t['step']:.2f} | "
                f"{b['step'] / t['step']:.2f} | {b['gen_tok_s']:.0f} / - | {b['update_flops_s'] / 1e9:.1f} "
                f"({100 * b['update_peak_frac']:.0f}%) / - | {b['peak_flops'] / 1e9:.0f} | "
                f"{b['overhead_s']:.2f} s ({100 * b['overhead_frac']:.1f}%) | {b['startup_s']:.0f} / - |"
            )
        lines.append(
            f"| {key[0]} | {key[1]} | {r['step']:.2f} | {t['step']:.2f} | **{r['step'] / t['step']:.2f}** | "
            f"{r['gen_tok_s']:.0f} / {t['gen_tok_s']:.0f} | {r['update_flops_s'] / 1e9:.1f} "
            f"({100 * r['update_peak_frac']:.0f}%) / {t['update_flops_s'] / 1e9:.1f} "
            f"({100 * t['update_peak_frac']:.0f}%) | {r['peak_flops'] / 1e9:.0f} | {r['overhead_s']:.2f} s "
            f"({100 * r['overhead_frac']:.1f}%) | {r['startup_s']:.0f} / {t['startup_s']:.0f} |"
        )
    lines += [
        "",
        "rlkit phases (median s; decode: the rollout's resolved dtype and linears): | workload | dtype | "
        + " | ".join(PHASES)
        + " | decode | rollout/actor probs diff max |",
        "|" + "---|" * (4 + len(PHASES)),
    ]
    for key, s in summary.items():
        for fw in [f for f in ("rlkit@base", "rlkit") if f in s]:
            ph = s[fw]["phases"]
            lines.append(
                f"| {key[0]} | {key[1]}{' (base)' if fw != 'rlkit' else ''} | "
                + " | ".join(f"{ph[p]:.3f}" if p in ph else "-" for p in PHASES)
                + f" | {s[fw].get('decode') or '-'} | {_diff(ph)} |"
            )
    return "\n".join(lines + ["", roofline_table(summary)])


def _diff(phases: dict) -> str:
    """The rollout's max per-token probability difference from the actor's (median over steps), or -."""
    value = phases.get("rollout_probs_diff_max")
    return "-" if value is None else f"{value:.1e}"


def roofline_table(summary: dict) -> str:
    """The cost curve (workloads by completion length) and each measurement beside its roofline."""
    lines = [
        "Cost curve and rooflines (per generated token; gen bound = prefill + per step max(bytes / "
        "bandwidth, FLOPs / peak); update bound = FLOPs / peak; peak = the run's best-of 1024² matmul probe; "
        "executed FLOPs: rlkit.model.flops, rlkit in its cheapest layout, TRL padded):",
        "",
        "| workload | dtype | tokens | completions | toolkit | step ms/token | gen ms/token | decode bound "
        "ms/token (KiB/token; bound by) | gen % of bound | update s | update bound s (model FLOPs) | update "
        "bound s (executed; layout) | update % of probe peak (executed) |",
        "|" + "---|" * 13,
    ]
    order = sorted(summary, key=lambda k: (WORKLOADS[k[0]][0], k[1], WORKLOADS[k[0]][3]))
    for key in order:
        _, prompts, group, tokens = WORKLOADS[key[0]]
        for fw, s in summary[key].items():
            executed = (
                f"{s['update_executed_bound_s']:.2f} ({s['update_layout']}) | "
                f"{100 * s['update_executed_frac']:.0f}%"
            )
            bound_ms = 1e3 * s["gen_bound_s"] / (prompts * group * tokens)
            lines.append(
                f"| {key[0]} | {key[1]} | {tokens} | {prompts * group} | {fw} | {s['step_ms_per_token']:.1f} "
                f"| {s['gen_ms_per_token']:.2f} | {bound_ms:.2f} ({s['decode_bytes_per_token'] / 2**10:.0f}; "
                f"{s['gen_bound_kind']}) | {100 * s['gen_roofline_frac']:.0f}% | {s['update']:.2f} | "
                f"{s['update_bound_s']:.2f} | {executed} |"
            )
    return "\n".join(lines)


PHASES = [
    "step",
    "gen",
    "worker_gen",
    "decode_weights",
    "reward",
    "old_log_prob",
    "adv",
    "update_actor",
    "worker_update_actor",
    "sync_weights",
    "overhead",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        "--models",
        dest="workloads",
        default=DEFAULT_WORKLOADS,
        help=f"comma-separated, of: {', '.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--dtypes",
        default="fp32,bf16",
        help="comma-separated, of: " + "; ".join(f"{k} ({v})" for k, v in HARNESS_DTYPES.items()),
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs per framework, alternating (ABBA)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="unmeasured steps per run (3: an rlkit worker's memory settles in ~3 steps, docs/benchmarks.md)",
    )
    parser.add_argument("--label", default="", help="name of this run in benchmarks/results/")
    parser.add_argument(
        "--base-src",
        default="",
        help="also run rlkit from this src/ folder (e.g. a git worktree "
        "of an older commit: before/after in one invocation), reported as rlkit@base",
    )
    args = parser.parse_args()
    workloads, dtypes = args.workloads.split(","), args.dtypes.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(WORKLOADS)}")
    unknown = [d for d in dtypes if d not in HARNESS_DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {', '.join(unknown)}; valid: {', '.join(HARNESS_DTYPES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    print(
        machine_line(matmul_peak_flops("fp32"), memory_bandwidth())
        + f"; load average at the start {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    trl_python = str(ensure_trl_venv())
    paths, files = prepare(sorted({WORKLOADS[w][0] for w in workloads}))

    def data_of(name: str) -> str:
        return files["long" if name in LONG_PROMPT_WORKLOADS else "short"]

    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{args.label}" if args.label else "")
    raw_dir = WORK / "raw" / stamp
    results: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for name in workloads:
        for dtype in dtypes:
            frameworks = ["rlkit", "trl"] + (["rlkit@base"] if args.base_src else [])
            runs: dict[str, list[dict]] = {fw: [] for fw in frameworks}
            for r in range(args.rounds):
                order = frameworks if r % 2 == 0 else frameworks[::-1]
                for fw in order:
                    python = trl_python if fw == "trl" else sys.executable
                    out = raw_dir / f"{name}-{dtype}-{fw}-{r}.json"
                    runs[fw].append(
                        run_one(fw, python, paths[WORKLOADS[name][0]], name, dtype, data_of(name), args, out)
                    )
            results[(name, dtype)] = runs
    summary = {
        key: {fw: summarise(rs, paths[WORKLOADS[key[0]][0]]) for fw, rs in runs.items()}
        for key, runs in results.items()
    }
    machine = hardware()
    md = (
        machine_line(matmul_peak_flops("fp32"), memory_bandwidth(), machine)
        + f"; load average at the end {os.getloadavg()[0]:.2f}\n\n"
        + table(summary)
    )
    print(md)
    record = {
        "stamp": stamp,
        "args": vars(args),
        "workloads": {w: WORKLOADS[w] for w in workloads},
        "hardware": machine,
        "summary": {f"{k[0]}-{k[1]}": v for k, v in summary.items()},
    }
    print("results:", save_results(args.label or "run", record, md))


if __name__ == "__main__":
    main()
