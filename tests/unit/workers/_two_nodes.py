"""A two-node Ray cluster on loopback and a 2-rank FSDP2 actor group spread across it.

Usage: python _two_nodes.py MODEL_DIR OUT_FILE

The head node (127.0.0.1, the driver's) has no CPU; two worker nodes (127.0.0.2 and 127.0.0.3, one CPU
each) hold the pool ``{nodes: 2, bundles_per_node: 1}``, so rank 0 is never on the driver's node. First,
with 0.75 CPU of 127.0.0.3 taken, a small pool ``{nodes: 2, cpus_per_bundle: 0.125}`` must still use
both nodes (Ray alone packs both of its groups onto the emptier node; the node-id selector prevents
that). The driver joins through ``RayCluster`` (``resources.ray_address``), as a user joining a cluster
would. Each rank runs ``_fsdp_ranks.update_once`` (fixed micro-batches); OUT_FILE
gets rank 0's result and where everything ran.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # nodes use the addresses given below
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import _fsdp_ranks  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rlkit.recipe.schema import PoolConfig, ResourcesConfig  # noqa: E402
from rlkit.workers import RayCluster, ResourcePool, Worker, WorkerGroup  # noqa: E402
from rlkit.workers.pools import NODE_ID_LABEL  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_fsdp_ranks)  # Ray workers cannot import it by name
NODE_IPS = ("127.0.0.2", "127.0.0.3")
MB = 1024 * 1024


class UpdateWorker(Worker):
    """One rank: remembers the rendezvous address it was given; runs one actor update on request."""

    def __init__(self, rank, world_size, master_addr, master_port, device, threads=1, *, model_dir: str):
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        self.rendezvous = (master_addr, master_port)
        self.model_dir = model_dir

    def where(self) -> dict:
        """This rank's Ray node, its node address, and the TCP addresses its process listens on."""
        listen = [
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == "LISTEN"
        ]
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "rendezvous": list(self.rendezvous),
            "listen": listen,
        }

    def update(self) -> dict:
        return _fsdp_ranks.update_once(self.model_dir, "fixed")


def spread_pool_nodes(busy_node: str) -> dict:
    """Nodes of a 2-node pool created while ``busy_node`` is mostly taken by another placement group."""
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 0.75}], bundle_label_selector=[{NODE_ID_LABEL: busy_node}])
    ray.get(blocker.ready(), timeout=60)
    pool = ResourcePool("spread", PoolConfig(nodes=2, cpus_per_bundle=0.125), "cpu").create()
    try:
        return {"busy_node": busy_node, "pool_nodes": pool.node_ids()}
    finally:
        pool.remove()
        remove_placement_group(blocker)


def main(model_dir: str, out: str) -> None:
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "node_ip_address": "127.0.0.1",
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": 96 * MB,
        },
    )
    try:
        workers = [
            cluster.add_node(wait=False, node_ip_address=ip, num_cpus=1, object_store_memory=96 * MB)
            for ip in NODE_IPS
        ]  # both start at once
        cluster.wait_for_nodes()
        seconds["nodes_up"] = time.perf_counter() - t0
        with RayCluster(ResourcesConfig(ray_address=cluster.address)):
            spread = spread_pool_nodes(workers[1].node_id)
            pool = ResourcePool("global", PoolConfig(nodes=2, bundles_per_node=1), "cpu").create(
                roles=["actor"]
            )
            group = WorkerGroup(UpdateWorker, pool, role="actor", role_kwargs={"model_dir": model_dir})
            seconds["group_up"] = time.perf_counter() - t0
            try:
                where = group.call("where", dispatch="all")
                result = group.call("update", dispatch="rank0")
                seconds["updated"] = time.perf_counter() - t0
            finally:
                group.shutdown()
                pool_nodes = pool.node_ids()
                pool.remove()
            torch.save(
                {
                    "result": result,
                    "where": where,
                    "spread": spread,
                    "seconds": seconds,
                    "pool_nodes": pool_nodes,
                    "group_rendezvous": [group.master_addr, group.master_port],
                    "driver": {
                        "node_id": ray.get_runtime_context().get_node_id(),
                        "node_ip": ray.util.get_node_ip_address(),
                    },
                    "nodes": {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]},
                },
                out,
            )
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
