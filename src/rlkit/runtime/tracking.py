"""Experiment tracking: console (progress bar), MLflow (embedded SQLite store), JSON lines.

Tracker classes are registered in the ``trackers`` registry; a recipe lists the ones to use in
``tracking.backends``. Each is built as ``cls(config: TrackerConfig)`` and has
``log(metrics, step)``, ``log_params(params)``, ``log_artifact(path)``, ``log_text(text, name)``,
``finish(status)`` and a ``run_id`` (saved in checkpoints so a resumed run continues the same
run). A tracker that fails (a locked or unwritable store) never stops training: ``Tracking``
reports the first error of each tracker once and counts them in ``tracking/errors``; a tracker
whose constructor fails is replaced by a ``FailedTracker`` (``start_tracker``), so that too is reported
once and counted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TrackerConfig",
    "Tracking",
    "FailedTracker",
    "start_tracker",
    "ConsoleTracker",
    "MlflowTracker",
    "JsonlTracker",
    "flatten",
]

logger = logging.getLogger(__name__)


@dataclass
class TrackerConfig:
    """What every tracker is built from (made by the trainer from the recipe)."""

    project: str
    experiment: str
    output_dir: Path
    total_steps: int
    mlflow_uri: str | None = None
    jsonl_path: Path | None = None
    run_ids: dict[str, str] = field(default_factory=dict)  # tracker name -> run id to resume


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (recipe → MLflow params)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


class ConsoleTracker:
    """A progress bar (step/total, score, step time, ETA) plus a metrics line every ``every`` steps."""

    name = "console"

    def __init__(self, config: TrackerConfig, every: int = 1):
        from tqdm import tqdm

        self.run_id = ""
        self.every = every
        self.bar = tqdm(
            total=config.total_steps, desc=config.experiment, unit="step", dynamic_ncols=True, file=sys.stderr
        )

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = {}
        for key, label in (("critic/score/mean", "score"), ("timing_s/step", "s/step")):
            if key in metrics:
                shown[label] = f"{metrics[key]:.3f}"
        val = [k for k in metrics if k.startswith("val-core/") and "/mean@" in k]
        if val:
            shown["val"] = f"{metrics[val[0]]:.3f}"
        if "training/global_step" in metrics:  # a training step (not a validation-only record)
            self.bar.n = int(step)
        self.bar.set_postfix(shown, refresh=False)
        self.bar.refresh()
        if val:
            self.bar.write(f"step {step}: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in sorted(val)))

    def log_artifact(self, path: str | Path) -> None:
        pass

    def log_text(self, text: str, name: str) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        self.bar.close()


def _merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` updated with ``new``, nested dicts merged key by key (a later value wins)."""
    out = dict(old)
    for key, value in new.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


class JsonlTracker:
    """One JSON object per ``log`` call: ``{"step": n, "time": t, ...metrics}``. For scripts."""

    name = "jsonl"

    def __init__(self, config: TrackerConfig):
        self.path = Path(config.jsonl_path or config.output_dir / "metrics.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = str(self.path)
        self.params: dict[str, Any] = {}  # every log_params call of this run, merged (as MLflow keeps them)

    def log_params(self, params: dict[str, Any]) -> None:
        self.params = _merged(self.params, params)
        (self.path.parent / "params.json").write_text(json.dumps(self.params, indent=1, default=str))

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def log_artifact(self, path: str | Path) -> None:
        pass

    def log_text(self, text: str, name: str) -> None:
        target = self.path.parent / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")

    def finish(self, status: str = "FINISHED") -> None:
        pass


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-./ ]")


class MlflowTracker:
    """MLflow run in an embedded SQLite store by default (no server, telemetry off).

    Metric names keep veRL's slashes; characters MLflow refuses (``@``, ``:``) become ``_``.
    """

    name = "mlflow"

    def __init__(self, config: TrackerConfig):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        root = Path(config.output_dir).resolve().parent
        root.mkdir(parents=True, exist_ok=True)
        if config.mlflow_uri is None:
            from rlkit.runtime.mlflow_store import prepare_sqlite_store

            # a migrated empty store, copied (MLflow would migrate anew)
            prepare_sqlite_store(root / "mlflow.db")
        self.uri = config.mlflow_uri or f"sqlite:///{root / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(config.project)
        if experiment is None:
            experiment_id = self.client.create_experiment(
                config.project, artifact_location=(root / "mlartifacts").as_uri()
            )
        else:
            experiment_id = experiment.experiment_id
        resume = config.run_ids.get(self.name)
        if resume:
            self.run_id = resume
            self.client.update_run(resume, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=config.experiment).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        items = [Param(_MLFLOW_BAD.sub("_", k)[:250], str(v)[:6000]) for k, v in flatten(params).items()]
        items = [p for p in items if p.key not in existing]  # a resumed run already has them
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(_MLFLOW_BAD.sub("_", k), float(_plain(v)), now, step)
            for k, v in metrics.items()
            if isinstance(_plain(v), (int, float))
        ]
        for start in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class FailedTracker:
    """Stands in for a tracker whose constructor raised (an unreachable or unwritable store): every call
    raises that error again, so ``Tracking`` reports it once and counts it, and training goes on."""

    run_id = ""

    def __init__(self, name: str, error: Exception):
        self.name = name
        self.error = error

    def _fail(self, *args: Any) -> None:
        raise RuntimeError(f"the tracker could not start: {type(self.error).__name__}: {self.error}")

    log_params = log = log_artifact = log_text = finish = _fail


def start_tracker(cls: Any, config: TrackerConfig, params: Any = None) -> Any:
    """``cls(config)`` (``cls(config, params=...)`` for a tracker whose spec declares a params model),
    or a ``FailedTracker`` when that raises."""
    try:
        return cls(config) if params is None else cls(config, params=params)
    except Exception as exc:  # noqa: BLE001 - tracking must never stop training
        return FailedTracker(getattr(cls, "name", cls.__name__), exc)


class Tracking:
    """Fans calls out to every tracker; a failing tracker is reported once, counted, and skipped."""

    def __init__(self, trackers: list[Any]):
        self.trackers = trackers
        self.errors: dict[str, int] = {}

    def _each(self, method: str, *args: Any) -> None:
        for tracker in self.trackers:
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - tracking must never stop training
                name = getattr(tracker, "name", type(tracker).__name__)
                if name not in self.errors:
                    logger.warning(
                        "tracker '%s' failed in %s(): %s: %s; training goes on, later errors are "
                        "counted in tracking/errors",
                        name,
                        method,
                        type(exc).__name__,
                        exc,
                    )
                self.errors[name] = self.errors.get(name, 0) + 1

    def run_ids(self) -> dict[str, str]:
        return {
            getattr(t, "name", type(t).__name__): t.run_id for t in self.trackers if getattr(t, "run_id", "")
        }

    def log_params(self, params: dict[str, Any]) -> None:
        self._each("log_params", params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.errors:
            metrics = {**metrics, "tracking/errors": float(sum(self.errors.values()))}
        self._each("log", metrics, step)

    def log_artifact(self, path: str | Path) -> None:
        self._each("log_artifact", path)

    def log_text(self, text: str, name: str) -> None:
        self._each("log_text", text, name)

    def finish(self, status: str = "FINISHED") -> None:
        self._each("finish", status)
