"""Recompute the bounds of committed ``run.py`` results from the inputs they recorded (no timing is run).

    python benchmarks/recompute_bounds.py            # every run.py results file below, one table each

For each framework × workload × dtype of a results file: the update's executed FLOPs (``rlkit.model.flops``
in the layout that toolkit ran then, below) over the recorded update time and the recorded best-of 1024²
matmul probe ("% of probe peak", next to the superseded model-FLOPs figure), and where the file recorded the
memory bandwidth and prompt width (2026-11-23 on), the generation's bound: prefill plus, per decode step,
max(bytes / bandwidth, FLOPs / probe peak) (``common.decode_roofline``), and which term bounds the steps.

Layouts (what each toolkit's code executed when the file was written; ``docs/benchmarks.md`` History):
TRL padded rows, logits on the completion positions; rlkit before change 1a (rlkit@base of before-after)
padded rows, logits at every position; after changes 1-6 padded rows, logits on t + 1 positions; after change
7 one prompt pass per group, logits on t + 1 positions; from issue 19 (fused head, packing) the cheapest
layout, head on response tokens. Prompt width: the recorded longest prompt, else the mean prompt (a lower
bound of the padded width, so the executed FLOPs stay a lower bound).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    RESULTS,
    ModelShape,
    decode_roofline,
    executed_update_flops,
    save_results,
    shape_from_config,
)

WORKLOADS = {
    "tiny": ("tiny", 8, 8, 32),
    "smollm2": ("smollm2", 4, 4, 32),
    "smollm2-64": ("smollm2", 2, 4, 64),
    "smollm2-256": ("smollm2", 2, 4, 256),
}  # as benchmarks/run.py
# results file -> {framework: (layout, head rows per completion: "t+1", "all" or "response")}
FILES = {
    "20261122-032321-before-after": {
        "rlkit@base": ("padded", "all"),
        "rlkit": ("padded", "t+1"),
        "trl": ("padded", "t+1"),
    },
    "20261122-034326-after-prefix": {"rlkit": ("shared", "t+1"), "trl": ("padded", "t+1")},
    "20261122-035152-tiny-same-tokens": {"rlkit": ("shared", "t+1"), "trl": ("padded", "t+1")},
    "20261123-063529-issue19": {"rlkit": ("best", "response"), "trl": ("padded", "t+1")},
    "20261123-081045-fp16w": {"rlkit": ("best", "response"), "trl": ("padded", "t+1")},
}


def shapes() -> dict[str, dict]:
    """config.json of the two models: SmolLM2-135M-Instruct's (fixed), the tiny Qwen2 built as run.py builds
    it."""
    from rlkit.model.tiny import build_tiny_model

    smollm2 = {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tiny = json.loads((Path(build_tiny_model(Path(tmp) / "tiny", "qwen2")) / "config.json").read_text())
    return {"smollm2": smollm2, "tiny": tiny}


def one(name: str, key: str, fw: str, s: dict, layout: tuple[str, str], shape: ModelShape) -> dict:
    workload, dtype = key.rsplit("-", 1)
    _, prompts, group, tokens = WORKLOADS[workload]
    completions = prompts * group
    med = s["phases"]
    prompt_mean = (med["tokens"] - completions * tokens) / completions
    width = med.get("prompt_max", round(prompt_mean))
    head = {
        "t+1": completions * (tokens + 1),
        "all": completions * (width + tokens),
        "response": completions * tokens,
    }[layout[1]]
    executed, chosen = executed_update_flops(
        shape,
        prompts=prompts,
        completions=completions,
        prompt_width=width,
        tokens=tokens,
        layout=layout[0],
        head_rows=head,
    )
    update, peak = s["update"], s["peak_flops"]
    out = {
        "file": name,
        "workload": workload,
        "dtype": dtype,
        "toolkit": fw,
        "update_s": update,
        "probe_peak_gflops": peak / 1e9,
        "model_flops_frac_superseded": s["update_peak_frac"],
        "executed_gflop": executed / 1e9,
        "layout": chosen,
        "executed_frac": executed / update / peak,
    }
    if "bandwidth" in s:
        half = dtype == "bf16" or (dtype == "fp16w" and fw.startswith("rlkit"))
        d = decode_roofline(
            shape,
            completions,
            prompt_mean,
            tokens,
            2 if half else 4,
            s["bandwidth"],
            peak,
            prompts=prompts,
            kv_bytes=2 if dtype == "bf16" else 4,
        )
        steps, compute = d["decode_steps"], d["compute_bound_steps"]
        out |= {
            "gen_s": s["gen"],
            "gen_bound_s": d["gen_bound_s"],
            "prefill_bound_s": d["prefill_bound_s"],
            "gen_frac": d["gen_bound_s"] / s["gen"],
            "gen_frac_superseded": s.get("gen_roofline_frac"),
            "bound_by": "compute"
            if compute == steps
            else "bandwidth"
            if compute == 0
            else f"compute {compute}/{steps}",
            "bandwidth_gbs": s["bandwidth"] / 1e9,
        }
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| results file | workload | dtype | toolkit | update s | executed GFLOP (layout) | update % of "
        "probe peak: executed (model FLOPs, superseded) | gen s | gen bound s (prefill; steps bound by) | "
        "gen % of bound (bandwidth-only, superseded) |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        gen = (
            f"{r['gen_s']:.2f} | {r['gen_bound_s']:.2f} ({r['prefill_bound_s']:.2f}; {r['bound_by']}) | "
            f"{100 * r['gen_frac']:.0f}% ({100 * r['gen_frac_superseded']:.0f}%)"
            if "gen_s" in r
            else "- | - | -"
        )
        lines.append(
            f"| {r['file']} | {r['workload']} | {r['dtype']} | {r['toolkit']} | {r['update_s']:.2f} | "
            f"{r['executed_gflop']:.0f} ({r['layout']}) | {100 * r['executed_frac']:.0f}% "
            f"({100 * r['model_flops_frac_superseded']:.0f}%) | {gen} |"
        )
    return "\n".join(lines)


def main() -> None:
    configs = shapes()
    rows = []
    for name, layouts in FILES.items():
        data = json.loads((RESULTS / f"{name}.json").read_text())
        for key, per_fw in data["summary"].items():
            model = WORKLOADS[key.rsplit("-", 1)[0]][0]
            for fw, s in per_fw.items():
                _, prompts, group, tokens = WORKLOADS[key.rsplit("-", 1)[0]]
                params = s.get("update_model_flops", s["update_flops_s"] * s["update"]) / (
                    6 * s["phases"]["tokens"]
                )
                shape = shape_from_config(configs[model], round(params))
                rows.append(one(name, key, fw, s, layouts[fw], shape))
    worst = max(r["executed_frac"] for r in rows)
    md = (
        "Recomputed from the recorded inputs of the results files named in the first column "
        "(no timing was run; the machine line is where the arithmetic ran). Peak = each run's "
        "recorded best-of 1024² matmul probe, an achieved rate. Largest executed fraction: "
        f"{100 * worst:.0f}%.\n\n" + table(rows)
    )
    print(md)
    print(
        "results:",
        save_results(
            "recomputed-bounds",
            {
                "inputs": sorted(FILES),
                "rows": rows,
                "median_executed_frac": statistics.median(r["executed_frac"] for r in rows),
            },
            md,
        ),
    )


if __name__ == "__main__":
    main()
