"""What ``rlkit eval MODEL`` evaluates: a Hugging Face folder or hub id, an rlkit checkpoint, a PEFT adapter.

    source = resolve_model(MODEL, workdir)   # ModelSource: kind, hf folder to load, a display name

- ``hf``: a folder with ``config.json`` (loaded as it is), or a hub id (needs ``HF_HUB_OFFLINE=0``).
- ``checkpoint``: an rlkit checkpoint (``.../checkpoints/global_step_N``: ``hf_config/`` + ``actor/``),
  merged once into ``workdir/merged`` with ``rlkit.runtime.merge`` (a LoRA checkpoint with its adapter
  merged in).
- ``adapter``: a PEFT adapter folder (``adapter_config.json``; its ``base_model_name_or_path`` names the
  base), merged into its base once into ``workdir/merged``.

A path that exists but is none of these, or a local path that does not exist, is an ``EvalError`` before
any model is loaded.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlkit.errors import RlkitError

__all__ = ["EvalError", "ModelSource", "resolve_model", "model_kind", "display_name"]


class EvalError(RlkitError):
    """``rlkit eval`` cannot start or go on: bad model, data or results file."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # hf | checkpoint | adapter
    given: str  # what the user named
    path: str  # the HF folder (or hub id) generation loads
    name: str  # a short display name (default output folder)


def model_kind(model: str) -> str:
    """``hf``, ``checkpoint`` or ``adapter`` for an existing folder; ``hf`` for a hub id. Raises
    ``EvalError``."""
    path = Path(model).expanduser()
    if not path.exists():
        if model.startswith(("/", ".", "~")) or model.count("/") > 1:
            raise EvalError(
                f"model '{model}' does not exist. Give a Hugging Face model folder, a hub id "
                "(org/name), an rlkit checkpoint (.../checkpoints/global_step_N) or a PEFT adapter folder."
            )
        return "hf"
    if (path / "hf_config" / "config.json").is_file() and (path / "actor").is_dir():
        return "checkpoint"
    if (path / "adapter_config.json").is_file():
        return "adapter"
    if (path / "config.json").is_file():
        return "hf"
    raise EvalError(
        f"model folder '{path}' is not a model: it has no config.json (Hugging Face folder), no "
        "adapter_config.json (PEFT adapter) and no hf_config/ + actor/ (rlkit checkpoint). Give the "
        "folder that holds one of these, e.g. outputs/<project>/<run>/checkpoints/global_step_N."
    )


def display_name(model: str, kind: str) -> str:
    path = Path(model).expanduser().resolve() if Path(model).expanduser().exists() else Path(model)
    if kind == "checkpoint":  # outputs/<project>/<run>/checkpoints/global_step_N -> <run>-global_step_N
        return f"{path.parent.parent.name}-{path.name}"
    return path.name


def resolve_model(model: str, workdir: Path) -> ModelSource:
    """``model`` → the HF folder to load; checkpoints and adapters are merged into ``workdir/merged``
    (kept, so a resumed eval does not merge again)."""
    kind = model_kind(model)
    merged = workdir / "merged"
    if kind == "hf":
        return ModelSource(
            kind,
            model,
            str(Path(model).expanduser()) if Path(model).expanduser().exists() else model,
            display_name(model, kind),
        )
    if not (merged / "config.json").is_file():
        if merged.exists():
            shutil.rmtree(merged)
        if kind == "checkpoint":
            _merge_checkpoint(Path(model).expanduser(), merged)
        else:
            _merge_adapter(Path(model).expanduser(), merged)
    return ModelSource(kind, model, str(merged), display_name(model, kind))


def _merge_checkpoint(checkpoint: Path, out: Path) -> None:
    from rlkit.runtime.merge import merge_checkpoint

    lora = (checkpoint / "actor" / "adapter_config.json").is_file()
    merge_checkpoint(checkpoint, out, merge_lora=lora)


def _merge_adapter(adapter: Path, out: Path) -> None:
    """The adapter merged into its base (``adapter_config.json``'s ``base_model_name_or_path``), the
    tokenizer beside it (the adapter folder's own when it has one, else the base's)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise EvalError(
            f"{adapter}/adapter_config.json names no base model (base_model_name_or_path); set it to "
            "the base model's folder or hub id"
        )
    if Path(base).expanduser().exists():
        model_kind(base)  # an existing base folder must be a model
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except OSError as exc:
        raise EvalError(
            f"{adapter}: cannot load its base model {base!r} (adapter_config.json "
            f"base_model_name_or_path): {exc}"
        ) from exc
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    has_tokenizer = any((adapter / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    AutoTokenizer.from_pretrained(str(adapter) if has_tokenizer else base).save_pretrained(tmp)
    tmp.rename(out)
