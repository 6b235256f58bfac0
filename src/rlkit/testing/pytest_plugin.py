"""Pytest fixtures for testing an rlkit plugin with ``rlkit.testing``.

Use it from your ``conftest.py``, either as a plugin (a top-level conftest only; pytest's rule)::

    pytest_plugins = ["rlkit.testing.pytest_plugin"]

or by importing the fixtures you need (works in any conftest)::

    from rlkit.testing.pytest_plugin import rlkit_registries, rlkit_tiny_model  # noqa: F401

- ``rlkit_registries``: fresh registries with every installed plugin (yours included), built once
  per test module; nothing global is touched.
- ``rlkit_tiny_model_dir``: a tiny random Qwen2 causal LM and its tokenizer, written once per session
  (``rlkit.model.tiny.build_tiny_model``; nothing is downloaded).
- ``rlkit_tokenizer``, ``rlkit_tiny_model``: that tokenizer, and ``(model, tokenizer)`` loaded in
  float32 on the CPU.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["rlkit_registries", "rlkit_tiny_model_dir", "rlkit_tokenizer", "rlkit_tiny_model"]


@pytest.fixture(scope="module")
def rlkit_registries():
    """``build_registries(make_plugin_manager())``: built-ins plus every installed plugin."""
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries

    return build_registries(make_plugin_manager())


@pytest.fixture(scope="session")
def rlkit_tiny_model_dir(tmp_path_factory):
    """A folder with a tiny Qwen2 causal LM (hidden 64, 2 layers) and its local BPE tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("rlkit_tiny_model"), arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def rlkit_tokenizer(rlkit_tiny_model_dir):
    from rlkit.model.load import load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    return load_tokenizer(ModelConfig(path=str(rlkit_tiny_model_dir)))


@pytest.fixture(scope="session")
def rlkit_tiny_model(rlkit_tiny_model_dir, rlkit_tokenizer):
    """``(model, tokenizer)``: the tiny causal LM in float32 on the CPU, in eval mode."""
    from rlkit.model.load import load_model
    from rlkit.recipe.schema import ModelConfig

    model = load_model(ModelConfig(path=str(rlkit_tiny_model_dir)), tokenizer=rlkit_tokenizer)
    return model.eval(), rlkit_tokenizer
