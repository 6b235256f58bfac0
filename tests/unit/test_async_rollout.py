"""trainer.mode one_step_off / async: the staleness queue, the generation pipeline's ordering, and the
validation rules (fast; the run itself is the grpo_async entry of tests/e2e/test_smoke_matrix.py and
tests/e2e/test_async.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkit.errors import RecipeError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.recipe import load_recipe
from rlkit.step.ahead import Generation, RolloutPipeline, StalenessQueue, pipeline_depth, staleness_bound


def gen(version: int, serial: int = 0) -> Generation:
    return Generation(request=f"r{serial}", result=f"b{serial}", version=version, serial=serial)


def test_bound_and_depth_per_mode():
    assert (
        staleness_bound("sync", None),
        staleness_bound("one_step_off", None),
        staleness_bound("async", None),
    ) == (0, 1, 2)
    assert staleness_bound("async", 3) == 3 and pipeline_depth("async", 3) == 3
    assert pipeline_depth("one_step_off", None) == 1 and pipeline_depth("async", None) == 2


def test_queue_takes_in_order_and_drops_what_is_too_stale():
    q = StalenessQueue(max_staleness=2)
    for serial, version in enumerate([0, 0, 1, 3]):
        q.put(gen(version, serial))
    # actor at version 3: versions 0 and 0 are 3 behind (> 2) and dropped; version 1 is 2 behind: taken
    item, dropped = q.take(actor_version=3)
    assert item.serial == 2 and [d.serial for d in dropped] == [0, 1] and q.dropped == 2
    item, dropped = q.take(actor_version=3)
    assert item.serial == 3 and dropped == [] and len(q) == 0
    assert q.take(actor_version=3) == (None, [])


def test_queue_drops_everything_stale_and_reports_none():
    q = StalenessQueue(max_staleness=1)
    q.put(gen(0, 0))
    q.put(gen(1, 1))
    item, dropped = q.take(actor_version=5)
    assert item is None and len(dropped) == 2 and q.dropped == 2


def test_queue_refuses_versions_going_back_and_a_zero_bound():
    q = StalenessQueue(max_staleness=1)
    q.put(gen(2))
    with pytest.raises(ValueError, match="versions only grow"):
        q.put(gen(1))
    with pytest.raises(ValueError, match=">= 1"):
        StalenessQueue(0)


class Recorder:
    """Stands in for a worker group: records the calls submitted to it, in order (ordering logic only; the
    real groups run in tests/e2e)."""

    def __init__(self, log: list):
        self.log = log

    def submit(self, method, batch=None, **kwargs):
        self.log.append((method, kwargs.get("version")))
        return Answer(f"{method}-{len(self.log)}", refs=["ref0"])


class Answer:
    def __init__(self, value, refs):
        self.value, self.refs = value, refs

    def get(self):
        return self.value


def make_request(serial: int):
    return f"prompts{serial}", f"inputs{serial}"


@pytest.mark.parametrize("depth", [1, 2])
def test_pipeline_keeps_depth_ahead_and_each_batch_runs_depth_versions_behind(depth, monkeypatch):
    monkeypatch.setattr(RolloutPipeline, "check_pushes", lambda self, wait=False: None)
    calls: list = []
    pipe = RolloutPipeline(Recorder(calls), Recorder(calls), depth=depth, max_staleness=depth)
    pipe.push_weights(0)
    staleness = []
    steps = 5
    for step in range(1, steps + 1):
        item, dropped = pipe.take(step - 1, make_request, ahead=steps - step)
        assert dropped == 0 and item.request == f"prompts{step - 1}"  # the data order is kept
        staleness.append(step - 1 - item.version)
        pipe.push_weights(step)
    # batch k is generated on the weights of update k - 1 - depth (never before version 0)
    assert staleness == [min(step - 1, depth) for step in range(1, steps + 1)]
    gens = [c for c in calls if c[0] == "generate_sequences"]
    assert len(gens) == steps  # nothing generated for steps the run will not make
    # every weight push comes after the generations submitted before it (Ray runs them in this order)
    rollout_calls = [c for c in calls if c[0] in ("generate_sequences", "update_weights")]
    assert rollout_calls[: depth + 2] == [("update_weights", 0)] + [("generate_sequences", None)] * (
        depth + 1
    )


def test_pipeline_regenerates_after_dropping_a_stale_queue(monkeypatch):
    """A checkpoint's queue resumed with a smaller bound: its batches are dropped and new ones generated."""
    monkeypatch.setattr(RolloutPipeline, "check_pushes", lambda self, wait=False: None)
    calls: list = []
    pipe = RolloutPipeline(Recorder(calls), Recorder(calls), depth=1, max_staleness=1)
    pipe.load_state_dict(
        {"items": [("old0", "b0", 0, 7), ("old1", "b1", 0, 8)], "version": 0, "serial": 9, "dropped": 0}
    )
    pipe.version = 2
    item, dropped = pipe.take(actor_version=2, make_request=make_request, ahead=1)
    assert dropped == 2 and item.request == "prompts9" and item.version == 2 and pipe.queue.dropped == 2


# ----- validation ------------------------------------------------------------------------------------
GOOD = """\
model: {path: some/model}
data: {train_files: [TRAIN], train_batch_size: 4}
rollout: {n: 4}
resources:
  pools: {train: {}, gen: {}}
  roles: {actor_rollout_ref: train, rollout: gen}
trainer: {mode: async}
"""


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


@pytest.fixture
def recipe(tmp_path: Path):
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    path = tmp_path / "r.yaml"
    path.write_text(GOOD.replace("TRAIN", str(train)))
    return path


def test_async_recipe_plans_a_rollout_pool(recipe, registries):
    from rlkit.recipe.compose import compose

    r = load_recipe(recipe, registries=registries)
    roles = compose(r, registries).roles
    assert (roles["rollout"].pool, roles["actor_rollout_ref"].pool) == ("gen", "train")
    assert (
        load_recipe(recipe, ["trainer.mode=one_step_off"], registries=registries).trainer.mode
        == "one_step_off"
    )


BAD = [
    (["resources.roles={actor_rollout_ref: train}"], "resources.roles.rollout", "rollout pool of its own"),
    (
        ["resources.roles={actor_rollout_ref: train, rollout: train}"],
        "resources.roles.rollout",
        "shares pool 'train'",
    ),
    (["trainer.mode=sync"], "resources.roles.rollout", "trainer.mode is sync"),
    (
        ["trainer.mode=sync", "~resources.roles.rollout", "trainer.max_staleness=2"],
        "trainer.max_staleness",
        "mode=sync",
    ),
    (["trainer.mode=one_step_off", "trainer.max_staleness=2"], "trainer.max_staleness", "exactly 1 version"),
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable", "trainer.mode=sync"),
    (["algorithm.estimator=remax"], "algorithm.estimator", "greedy rollout"),
    (["trainer.max_staleness=0"], "trainer.max_staleness", "greater than 0"),
    (["trainer.mode=offpolicy"], "trainer.mode", "'sync', 'one_step_off' or 'async'"),
    (["resources.pools.gen.bundles_per_node=32"], "data.train_batch_size", "32 rollout ranks"),
]


@pytest.mark.parametrize("overrides,loc,fragment", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_impossible_async_settings_name_their_keys(recipe, registries, overrides, loc, fragment):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, overrides, registries=registries)
    matching = [msg for where, msg in err.value.problems if where == loc]
    assert any(fragment in msg for msg in matching), err.value.problems


def test_lora_with_a_rollout_pool_is_accepted_on_hf_and_refused_on_an_engine(recipe, registries):
    """actor.lora with trainer.mode=async: the hf rollout pool takes the adapter
    (tests/e2e/test_smoke_matrix.py runs it); an engine's rollout pool (its adapter loading from a push is not
    verified) is refused, naming the fix."""
    assert load_recipe(recipe, ["actor.lora={rank: 4}"], registries=registries).actor.lora.rank == 4
    # the vllm plugin's spec (tests need no vllm itself)
    with_plugins = build_registries(make_plugin_manager())
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, ["actor.lora={rank: 4}", "rollout.backend=vllm"], registries=with_plugins)
    messages = [msg for where, msg in err.value.problems if where == "actor.lora"]
    assert any(
        "trainer.mode=async runs with rollout.backend=hf only" in m and "set rollout.backend=hf" in m
        for m in messages
    ), err.value.problems
