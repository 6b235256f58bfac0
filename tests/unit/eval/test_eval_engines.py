"""Which engine ``rlkit eval`` generates with (``rlkit.eval.engines``), and ``env.KEY=VALUE`` as the
``data.environment`` override (``rlkit.eval.environment``): pure functions of the recipe's sections."""

from __future__ import annotations

from types import SimpleNamespace

from rlkit.eval.engines import engine_description, eval_pool, uses_ray
from rlkit.eval.environment import environment_overrides, environment_section
from rlkit.recipe.schema import PoolConfig, ResourcesConfig


def _recipe(**resources) -> SimpleNamespace:
    return SimpleNamespace(resources=ResourcesConfig(**resources))


def test_one_rank_generates_in_process_and_a_pool_of_several_on_ray():
    assert not uses_ray(_recipe()) and engine_description(_recipe()) == "in-process, 1 rank"
    two = _recipe(pools={"global": PoolConfig(bundles_per_node=2)})
    assert uses_ray(two) and engine_description(two) == "Ray pool 'global', 2 ranks"
    nodes = _recipe(pools={"global": PoolConfig(nodes=2, bundles_per_node=3)})
    assert eval_pool(nodes) == ("global", 6)
    joined = _recipe(ray_address="auto")  # a named cluster: Ray even for one rank
    assert uses_ray(joined) and engine_description(joined) == "Ray pool 'global', 1 rank"


def test_the_rollout_roles_pool_is_used_when_resources_map_it():
    pools = {"train": PoolConfig(), "generate": PoolConfig(bundles_per_node=4)}
    mapped = _recipe(pools=pools, roles={"actor_rollout_ref": "train", "rollout": "generate"})
    assert eval_pool(mapped) == ("generate", 4)
    actor_only = _recipe(pools=pools, roles={"actor_rollout_ref": "generate"})
    assert eval_pool(actor_only) == ("generate", 4)
    assert eval_pool(_recipe(pools=pools)) == ("train", 1)  # unmapped: the first pool


def test_env_overrides_are_data_environment_overrides():
    given = ["env.task=leg_counting", "env.config.min_terms=2", "~env.seed", "trainer.seed=3"]
    assert environment_overrides(given) == [
        "data.environment.task=leg_counting",
        "data.environment.config.min_terms=2",
        "~data.environment.seed",
        "trainer.seed=3",
    ]
    recipe_data = {"environment": {"name": "textarena", "size": 256}}
    assert environment_section("textarena", recipe_data) == {"name": "textarena", "size": 256}
    assert environment_section("reasoning_gym", recipe_data) == {"name": "reasoning_gym"}
