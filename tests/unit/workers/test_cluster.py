"""The local Ray cluster (loopback only, stops everything it started) and resource pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import ray

from rlkit.errors import WorkerError
from rlkit.recipe.schema import PoolConfig, ResourcesConfig
from rlkit.workers import RayCluster, ResourcePool, ResourcePoolManager, resolve_device

# Runs in a fresh interpreter: its own cluster, so the session cluster is not disturbed.
_PROBE = textwrap.dedent(
    """
    import json, os, psutil, ray
    from rlkit.recipe.schema import PoolConfig, ResourcesConfig
    from rlkit.workers import RayCluster

    # The pools reserve 2 x 2 x 1.5 = 6 logical CPUs, more than this machine's cores.
    res = ResourcesConfig(object_store_memory_mb=128,
                          pools={"a": PoolConfig(bundles_per_node=2, cpus_per_bundle=1.5, nodes=2)})
    me = psutil.Process()
    with RayCluster(res) as cluster:
        cpus = ray.cluster_resources()["CPU"]
        procs = me.children(recursive=True)
        listen = set()
        for p in procs + [me]:
            try:
                listen |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == "LISTEN"}
            except psutil.Error:
                pass
        names = sorted({p.name() for p in procs})
        started = cluster.started
    env_after = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    _, alive = psutil.wait_procs(procs, timeout=15)
    print(json.dumps({"cpus": cpus, "listen": sorted(listen), "names": names, "started": started,
                      "alive": [p.name() for p in alive], "env_after": env_after,
                      "initialized": ray.is_initialized(), "start_s": cluster.start_s}))
    """
)


def test_local_cluster_binds_loopback_and_leaves_no_process_behind():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nlocal cluster start: {out['start_s']:.2f} s")
    assert out["started"] and not out["initialized"]
    assert out["cpus"] == max(os.cpu_count(), 6)  # logical CPUs cover what the pools reserve
    assert {"raylet", "gcs_server"} <= set(out["names"])
    assert out["listen"] and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in out["listen"])
    assert out["alive"] == []  # raylet, gcs_server and Ray's workers are all gone after stop
    assert out["env_after"] is None  # the driver's environment is restored


def test_existing_session_is_reused_and_left_running(ray_cluster):
    with RayCluster(ResourcesConfig()) as cluster:
        assert not cluster.started and not cluster.connected
    assert ray.is_initialized()


def test_resolve_device_never_touches_cuda_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(WorkerError, match="no GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


def test_bundles_and_role_mapping():
    res = ResourcesConfig(
        device="cpu",
        pools={"train": PoolConfig(nodes=2, bundles_per_node=4, cpus_per_bundle=2), "judge": PoolConfig()},
        roles={"reward_model": "judge"},
    )
    manager = ResourcePoolManager(res)
    assert manager.pool_name_for("reward_model") == "judge"
    assert manager.pool_name_for("actor_rollout_ref") == "train"  # unmapped → first pool
    assert manager.colocated(["actor_rollout_ref", "critic", "reward_model"]) == {
        "train": ["actor_rollout_ref", "critic"],
        "judge": ["reward_model"],
    }
    assert manager.cpu_demand() == 17
    train = manager.pools["train"]
    assert train.world_size == 8 and train.bundle() == {"CPU": 2.0}
    gpu = ResourcePool("train", PoolConfig(gpus_per_bundle=1, cpus_per_bundle=4), device="cuda")
    assert gpu.bundle() == {"CPU": 4.0, "GPU": 1.0}
    with pytest.raises(WorkerError, match="not created"):
        train.location(0)
    with pytest.raises(WorkerError, match="pools that do not exist"):
        ResourcePoolManager(ResourcesConfig(device="cpu", roles={"critic": "nope"}))


def test_pool_placement_and_refusal(ray_cluster):
    pool = ResourcePool("two", PoolConfig(nodes=1, bundles_per_node=2, cpus_per_bundle=0.25), "cpu").create()
    try:
        (pg0, i0), (pg1, i1) = pool.location(0), pool.location(1)
        assert (i0, i1) == (0, 1) and pg0 is pg1  # one placement group per node
    finally:
        pool.remove()
    # The session cluster is one node: two node groups cannot land on distinct nodes.
    with pytest.raises(WorkerError, match=r"set resources.pools.spread.nodes=1 and bundles_per_node=2"):
        ResourcePool("spread", PoolConfig(nodes=2, cpus_per_bundle=0.25), "cpu").create()
    huge = ResourcePool("huge", PoolConfig(bundles_per_node=1, cpus_per_bundle=1000), "cpu")
    with pytest.raises(WorkerError, match="can never be placed"):
        huge.create(timeout_s=1)
    assert huge.placement_groups == []


_JOIN = textwrap.dedent(
    """
    import json, sys, ray
    from rlkit.recipe.schema import ResourcesConfig
    from rlkit.workers import RayCluster

    with RayCluster(ResourcesConfig(ray_address=sys.argv[1])) as cluster:
        info = {"started": cluster.started, "connected": cluster.connected,
                "cpus": ray.cluster_resources().get("CPU")}
    info["initialized"] = ray.is_initialized()
    print(json.dumps(info))
    """
)


def test_joining_a_cluster_leaves_it_running(ray_cluster):
    address = ray.get_runtime_context().gcs_address
    # Keep RAY_AUTH_MODE=token (set by the session's ray.init): Ray 2.60 clusters require their token.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", _JOIN, address], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"started": False, "connected": True, "cpus": 8.0, "initialized": False}
    assert ray.cluster_resources()["CPU"] == 8.0  # the joined cluster is still up after the guest left


def test_a_local_clusters_workers_take_a_steps_batch_inside_the_call(ray_cluster):
    """rlkit's local cluster passes arguments and results up to 1 MiB inside the call (Ray reads
    ``RAY_max_direct_call_object_size`` in every process it starts; benchmarks/ray_calls.py measures it):
    the workers inherit the setting, and a 0.5 MB batch makes the round trip intact."""
    import numpy as np
    import torch

    from rlkit.batch import Batch
    from rlkit.workers.cluster import LOCAL_CLUSTER_ENV

    @ray.remote(num_cpus=1)
    def echo(batch):
        return os.environ.get("RAY_max_direct_call_object_size"), batch

    batch = Batch(
        {"x": torch.arange(64 * 2000, dtype=torch.float32).view(64, 2000)}, {"uid": np.arange(64)}, {}
    )
    setting, back = ray.get(echo.remote(batch))
    assert setting == LOCAL_CLUSTER_ENV["RAY_max_direct_call_object_size"] == str(1 << 20)
    assert torch.equal(back["x"], batch["x"]) and (back["uid"] == np.arange(64)).all()


def test_rendezvous_ports_are_chosen_below_the_ephemeral_range(monkeypatch):
    """``find_free_port`` (rank 0's rendezvous port) never returns a port from the kernel's ephemeral range,
    which port-0 binds and outgoing connections (Ray's) take from: one such port was taken between the
    choice and rank 0's bind in CI ("Address already in use"). Random in 20000 .. the range's start, free
    when chosen; an OS-chosen port where that span is empty."""
    import socket

    from rlkit.workers import base

    low, _ = base.ephemeral_ports()
    ports = [base.find_free_port() for _ in range(20)]
    assert all(20000 <= port < low for port in ports), ports
    assert len(set(ports)) > 1  # not one fixed port that two runs would share
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        monkeypatch.setattr(base.random.Random, "sample", lambda self, seq, k: [ports[0]])
        assert base.find_free_port() >= low  # the held port is skipped: the OS picks one
    monkeypatch.undo()
    monkeypatch.setattr(base, "ephemeral_ports", lambda: (20000, 60999))
    assert base.find_free_port() >= 20000
