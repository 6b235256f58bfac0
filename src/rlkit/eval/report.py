"""What ``rlkit eval`` writes and prints: ``results.json``, ``results.md``, a terminal table, an MLflow
run, and ``rlkit eval --compare A.json B.json ...``.

``results.json``: ``{"model", "model_kind", "data", "sampling", "prompts", "samples", "metrics": {name:
{"value", "ci_low", "ci_high", "se"}}}``. MLflow: the run ``<name>`` in experiment ``eval`` of the SQLite
store beside the output folder (``<out>/../mlflow.db``, as training's ``<output_dir>/../mlflow.db``);
params model, data, sampling; metrics under the names of training's validation (``val-core/...``, MLflow
writes ``@`` as ``_``), each interval as ``<name>/ci_low`` and ``<name>/ci_high``; results.md as a text
artifact.

Compare: the difference of each metric the files share, B − A (each file against the first), with the 95%
interval ``diff ± 1.96 · sqrt(se_A² + se_B²)`` (the two evaluations' bootstrap standard errors, taken as
independent).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlkit.eval.metrics import Estimate
from rlkit.eval.model import EvalError

__all__ = ["results_dict", "table_text", "markdown", "write_results", "log_mlflow", "compare", "load_results"]


def results_dict(meta: dict[str, Any], metrics: dict[str, Estimate]) -> dict[str, Any]:
    return meta | {
        "metrics": {
            k: {"value": e.value, "ci_low": e.ci_low, "ci_high": e.ci_high, "se": e.se}
            for k, e in sorted(metrics.items())
        }
    }


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def _interval(m: dict[str, Any]) -> str:
    return f"[{_fmt(m['ci_low'])}, {_fmt(m['ci_high'])}]" if m.get("ci_low") is not None else ""


def table_text(results: dict[str, Any]) -> str:
    """One line per metric: name, value, 95% interval."""
    rows = [(k, _fmt(m["value"]), _interval(m)) for k, m in results["metrics"].items()]
    width = max([len(r[0]) for r in rows] + [6])
    lines = [f"{'metric':<{width}}  {'value':>8}  95% CI", "-" * (width + 30)]
    lines += [f"{k:<{width}}  {v:>8}  {ci}" for k, v, ci in rows]
    head = (
        f"model {results['model']} ({results['model_kind']}); {results['prompts']} prompts x "
        f"n={results['sampling']['n']}; {results['sampling']}"
    )
    return head + "\n" + "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# rlkit eval: {results['model']}",
        "",
        f"- model kind: {results['model_kind']}",
        f"- data: {', '.join(results['data'])}",
        f"- sampling: {results['sampling']}",
        f"- prompts: {results['prompts']}, samples: {results['samples']}",
        "",
        "| metric | value | 95% CI |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {_fmt(m['value'])} | {_interval(m)} |" for k, m in results["metrics"].items()]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict[str, Any]) -> tuple[Path, Path]:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    return out / "results.json", out / "results.md"


def log_mlflow(out: Path, name: str, results: dict[str, Any], params: dict[str, Any]) -> str:
    """The eval as one MLflow run (experiment ``eval``); returns the tracking URI."""
    from rlkit.runtime.tracking import MlflowTracker, TrackerConfig

    tracker = MlflowTracker(TrackerConfig(project="eval", experiment=name, output_dir=out, total_steps=0))
    tracker.log_params(params)
    metrics: dict[str, float] = {}
    for key, m in results["metrics"].items():
        metrics[key] = m["value"]
        if m.get("ci_low") is not None:
            metrics[f"{key}/ci_low"], metrics[f"{key}/ci_high"] = m["ci_low"], m["ci_high"]
    tracker.log({k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}, step=0)
    tracker.log_text(markdown(results), "results.md")
    tracker.finish()
    (out / "run_info.json").write_text(
        json.dumps({"mlflow": tracker.run_id, "mlflow_uri": tracker.uri}) + "\n"
    )
    return tracker.uri


def load_results(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EvalError(
            f"--compare: cannot read {path} ({exc}); give results.json files (or folders) that "
            "rlkit eval wrote"
        ) from exc
    if "metrics" not in results:
        raise EvalError(f"--compare: {path} has no 'metrics'; it is not an rlkit eval results.json")
    return results


def compare(paths: list[str]) -> str:
    """A table of B − A for every metric the files share, with the difference's 95% interval."""
    if len(paths) < 2:
        raise EvalError("--compare needs two or more results.json files: rlkit eval --compare A.json B.json")
    runs = [load_results(p) for p in paths]
    base = runs[0]
    lines = []
    for path, other in zip(paths[1:], runs[1:]):
        lines.append(f"{path} - {paths[0]}")
        for key in sorted(set(base["metrics"]) & set(other["metrics"])):
            a, b = base["metrics"][key], other["metrics"][key]
            diff = b["value"] - a["value"]
            if a.get("se") is not None and b.get("se") is not None:
                half = 1.96 * math.sqrt(a["se"] ** 2 + b["se"] ** 2)
                ci = f"[{diff - half:+.4f}, {diff + half:+.4f}]"
            else:
                ci = ""
            lines.append(f"  {key}: {_fmt(a['value'])} -> {_fmt(b['value'])}  diff {diff:+.4f} {ci}")
    return "\n".join(lines)
