"""Plots of a run's metrics over steps, read back from the tracking store.

``rlkit plot OUTPUT_DIR [OUTPUT_DIR ...] --out curves.png`` reads each run's MLflow run (its id is in
``OUTPUT_DIR/run_info.json``) or, failing that, ``OUTPUT_DIR/metrics.jsonl``, and draws one panel
per metric with one line per run (so two seeds sit side by side).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlkit.errors import RlkitError

__all__ = ["DEFAULT_KEYS", "read_history", "plot_runs"]

DEFAULT_KEYS = (
    "critic/score/mean",
    "val-core/*/score/mean[@_]*",  # MLflow stores mean@1 as mean_1
    "response_length/mean",
    "actor/entropy",
    "actor/pg_loss",
    "actor/grad_norm",
    "timing_s/step",
)


def _from_jsonl(path: Path) -> dict[str, list[tuple[int, float]]]:
    history: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        step = record.pop("step")
        record.pop("time", None)
        for key, value in record.items():
            if isinstance(value, (int, float)):
                history.setdefault(key, []).append((step, float(value)))
    return history


def _from_mlflow(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }


def read_history(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """metric name → [(step, value)] for the run whose output folder is ``run_dir``."""
    run_dir = Path(run_dir)
    info_path = run_dir / "run_info.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("mlflow_uri") and info.get("run_ids", {}).get("mlflow"):
            return _from_mlflow(info["mlflow_uri"], info["run_ids"]["mlflow"])
    if (run_dir / "metrics.jsonl").is_file():
        return _from_jsonl(run_dir / "metrics.jsonl")
    raise RlkitError(
        f"{run_dir}: no run_info.json with an MLflow run and no metrics.jsonl; give a run's "
        "trainer.output_dir"
    )


def _matches(pattern: str, key: str) -> bool:
    from fnmatch import fnmatchcase

    return fnmatchcase(key, pattern)


def plot_runs(
    run_dirs: list[str | Path],
    out: str | Path,
    keys: tuple[str, ...] = DEFAULT_KEYS,
    labels: list[str] | None = None,
) -> Path:
    """Write a PNG with one panel per metric (patterns allowed) and one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = [read_history(d) for d in run_dirs]
    labels = labels or [Path(d).name for d in run_dirs]
    names = sorted(
        {k for h in histories for k in h for pattern in keys if _matches(pattern, k)},
        key=lambda k: next(i for i, p in enumerate(keys) if _matches(p, k)),
    )
    if not names:
        raise RlkitError(f"none of the metrics {list(keys)} were logged in {[str(d) for d in run_dirs]}")
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for history, label in zip(histories, labels):
            points = history.get(name, [])
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
