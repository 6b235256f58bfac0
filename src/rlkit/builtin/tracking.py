"""Registers rlkit's built-in trackers through the public hooks."""

from __future__ import annotations

from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import TrackerSpec


@hookimpl
def rlkit_register_trackers() -> list[TrackerSpec]:
    return [
        TrackerSpec(
            name="console",
            cls="rlkit.runtime.tracking:ConsoleTracker",
            description="progress bar with step, score, speed and ETA",
        ),
        TrackerSpec(
            name="mlflow",
            cls="rlkit.runtime.tracking:MlflowTracker",
            description="MLflow run; embedded SQLite store by default",
        ),
        TrackerSpec(
            name="jsonl",
            cls="rlkit.runtime.tracking:JsonlTracker",
            description="one JSON object per step, for scripts",
        ),
    ]
