"""Placement that cannot be satisfied fails fast and says why, on the real session Ray cluster (one node,
8 logical CPUs): too big for the cluster (at once, before any placement group exists), held by someone
else (after a bounded wait), and shares of one bundle that do not fit (at once via the pool's ledger, or
after a bounded wait when something outside the ledger holds the bundle)."""

from __future__ import annotations

import sys
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlkit.errors import WorkerError
from rlkit.recipe.schema import PoolConfig, ResourcesConfig
from rlkit.workers import ResourcePool, ResourcePoolManager, Worker, WorkerGroup
from rlkit.workers.pools import check_placement

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module


class IdleWorker(Worker):
    """A rank that only joins the process group (optionally after sleeping, like a slow model load)."""

    def __init__(
        self, rank, world_size, master_addr, master_port, device, threads=1, *, sleep_s: float = 0.0
    ):
        time.sleep(sleep_s)
        super().__init__(rank, world_size, master_addr, master_port, device, threads)


def _live_actors(class_name: str, settle_s: float = 10.0) -> list[str]:
    """States of the actors of ``class_name`` that are not dead (after up to ``settle_s`` for kills to
    land)."""
    from ray._private import state  # the GCS actor table (no dashboard in the test cluster)

    end = time.monotonic() + settle_s
    while True:
        live = [
            a["State"]
            for a in state.actors().values()
            if a["ActorClassName"] == class_name and a["State"] != "DEAD"
        ]
        if not live or time.monotonic() > end:
            return live
        time.sleep(0.2)


def _pending_groups() -> int:
    return sum(t["state"] == "PENDING" for t in ray.util.placement_group_table().values())


@pytest.mark.timeout(120)  # with the session cluster's start; the check itself does not wait
def test_pool_larger_than_the_cluster_fails_at_once(ray_cluster):
    res = ResourcesConfig(
        device="cpu",
        pools={"train": PoolConfig(bundles_per_node=2, cpus_per_bundle=64)},
        roles={"critic": "train"},
    )
    manager = ResourcePoolManager(res)
    before = _pending_groups()
    with pytest.raises(WorkerError) as info:
        manager.check({"train": ["actor_rollout_ref", "critic"]})
    msg = str(info.value)
    # 2 bundles x 64 CPUs = 128 CPUs on one node; the session cluster's one node has 8.
    for part in (
        "'train'",
        "'actor_rollout_ref'",
        "'critic'",
        "{CPU: 128} per node",
        "{CPU: 8}",
        "resources.pools.train.bundles_per_node",
    ):
        assert part in msg, (part, msg)
    with pytest.raises(WorkerError, match="can never be placed"):
        manager.pool_for("critic")  # the lazy path checks too, before reserving anything
    assert manager.pools["train"].placement_groups == [] and _pending_groups() == before


@pytest.mark.timeout(120)  # with the session cluster's start; the check itself does not wait
def test_pools_that_fit_alone_but_not_together_fail_at_once(ray_cluster):
    res = ResourcesConfig(
        device="cpu",
        pools={
            "a": PoolConfig(bundles_per_node=3, cpus_per_bundle=2),
            "b": PoolConfig(bundles_per_node=2, cpus_per_bundle=2),
        },
    )
    manager = ResourcePoolManager(res)
    with pytest.raises(WorkerError) as info:  # 6 + 4 = 10 CPUs > 8
        manager.create_all({"a": ["actor_rollout_ref"], "b": ["critic", "reward_model"]})
    msg = str(info.value)
    for part in (
        "together ask for {CPU: 10}",
        "{CPU: 8} in all",
        "'a' (roles 'actor_rollout_ref') {CPU: 6}",
        "'b' (roles 'critic', 'reward_model') {CPU: 4}",
        "resources.roles.<role>=<pool>",
    ):
        assert part in msg, (part, msg)
    assert all(p.placement_groups == [] for p in manager.pools.values())
    with pytest.raises(WorkerError, match="names pools \\['c'\\]"):
        manager.check({"c": ["critic"]})


@pytest.mark.timeout(120)  # with the session cluster's start; the check itself does not wait
def test_resources_held_elsewhere_fail_after_a_bounded_wait(ray_cluster):
    blocker = placement_group([{"CPU": 7.5}])  # passes the check (8 CPUs in all), leaves 0.5 free
    ray.get(blocker.ready(), timeout=20)
    try:
        pool = ResourcePool("judge", PoolConfig(cpus_per_bundle=1), "cpu")
        with pytest.raises(WorkerError) as info:
            pool.create(timeout_s=2, roles=["reward_model"])
        msg = str(info.value)
        assert "'judge' (roles 'reward_model')" in msg and "placed 0 of 1 node group(s)" in msg, msg
        assert "Something else holds the resources" in msg and "{CPU: 0.5}" in msg, msg
        assert pool.placement_groups == []  # the unplaced group was removed, not left pending
    finally:
        remove_placement_group(blocker)


@pytest.mark.timeout(180)  # a hang (the old behaviour) fails here
def test_shares_that_do_not_fit_on_one_pool_error_instead_of_hanging(ray_cluster):
    manager = ResourcePoolManager(
        ResourcesConfig(device="cpu", pools={"global": PoolConfig(cpus_per_bundle=1)})
    )
    pool = manager.pool_for("actor_rollout_ref")
    try:
        actor = WorkerGroup(IdleWorker, pool, role="actor_rollout_ref", share=1.0)
        try:
            with pytest.raises(WorkerError) as info:
                WorkerGroup(IdleWorker, pool, role="critic", share=0.5)
            msg = str(info.value)
            assert (
                "role 'critic' asks for share 0.5" in msg and "'actor_rollout_ref' 1 already hold 1" in msg
            ), msg
            assert "resources.roles.critic=<name>" in msg, msg
        finally:
            actor.shutdown()
        assert pool.claims == {}  # shutdown gave the share back
    finally:
        manager.remove_all()


@pytest.mark.timeout(180)  # a hang (the old behaviour) fails here
def test_a_share_held_outside_the_ledger_fails_within_the_schedule_bound(ray_cluster):
    pool = ResourcePool("global", PoolConfig(cpus_per_bundle=1), "cpu").create(roles=["critic"])
    try:
        pg, index = pool.location(0)
        squatter = ray.remote(num_cpus=1)(type("Squatter", (), {"ping": lambda self: 1}))
        holder = squatter.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        ).remote()
        ray.get(holder.ping.remote(), timeout=30)  # the whole bundle is taken, by no worker group
        try:
            with pytest.raises(WorkerError) as info:
                WorkerGroup(IdleWorker, pool, role="critic", share=0.5, schedule_timeout_s=3)
            msg = str(info.value)
            assert "role 'critic': rank(s) [0] could not be scheduled for 3 s" in msg, msg
            assert "resource pool 'global'" in msg and "resources.roles.critic=<name>" in msg, msg
            assert _live_actors("IdleWorker") == []  # the pending rank was killed, not left waiting
            assert pool.claims == {}
        finally:
            ray.kill(holder)
        # A rank that is scheduled but slow to construct (a model load) is not cut by that bound.
        slow = WorkerGroup(
            IdleWorker, pool, role="critic", share=0.5, schedule_timeout_s=1, role_kwargs={"sleep_s": 4.0}
        )
        slow.shutdown()
    finally:
        pool.remove()


def test_check_placement_accepts_what_fits(ray_cluster):
    pools = [
        ResourcePool("a", PoolConfig(bundles_per_node=2, cpus_per_bundle=2), "cpu"),
        ResourcePool("b", PoolConfig(bundles_per_node=4, cpus_per_bundle=1), "cpu"),
    ]
    check_placement(pools, {"a": ["actor_rollout_ref"], "b": ["critic"]})  # 4 + 4 = 8 CPUs: exactly fits


def test_local_node_describes_the_cluster_before_it_starts(ray_cluster):
    from rlkit.workers.cluster import local_node

    # The session cluster is RayCluster(ResourcesConfig(object_store_memory_mb=256), num_cpus=8).
    node = local_node(ResourcesConfig(object_store_memory_mb=256), num_cpus=8)
    assert node == {"CPU": ray.cluster_resources()["CPU"], "GPU": ray.cluster_resources().get("GPU", 0.0)}


def test_a_local_recipe_is_checked_without_ray():
    from rlkit.workers.cluster import local_node

    spread = ResourcesConfig(device="cpu", pools={"global": PoolConfig(nodes=2, bundles_per_node=2)})
    manager = ResourcePoolManager(spread)
    with pytest.raises(WorkerError) as info:  # a local cluster is one node
        manager.check({"global": ["actor_rollout_ref"]}, nodes={"local": local_node(spread, num_cpus=2)})
    assert "set resources.pools.global.nodes=1 and bundles_per_node=4" in str(info.value)
    assert "'actor_rollout_ref'" in str(info.value) and "local {CPU: 4, GPU: 0}" in str(info.value)
    gpu = ResourcePool("gpu", PoolConfig(gpus_per_bundle=1), "cuda")
    with pytest.raises(
        WorkerError, match="lower resources.pools.gpu.bundles_per_node, cpus_per_bundle or gpus"
    ):
        check_placement([gpu], {"gpu": ["critic"]}, nodes={"local": {"CPU": 4.0, "GPU": 0.0}})
    check_placement([gpu], {"gpu": ["critic"]}, nodes={"local": {"CPU": 4.0, "GPU": 1.0}})  # fits
    assert not manager.checked  # a described cluster does not stand in for the live check
