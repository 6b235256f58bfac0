"""The results file of one ``benchmarks/quickstart_fresh.sh`` run (that script calls it; not run by hand).

    python benchmarks/quickstart_record.py --clone DIR --log FILE --rc RC --seconds S --started T0 \
        --load-before "a b c" --load-after "a b c" [--args "WORKDIR"]

Reads the fresh clone's run folder (``outputs/rlkit/quickstart/metrics.jsonl``, ``params.json``) and the
command's log, and writes ``benchmarks/results/<stamp>-quickstart-fresh.{json,md}`` in this repository: the
commit, rc and seconds of the README's main command, the phase boundaries (from the files' modification
times, seconds after the start), each step's ``timing_s/step``, ``timing_s/gen`` and
``timing_s/update_actor``, greedy validation at each validated step, and the machine (CPU model, flags,
torch, matmul probe, load).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_record, save_results  # noqa: E402

VALIDATION = "val-core/rlkit/arithmetic/score/mean@1"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clone", required=True, help="the fresh clone the command ran in")
    parser.add_argument("--log", required=True)
    parser.add_argument("--rc", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--started", type=float, required=True, help="the command's start, Unix seconds")
    parser.add_argument("--load-before", required=True)
    parser.add_argument("--load-after", required=True)
    parser.add_argument("--args", default="", help="quickstart_fresh.sh's own arguments")
    args = parser.parse_args()
    clone = Path(args.clone)
    run = clone / "outputs" / "rlkit" / "quickstart"
    metrics = run / "metrics.jsonl"  # absent where the command failed before the run started
    text = metrics.read_text() if metrics.exists() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    validation = {int(r["step"]): r[VALIDATION] for r in rows if VALIDATION in r}
    commit = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    log = Path(args.log)
    done = re.findall(r"^done: .*$", log.read_text(errors="replace") if log.exists() else "", flags=re.M)

    def after_start(path: Path) -> float | None:
        return round(path.stat().st_mtime - args.started, 1) if path.exists() else None

    phases = {
        "data written": after_start(clone / "data" / "arithmetic" / "train.parquet"),
        "run folder created (params.json)": after_start(run / "params.json"),
        "last metrics": after_start(metrics),
        "merged model": after_start(run / "hf_model" / "config.json"),
    }
    record = {
        "commit": commit,
        "rc": args.rc,
        "seconds": round(args.seconds, 1),
        "phases_s_after_start": phases,
        "load_before": args.load_before,
        "load_after": args.load_after,
        "steps": [
            {k: r.get(k) for k in ("step", "timing_s/step", "timing_s/gen", "timing_s/update_actor")}
            for r in steps
        ],
        "validation": validation,
        "done": done[-1] if done else None,
    }

    def series(key: str) -> str:
        return ", ".join(f"{r[key]:.1f}" for r in steps if key in r)

    val = " / ".join(f"{v:.2f}" for v in validation.values())
    lines = [
        f"README main command on a fresh clone at `{commit}`: rc {args.rc}, **{args.seconds:.0f} s** "
        f"({args.seconds / 60:.1f} min); load before {args.load_before}, after {args.load_after}",
        "",
        "| | |",
        "|---|---|",
        "| phases (s after the start) | "
        + ", ".join(f"{k} {v}" for k, v in phases.items() if v is not None)
        + " |",
        f"| s/step (`timing_s/step`) | {series('timing_s/step')} |",
        f"| gen s | {series('timing_s/gen')} |",
        f"| update s | {series('timing_s/update_actor')} |",
        f"| greedy validation at steps {' / '.join(str(s) for s in validation)} | {val} |",
    ]
    command = "bash benchmarks/quickstart_fresh.sh" + (f" {args.args}" if args.args else "")
    print(
        "results:",
        save_results("quickstart-fresh", record, "\n".join(lines), machine=machine_record(), command=command),
    )


if __name__ == "__main__":
    main()
