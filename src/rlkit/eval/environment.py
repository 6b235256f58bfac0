"""``rlkit eval MODEL --env NAME [env.KEY=VALUE ...]``: a registered environment's rows as the eval's data.

The parameters go through the one parameter door, ``data.environment`` of a recipe: ``--env NAME`` sets
``data.environment.name`` and every ``env.KEY=VALUE`` becomes the override ``data.environment.KEY=VALUE``,
so recipe validation checks them against the environment's params model (and names the plugin to install
for a known but missing name) before anything is built. The rows are the environment's validation rows
when it gives any, else its training rows (``size`` / ``seed``); they are written once, as a run writes
them, to ``<out>/environment/`` and read back like any data file. Scoring is the environment's own (the
reward step maps its name to ``EnvironmentScore``); a multi-turn environment's rows name the ``environment``
agent loop, which the eval's generation runs as training does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.eval.model import EvalError

__all__ = ["ENV_PREFIX", "environment_overrides", "environment_section", "environment_files"]

ENV_PREFIX = "env."  # rlkit eval's short form of data.environment.


def environment_overrides(overrides: list[str]) -> list[str]:
    """``env.KEY=VALUE`` → ``data.environment.KEY=VALUE`` (``~env.KEY`` too); other overrides as they are."""
    out = []
    for text in overrides:
        bare = text[1:] if text.startswith("~") else text
        if bare.startswith(ENV_PREFIX):
            text = ("~" if text.startswith("~") else "") + "data.environment." + bare[len(ENV_PREFIX) :]
        out.append(text)
    return out


def environment_section(name: str, recipe_data: dict[str, Any]) -> dict[str, Any]:
    """``data.environment`` for ``--env NAME``: the recipe's own parameters when it names the same
    environment, else the name alone (the environment's defaults)."""
    given = recipe_data.get("environment")
    if isinstance(given, dict) and given.get("name") == name:
        return dict(given)
    return {"name": name}


def environment_files(pipeline: Any, out: Path) -> tuple[list[str], str]:
    """Write the environment's rows under ``out/environment`` (as ``rlkit run`` does); the file to evaluate
    (its validation rows, else its training rows) and which split that is."""
    from rlkit.data.environment import write_environment_rows

    if pipeline.environment is None:
        raise EvalError("--env: the recipe names no environment (internal: data.environment is unset)")
    train, val = write_environment_rows(pipeline.environment, out / "environment")
    return (val, "val") if val else (train, "train")
