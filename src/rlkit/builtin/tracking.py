"""Registers rlkit's built-in trackers through the public hooks."""

from __future__ import annotations

from rlkit.hookspecs import hookimpl
from rlkit.specs import TrackerSpec


@hookimpl
def rlkit_register_trackers() -> list[TrackerSpec]:
    return [
        TrackerSpec(name="console", cls="rlkit.tracking:ConsoleTracker", description="progress bar with step, score, speed and ETA"),
        TrackerSpec(name="mlflow", cls="rlkit.tracking:MlflowTracker", description="MLflow run; embedded SQLite store by default"),
        TrackerSpec(name="jsonl", cls="rlkit.tracking:JsonlTracker", description="one JSON object per step, for scripts"),
    ]
