"""Model building and loading: tiny test models, offline loading from a ``ModelConfig``."""

from rlkit.model.load import load_model, load_tokenizer, resolve_model_path
from rlkit.model.tiny import build_tiny_model, build_tiny_tokenizer

__all__ = ["build_tiny_model", "build_tiny_tokenizer", "load_model", "load_tokenizer", "resolve_model_path"]
