"""The decode tests' model: the tiny Qwen2, its weights perturbed (``_models.perturbed_model``)."""

from __future__ import annotations

import pytest
from _models import perturbed_model


@pytest.fixture(scope="module")
def tok_and_model(tiny_model_dir):
    return perturbed_model(tiny_model_dir, seed=0)
