"""An environment's rows (``data.environment``): built from its resolved component, checked, written to
parquet.

The run writes them once, on the driver, to ``<output_dir>/environment/{train,val}.parquet`` and reads
them back with ``RLDataset`` like any data file, so every row-level feature (prompt-length policy,
shuffling, resume, validation) works unchanged. Rows use veRL's schema with ``data_source`` set to the
environment's name; a multi-turn environment's rows also name the ``environment`` agent loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.data._io import write_rows
from rlkit.errors import RlkitError
from rlkit.plugin.registry import load_object

__all__ = [
    "EnvironmentError_",
    "build_environment",
    "environment_rows",
    "write_environment_rows",
    "ENVIRONMENT_AGENT",
]

ENVIRONMENT_AGENT = "environment"  # the agent loop multi-turn environments run in (registry `agent_loops`)


class EnvironmentError_(RlkitError):  # noqa: N801 - the builtin name EnvironmentError is taken
    """An environment could not be built, or gave rows that are not usable."""


def build_environment(resolved: Any) -> Any:
    """``cls(params=...)`` (``params`` only with a params model on the spec) for a resolved environment."""
    spec = resolved.spec
    cls = load_object(spec.cls)
    try:
        return cls(params=resolved.params) if spec.params is not None else cls()
    except RlkitError:
        raise
    except Exception as exc:
        raise EnvironmentError_(
            f"environment '{resolved.name}' (from {resolved.source}) failed to start: "
            f"{type(exc).__name__}: {exc}. Check data.environment's parameters."
        ) from exc


def environment_rows(resolved: Any, split: str, env: Any = None) -> list[dict[str, Any]]:
    """The environment's ``split`` rows, checked: each a mapping with ``prompt`` (a non-empty message list);
    ``data_source`` is set to the environment's name and, for a multi-turn one, ``agent_name`` to the loop."""
    env = env if env is not None else build_environment(resolved)
    rows = list(env.rows(split))
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), list) or not row["prompt"]:
            raise EnvironmentError_(
                f"environment '{resolved.name}': {split} row {i} is not a dict with a non-empty "
                "'prompt' list of {role, content} messages; fix its rows() method."
            )
        extra = {**dict(row.get("extra_info") or {}), "environment": resolved.name}
        if resolved.spec.multi_turn:
            extra["agent_name"] = ENVIRONMENT_AGENT
        out.append(
            {
                **row,
                "data_source": resolved.name,
                "reward_model": dict(row.get("reward_model") or {"style": "rule", "ground_truth": ""}),
                "extra_info": extra,
            }
        )
    return out


def write_environment_rows(resolved: Any, folder: Path) -> tuple[list[str], list[str]]:
    """Write the train (and, when there are any, val) rows under ``folder``; the files' paths."""
    env = build_environment(resolved)
    folder.mkdir(parents=True, exist_ok=True)
    train = environment_rows(resolved, "train", env)
    if not train:
        raise EnvironmentError_(
            f"environment '{resolved.name}' gave no train rows; check its size parameter."
        )
    write_rows(train, folder / "train.parquet")
    val = environment_rows(resolved, "val", env)
    if val:
        write_rows(val, folder / "val.parquet")
    return [str(folder / "train.parquet")], [str(folder / "val.parquet")] if val else []
