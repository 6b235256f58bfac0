"""A measured learning curve: one ``rlkit run`` of a recipe, its per-step scores as a results file and a plot.

    python benchmarks/learning_curve.py recipes/reasoning_gym.yaml --name reasoning-gym-curve \
        [--keys critic/score/mean val-core/reasoning_gym/score/mean@1 ...] [-- key=value overrides]

Runs the recipe as a user would (``rlkit run`` in a subprocess, its output streamed), with
``trainer.output_dir`` under ``outputs/curves/<name>``, then reads the run's ``metrics.jsonl`` and writes
``benchmarks/results/<stamp>-<name>.{json,md}`` (every step's value of each key, the first and last values,
the wall time, the machine and load) and ``.png`` through ``rlkit plot``. Scores do not depend on the load;
the wall time does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import machine_record, save_results

DEFAULT_KEYS = ["critic/score/mean", "response_length/mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--name", required=True, help="results file name (after the time stamp)")
    parser.add_argument("--keys", nargs="+", default=DEFAULT_KEYS, help="metrics to keep (exact names)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.overrides = argv[cut + 1 :]  # passed to `rlkit run` as they are (key=value, --smoke)

    out = Path("outputs/curves") / args.name
    if out.exists():
        sys.exit(f"{out} exists: remove it or pick another --name (a curve is one fresh run)")
    rlkit = Path(sys.executable).with_name("rlkit")
    command = [str(rlkit), "run", args.recipe, f"trainer.output_dir={out}", *args.overrides]
    print("+", " ".join(command), flush=True)
    machine = machine_record()
    start = time.time()
    subprocess.run(command, check=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    wall = time.time() - start
    machine["load_after"] = [round(x, 2) for x in os.getloadavg()]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curves = {
        key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))] for key in args.keys
    }
    missing = [key for key, points in curves.items() if not points]
    if missing:
        sys.exit(f"no step logged {missing}; logged keys: {sorted({k for r in rows for k in r})}")
    plot = out / "curve.png"
    subprocess.run([str(rlkit), "plot", str(out), "--out", str(plot), "--keys", *args.keys], check=True)

    table = ["| metric | first (step) | last (step) | min | max |", "|---|---|---|---|---|"]
    for key, points in curves.items():
        values = [v for _, v in points]
        first, last = points[0], points[-1]
        table.append(
            f"| `{key}` | {first[1]:.3f} ({first[0]}) | {last[1]:.3f} ({last[0]}) "
            f"| {min(values):.3f} | {max(values):.3f} |"
        )
    steps = sorted({s for points in curves.values() for s, _ in points})
    per_step = ["| step | " + " | ".join(f"`{k}`" for k in curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for step in steps:
        cells = [next((f"{v:.3f}" for s, v in curves[k] if s == step), "") for k in curves]
        per_step.append(f"| {step} | " + " | ".join(cells) + " |")
    markdown = "\n".join(
        [
            f"`rlkit run {args.recipe} {' '.join(args.overrides)}`: {wall / 60:.1f} min wall",
            "",
            *table,
            "",
            *per_step,
            "",
            "plot: the `.png` of the same name",
        ]
    )
    record = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "wall_s": round(wall, 1),
        "curves": curves,
    }
    path = save_results(args.name, record, markdown, machine=machine)
    shutil.copyfile(plot, path.with_suffix(".png"))
    print(markdown)
    print(f"wrote {path.with_suffix('')}.{{json,md,png}}")


if __name__ == "__main__":
    main()
