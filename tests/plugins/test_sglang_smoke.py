"""`--smoke --keep-backend`: the GPU recipes' own rollout backend (sglang) is kept, its sizes shrink, the
table says so; without the plugin the recipe is refused, never swapped for hf. The runs themselves, against a
real SGLang server: tests/engines/test_sglang_recipes.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("rlkit_sglang", reason="pip install -e plugins/rlkit-sglang")

from rlkit.cli.smoke import load_smoke_recipe  # noqa: E402
from rlkit.errors import RecipeError  # noqa: E402
from rlkit.plugin.registry import build_registries  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPES = ("ppo", "grpo", "dapo", "grpo_reward_model", "grpo_separate_ref", "grpo_tool_agent")


@pytest.fixture
def cache(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path_factory.getbasetemp() / "rlkit-cache"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_keep_backend_keeps_sglang_and_shrinks_its_launch(name, cache):
    registries = build_registries()
    recipe, table = load_smoke_recipe(
        REPO / "recipes" / f"{name}.yaml", registries=registries, keep_backend=True
    )
    backend = recipe.rollout.backend
    assert backend.name == "sglang" and recipe.resources.device == "cpu"
    # 4-8 replicas, tp 1-4 in the file
    assert backend.launch["num_replicas"] == 1 and backend.launch["tp_size"] == 1
    lines = table.splitlines()
    assert any("rollout.backend.launch.mem_fraction_static" in line and "(default)" in line for line in lines)
    assert lines[-1].split() == ["rollout.backend", "kept:", "sglang", "(--keep-backend)"]
    plain, plain_table = load_smoke_recipe(REPO / "recipes" / f"{name}.yaml", registries=registries)
    assert plain.rollout.backend.name == "hf" and "kept" not in plain_table


def test_keep_backend_without_the_plugin_is_refused_not_swapped(cache):
    from rlkit.plugin.manager import make_plugin_manager

    builtins_only = build_registries(make_plugin_manager(entry_points=False))
    with pytest.raises(RecipeError, match="sglang"):
        load_smoke_recipe(REPO / "recipes" / "dapo.yaml", registries=builtins_only, keep_backend=True)
    # plain --smoke: hf
    recipe, _ = load_smoke_recipe(REPO / "recipes" / "dapo.yaml", registries=builtins_only)
    assert recipe.rollout.backend.name == "hf"


def test_keep_backend_on_the_command_line(cache, capsys):
    from rlkit.cli import main

    dapo = str(REPO / "recipes" / "dapo.yaml")
    assert main(["validate", dapo, "--smoke", "--keep-backend"]) == 0
    out, err = capsys.readouterr()
    assert "rollout=sglang" in out and "kept: sglang (--keep-backend)" in err and "num_replicas" in err
    assert main(["validate", dapo, "--keep-backend"]) == 1
    assert "--keep-backend" in capsys.readouterr().err


def test_a_backend_named_on_the_command_line_gets_no_hf_parameters(cache):
    """``--smoke rollout.backend.name=sglang`` (how tests/engines runs recipes/verifiers.yaml on SGLang): the
    smoke's HF swap carries ``dtype: float32``, an HF parameter; naming another backend must not carry it
    over (sglang has no ``dtype``: validation refused the run). The HF swap itself keeps float32."""
    registries = build_registries()
    verifiers = REPO / "recipes" / "verifiers.yaml"
    named, _ = load_smoke_recipe(
        verifiers,
        ["rollout.backend.name=sglang", "rollout.backend.launch.startup_timeout_s=900"],
        registries=registries,
    )
    assert named.rollout.backend.name == "sglang" and "dtype" not in named.rollout.backend.params
    plain, _ = load_smoke_recipe(verifiers, registries=registries)
    assert plain.rollout.backend.name == "hf" and plain.rollout.backend.params["dtype"] == "float32"
