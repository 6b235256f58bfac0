"""Ray resource pools, worker groups and dispatch, and the model workers placed on them.

Append-only export list: the runtime (cluster, pools, base, group, balance) comes first; model workers
add their names below.
"""

from rlkit.workers.balance import balanced_partitions, contiguous_partitions, seqlen_balance_metrics
from rlkit.workers.base import Worker, find_free_port
from rlkit.workers.cluster import RayCluster
from rlkit.workers.group import PendingCall, WorkerGroup
from rlkit.workers.pools import ResourcePool, ResourcePoolManager, resolve_device

__all__ = [
    "RayCluster",
    "ResourcePool",
    "ResourcePoolManager",
    "resolve_device",
    "Worker",
    "find_free_port",
    "WorkerGroup",
    "PendingCall",
    "balanced_partitions",
    "contiguous_partitions",
    "seqlen_balance_metrics",
]
