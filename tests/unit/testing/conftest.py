"""The tiny causal LM and its tokenizer, loaded once for the conformance-kit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """``(model, tokenizer)``: the session's tiny Qwen2 in float32, eval mode, one torch thread."""
    import torch

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    torch.set_num_threads(1)
    config = ModelConfig(path=str(tiny_model_dir))
    tokenizer = load_tokenizer(config)
    return load_model(config, tokenizer=tokenizer).eval(), tokenizer
