"""Fixtures of the reliability suite: tiny model + arithmetic data built once, a recipe writer."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlkit_harness import write_recipe


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    from rlkit.data import generate_arithmetic
    from rlkit.model.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("reliability-assets")
    model = build_tiny_model(root / "model")
    generate_arithmetic(root / "data", train_size=32, test_size=4, seed=0)
    return model, root / "data"


@pytest.fixture
def recipe(assets, tmp_path):
    """``recipe(out, name, **kw)`` writes the tiny recipe (see rlkit_harness.RECIPE) and returns its path."""
    model, data = assets

    def make(out: Path, name: str = "recipe.yaml", **kwargs) -> Path:
        return write_recipe(tmp_path / name, model, data, out, **kwargs)

    return make
