"""The checks of a recipe against this machine and its files, after the schema and the rules (``rlkit
validate`` and the start of ``rlkit run``; ``--no-check-files`` skips them): data and score files exist, every
data_source has a scorer, the output folder can be written, a reward model folder (or a cached Hub id) is a
model, CUDA is there when asked for. Each check returns ``(recipe key, message)`` problems.
"""

from __future__ import annotations

from pathlib import Path

from rlkit.plugin.registry import Registries
from rlkit.recipe.schema import Recipe

__all__ = ["check_machine"]


def check_machine(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """Every problem of ``recipe`` on this machine (files, data sources, output folder, devices)."""
    return _check_files(recipe) + _check_data_sources(recipe, registries) + _check_output_dir(recipe)


def _check_files(recipe: Recipe) -> list[tuple[str, str]]:
    """What must exist on this machine: data files, score files, the reward model, CUDA when asked for."""
    from rlkit.hardware import cuda_missing

    problems = []
    if reason := cuda_missing(recipe.resources.device):
        problems.append(("resources.device", f"{reason} (`--no-check-files` skips checks of this machine)"))
    for key in ("train_files", "val_files"):
        for i, name in enumerate(getattr(recipe.data, key)):
            if not Path(name).expanduser().is_file():
                problems.append(
                    (
                        f"data.{key}.{i}",
                        f"file not found: {name} (relative paths are relative to {Path.cwd()}); `rlkit "
                        "data --help` writes data sets",
                    )
                )
    custom = recipe.reward.custom_score
    if custom is not None and not Path(custom.path).expanduser().is_file():
        problems.append(("reward.custom_score.path", f"file not found: {custom.path}"))
    rm = recipe.reward.reward_model
    if rm.enable and rm.path:
        problems += _check_reward_model_folder(rm.path)
    return problems


def _check_data_sources(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """Every data_source of the train and val files has a compute_score (registered, or
    reward.custom_score); with a reward model in ``fallback`` mode the model scores the others. One problem
    lists all missing ones."""
    from rlkit.rewards.dispatch import score_functions

    reward = recipe.reward
    rm = reward.reward_model
    if reward.custom_score is not None or (rm.enable and rm.combine == "fallback"):
        return []
    known = score_functions(registries)
    missing: dict[str, list[str]] = {}  # data_source -> files holding it
    for key in ("train_files", "val_files"):
        for name in getattr(recipe.data, key):
            for source in sorted(_data_sources(Path(name).expanduser()) - set(known)):
                missing.setdefault(source, []).append(name)
    if not missing:
        return []
    listed = "; ".join(f"'{source}' (in {', '.join(files)})" for source, files in sorted(missing.items()))
    return [
        (
            "data",
            f"no compute_score for data_source {listed}. Registered data sources: "
            f"{', '.join(sorted(known)) or '(none)'}. Every sample of such a source would score "
            "reward.default_score: fix the data_source column, register a compute_score "
            "(entry-point group 'rlkit.compute_score'), or set reward.custom_score: "
            "{path: my_score.py, name: compute_score}.",
        )
    ]


def _data_sources(path: Path) -> set[str]:
    """The distinct ``data_source`` values of a parquet file; empty when unreadable (the data loader says
    why)."""
    import pyarrow.parquet as pq

    if not path.is_file():
        return set()
    try:
        column = pq.read_table(path, columns=["data_source"]).column("data_source")
    except Exception:  # noqa: BLE001 - not parquet, or no such column: RLDataset reports it with file and row
        return set()
    # empty: RLDataset names the row
    return {str(v) for v in column.unique().to_pylist() if v not in (None, "")}


def _check_output_dir(recipe: Recipe) -> list[tuple[str, str]]:
    """``trainer.output_dir`` (and ``tracking.jsonl_path``'s folder) can be created and written by this
    user."""
    import os

    t = recipe.trainer
    try:  # as rlkit.runtime.build.output_dir_of (not imported: it pulls in torch)
        out = Path(t.output_dir.format(project_name=t.project_name, experiment_name=t.experiment_name))
    except (KeyError, IndexError, ValueError) as exc:
        return [
            (
                "trainer.output_dir",
                f"{t.output_dir!r}: bad placeholder ({exc}); only "
                "{project_name} and {experiment_name} are filled in",
            )
        ]
    out = out.expanduser()
    problems = []
    targets = [("trainer.output_dir", out)]
    if recipe.tracking.jsonl_path:
        targets.append(("tracking.jsonl_path", Path(recipe.tracking.jsonl_path).expanduser().parent))
    for key, folder in targets:
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            problems.append(
                (key, f"cannot create {folder}: {existing} is a file, not a folder. Choose another path.")
            )
        elif not os.access(existing, os.W_OK | os.X_OK):
            problems.append(
                (
                    key,
                    f"cannot write {folder}: no write permission on {existing} for this user. "
                    "Choose a folder you can write, or fix its permissions.",
                )
            )
    return problems


def _check_reward_model_folder(path: str) -> list[tuple[str, str]]:
    """The reward model must be a local folder with a sequence-classification config (one label)."""
    import json

    from rlkit.recipe.hub import is_hub_id

    key = "reward.reward_model.path"
    config = Path(path).expanduser() / "config.json"
    if not config.is_file() and is_hub_id(path):  # a Hub id: checked when cached, downloaded at `rlkit run`
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        if not isinstance(cached, str):
            return []
        config = Path(cached)
    if not config.is_file():
        return [
            (
                key,
                f"no model folder at {path} (config.json not found); point it at a saved "
                "AutoModelForSequenceClassification folder or a Hugging Face Hub id",
            )
        ]
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return [(key, f"{config} is not readable JSON: {exc}")]
    archs = data.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        return [
            (
                key,
                f"{path} holds a {archs[0]}; a reward model must be a *ForSequenceClassification model "
                "(save one with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1))",
            )
        ]
    labels = len(data.get("id2label") or {}) or data.get("num_labels", 1)
    if labels != 1:
        return [(key, f"{path} has {labels} labels; a reward model gives one score (num_labels=1)")]
    return []
