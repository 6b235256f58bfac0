"""Every recipe in recipes/ validates against the live registries (GPU recipes need rlkit-sglang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkit.plugin.registry import build_registries
from rlkit.recipe import load_recipe, uses_critic, uses_ref
from rlkit.recipe.compose import compose

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def registries():
    return build_registries()


def test_the_product_recipes_are_all_here():
    assert {p.stem for p in RECIPES} >= {"quickstart", "ppo", "grpo", "dapo", "grpo_tool_agent"}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates(path, registries):
    # data files of GPU recipes are made by `rlkit data ...` on the user's machine
    recipe = load_recipe(path, registries=registries, check_files=False)
    assert recipe.algorithm.estimator.name in registries.estimators
    pipeline = compose(recipe, registries)  # what validates is what runs: every component resolves
    assert pipeline.estimator.name == recipe.algorithm.estimator.name
    assert pipeline.estimator.kwargs == recipe.algorithm.estimator.params
    assert pipeline.policy_loss.kwargs == recipe.actor.policy_loss.params


def test_what_each_recipe_implies(registries):
    by_name = {p.stem: load_recipe(p, registries=registries, check_files=False) for p in RECIPES}
    assert uses_critic(by_name["ppo"], registries) and not uses_critic(by_name["grpo"], registries)
    assert uses_ref(by_name["grpo"]) and uses_ref(by_name["ppo"]) and not uses_ref(by_name["dapo"])
    dapo = by_name["dapo"]
    assert dapo.actor.policy_loss.params["clip_ratio_high"] == 0.28 and dapo.algorithm.filter_groups.enable
    # shaping is a reward step
    assert dapo.reward.manager.name == "naive" and dapo.reward.overlong_buffer.enable
    assert by_name["ppo"].algorithm.estimator.params == {"gamma": 1.0, "lam": 1.0}
    assert (
        by_name["quickstart"].resources.device == "auto"
        and by_name["quickstart"].rollout.backend.name == "hf"
    )
    lora = by_name["quickstart_lora"]  # LoRA's KL reference is the actor with the adapter off (docs/lora.md)
    assert lora.actor.lora.rank == 16 and uses_ref(lora) and lora.rollout.backend.name == "hf"
    agent = by_name["grpo_tool_agent"]
    assert agent.rollout.agent.name == "tool" and [t.name for t in agent.rollout.tools] == ["calculator"]
    assert agent.actor.use_kl_loss
    for name in ("ppo", "grpo", "dapo", "grpo_tool_agent"):
        assert by_name[name].rollout.backend.name == "sglang" and by_name[name].resources.device == "cuda"
    assert by_name["dapo"].rollout.backend.params["launch"]["tp_size"] == 4
