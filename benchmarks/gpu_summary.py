"""The results file of a GPU check (issue 31): what ``benchmarks/gpu_check.sh`` wrote to ``$OUT`` on the lent
GPU machine, summarised on this machine into ``benchmarks/results/<stamp>-gpu-check.{json,md}``.

    python benchmarks/gpu_summary.py --tests DIR --quickstart DIR [--harness DIR]

``--tests``: the folder with ``cuda-junit.xml``, ``setup.log`` and ``smoke-*-metrics.jsonl`` (stages setup,
tests, smoke); ``--quickstart``: the folder with ``quickstart-metrics.jsonl`` (stage quickstart);
``--harness``: the folder with ``harness-rlkit.json`` / ``harness-trl.json`` (stage harness). The record
embeds every metrics row it read, so the numbers can be recomputed from the results file alone.

Update TFLOP/s: ``perf/flops/actor`` (executed FLOPs, ``rlkit.model.flops``) over the update's time, against
the GPU's dense bf16 peak from rlkit's table (``rlkit.model.flops.gpu_peak``); the harness row uses its
model count (6 · parameters · tokens) as the CPU harness does.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _junit(path: Path) -> dict:
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _setup(path: Path) -> dict:
    text = path.read_text().splitlines()
    gpu = next(line for line in text if "NVIDIA" in line and "MiB" in line)
    versions = next(line for line in text if re.match(r"^3\.\d+\.\d+ ", line)).split()
    name, memory, driver = (x.strip() for x in gpu.split(","))
    return {
        "gpu": name,
        "gpu_memory": memory,
        "driver": driver,
        "python": versions[0],
        "torch": versions[1],
        "cuda": versions[2],
        "transformers": versions[3],
    }


def _quickstart_rows() -> int:
    """Responses per quickstart step: the recipe's prompts per step × samples per prompt."""
    import yaml

    recipe = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml").read_text()
    )
    return recipe["data"]["train_batch_size"] * recipe["rollout"]["n"]


def _quickstart(rows: list[dict], peak_tflops: float) -> dict:
    steps = [r for r in rows if "timing_s/step" in r]
    steady = steps[2:]  # steps 1-2 pay CUDA/cuBLAS warm-up (8.0 s and 4.5 s here)
    val = [
        (r["step"], r["val-core/rlkit/arithmetic/score/mean@1"])
        for r in rows
        if any("val-core" in k for k in r)
    ]

    def med(key):
        return statistics.median(r[key] for r in steady)

    update_tflops = statistics.median(
        r["perf/flops/actor"] / r["timing_s/update_actor"] / 1e12 for r in steady
    )
    rows = _quickstart_rows()
    gen_tokens = [r["response_length/mean"] * rows for r in steady]
    return {
        "steps": len(steps),
        "steady_steps": f"{steady[0]['step']}-{steady[-1]['step']}",
        "s_per_step": med("timing_s/step"),
        "gen_s": med("timing_s/gen"),
        "update_s": med("timing_s/update_actor"),
        "gen_tok_per_s": statistics.median(t / r["timing_s/gen"] for t, r in zip(gen_tokens, steady)),
        "update_tflops_executed": update_tflops,
        "update_share_of_peak": update_tflops / peak_tflops,
        "mfu_logged": med("perf/mfu/actor"),
        "max_memory_allocated_gb": max(r["perf/max_memory_allocated_gb"] for r in steps),
        "grad_norm_min": min(r["actor/grad_norm"] for r in steps),
        "rollout_probs_diff_mean": med("training/rollout_probs_diff_mean"),
        "val": val,
        "first_steps_s": [round(r["timing_s/step"], 2) for r in steps[:2]],
    }


def _smoke(rows: list[dict]) -> dict:
    steps = [r for r in rows if "timing_s/step" in r]
    return {
        "steps": len(steps),
        "grad_norm": [r.get("actor/grad_norm") for r in steps],
        "critic_vf_loss": [r.get("critic/vf_loss") for r in steps],
        "critic_grad_norm": [r.get("critic/grad_norm") for r in steps],
        "max_memory_allocated_gb": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in steps),
    }


def _harness(record: dict, peak_tflops: float) -> dict:
    m, w = record["median"], record["workload"]
    gen_tokens = w["prompts"] * w["group"] * w["tokens"]
    update = m.get("update_actor", m.get("update"))
    return {
        "workload": f"{w['model_name']} {w['prompts']}x{w['group']}x{w['tokens']} {w['dtype']}",
        "steps": len(record["steps"]),
        "s_per_step": m["step"],
        "step_s_each": [round(s["step"], 2) for s in record["steps"]],
        "gen_s": m["gen"],
        "gen_tok_per_s": gen_tokens / m["gen"],
        "update_s": update,
        "update_tflops_model": record["update_flops"] / update / 1e12,
        "update_share_of_peak": record["update_flops"] / update / 1e12 / peak_tflops,
        "startup_s": record["startup_s"],
        "max_memory_allocated_gb": record.get("max_memory_allocated_gb"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tests", type=Path, required=True)
    parser.add_argument("--quickstart", type=Path, required=True)
    parser.add_argument("--harness", type=Path)
    args = parser.parse_args()
    from rlkit.model.flops import gpu_peak

    setup = _setup(args.tests / "setup.log")
    peak = gpu_peak(setup["gpu"], "bf16")
    peak_tflops = peak.flops / 1e12
    qs_rows = _rows(args.quickstart / "quickstart-metrics.jsonl")
    smoke_rows = {p.stem.split("-")[1]: _rows(p) for p in sorted(args.tests.glob("smoke-*-metrics.jsonl"))}
    harness = {}
    for fw in ("rlkit", "trl"):
        path = args.harness / f"harness-{fw}.json" if args.harness else None
        if path and path.exists():
            harness[fw] = json.loads(path.read_text())
    record = {
        "device": setup,
        "bf16_peak_tflops": peak_tflops,
        "peak_source": peak.source,
        "cuda_tests": _junit(args.tests / "cuda-junit.xml"),
        "smoke": {name: _smoke(rows) for name, rows in smoke_rows.items()},
        "quickstart": _quickstart(qs_rows, peak_tflops),
        "harness": {fw: _harness(r, peak_tflops) for fw, r in harness.items()},
        "raw": {"quickstart_metrics": qs_rows, "smoke_metrics": smoke_rows, "harness": harness},
    }
    q = record["quickstart"]
    lines = [
        f"device: {setup['gpu']} ({setup['gpu_memory']}, driver {setup['driver']}), CUDA {setup['cuda']}, "
        f"torch {setup['torch']}, transformers {setup['transformers']}, Python {setup['python']}; "
        f"bf16 dense peak {peak_tflops:.1f} TFLOP/s ({peak.source})",
        "",
        f"cuda-marked tests: {record['cuda_tests']}",
        "",
        "| run | s/step | gen s | gen tok/s | update s | update TFLOP/s | of bf16 peak | peak GPU GB |",
        "|---|---|---|---|---|---|---|---|",
        f"| quickstart (SmolLM2, 8x8x16, bf16; median of steps {q['steady_steps']}) | "
        f"{q['s_per_step']:.2f} | "
        f"{q['gen_s']:.2f} | {q['gen_tok_per_s']:.0f} | {q['update_s']:.2f} | "
        f"{q['update_tflops_executed']:.2f} (executed) | {q['update_share_of_peak']:.2%} | "
        f"{q['max_memory_allocated_gb']:.2f} |",
    ]
    for fw, h in record["harness"].items():
        lines.append(
            f"| harness {fw} ({h['workload']}; median of {h['steps']}) | {h['s_per_step']:.2f} | "
            f"{h['gen_s']:.2f} | "
            f"{h['gen_tok_per_s']:.0f} | {h['update_s']:.2f} | {h['update_tflops_model']:.1f} (model) | "
            f"{h['update_share_of_peak']:.2%} | {h['max_memory_allocated_gb'] or 0:.2f} |"
        )
    lines += [
        "",
        f"quickstart greedy validation (step, mean@1): {q['val']}; first two steps {q['first_steps_s']} s; "
        f"rollout/actor probability diff mean {q['rollout_probs_diff_mean']:.4f}; min grad norm "
        f"{q['grad_norm_min']:.2f}",
    ]
    for name, s in record["smoke"].items():
        lines.append(
            f"smoke {name}: {s['steps']} steps, actor grad norms {s['grad_norm']}, "
            f"critic vf loss {s['critic_vf_loss']}, critic grad norms {s['critic_grad_norm']}"
        )
    markdown = "\n".join(lines)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    command = "python benchmarks/gpu_summary.py " + " ".join(sys.argv[1:])
    path = RESULTS / f"{stamp}-gpu-check.json"
    path.write_text(json.dumps({"command": command, "machine": setup} | record, indent=1, default=str))
    path.with_suffix(".md").write_text(
        f"`bash benchmarks/gpu_check.sh` on the GPU, then `{command}`\n\n{markdown}\n"
    )
    print(markdown)
    print(path)


if __name__ == "__main__":
    main()
