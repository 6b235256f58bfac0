"""Resource pools: one Ray placement group per ``resources.pools`` entry, and roles mapped to pools.

A pool ``{nodes: 2, bundles_per_node: 4}`` reserves ``2 × 4`` bundles; each bundle is one rank of every
worker group placed on the pool. On the CPU a bundle is ``{CPU: cpus_per_bundle}``; on CUDA it is
``{GPU: gpus_per_bundle, CPU: cpus_per_bundle}``. Roles named in ``resources.roles`` go to their pool;
every other role goes to the first pool declared. Roles that share a pool share its bundles: the
trainer builds one worker group per (pool, role class) and gives each group its ``share`` of a bundle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import WorkerError
from rlkit.recipe.schema import PoolConfig, ResourcesConfig

__all__ = ["ResourcePool", "ResourcePoolManager", "resolve_device", "pool_cpu_demand"]


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without a GPU is refused."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise WorkerError(
            "resources.device is 'cuda' but torch sees no GPU on the driver. "
            "Set resources.device=cpu (or auto), or install a CUDA build of torch."
        )
    if device not in ("cpu", "cuda"):
        raise WorkerError(f"resources.device must be auto, cpu or cuda, got {device!r}.")
    return device


def pool_cpu_demand(resources: ResourcesConfig) -> float:
    """Logical CPUs all pools reserve together (the local cluster registers at least this many)."""
    return sum(p.nodes * p.bundles_per_node * p.cpus_per_bundle for p in resources.pools.values())


@dataclass
class ResourcePool:
    """``nodes`` placement groups of ``bundles_per_node`` bundles; rank ``i`` of a group takes bundle
    ``i % bundles_per_node`` of placement group ``i // bundles_per_node`` (one STRICT_PACK group per node,
    so a node's ranks stay together)."""

    name: str
    config: PoolConfig
    device: str  # "cpu" | "cuda"
    placement_groups: list[Any] = field(default_factory=list, repr=False)  # ray PlacementGroup per node

    @property
    def world_size(self) -> int:
        return self.config.nodes * self.config.bundles_per_node

    def bundle(self) -> dict[str, float]:
        """The resources of one bundle."""
        b = {"CPU": float(self.config.cpus_per_bundle)}
        if self.device == "cuda" and self.config.gpus_per_bundle > 0:
            b["GPU"] = float(self.config.gpus_per_bundle)
        return b

    def location(self, rank: int) -> tuple[Any, int]:
        """``(placement group, bundle index)`` hosting ``rank``."""
        if not self.placement_groups:
            raise WorkerError(f"resource pool '{self.name}' is not created yet; call create() first.")
        per_node = self.config.bundles_per_node
        return self.placement_groups[rank // per_node], rank % per_node

    def create(self, timeout_s: float = 60.0) -> ResourcePool:
        """Reserve the placement groups and wait until every bundle is placed."""
        import ray
        from ray.util.placement_group import placement_group

        if self.placement_groups:
            return self
        per_node = self.config.bundles_per_node
        pgs = [
            placement_group([self.bundle() for _ in range(per_node)], strategy="STRICT_PACK", name="")
            for _ in range(self.config.nodes)
        ]
        self.placement_groups = pgs
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) < len(pgs):
            self.remove()
            total = {k: v * self.world_size for k, v in self.bundle().items()}
            raise WorkerError(
                f"resource pool '{self.name}': Ray could not place {self.config.nodes} node(s) × "
                f"{per_node} bundle(s) of {self.bundle()} (in all {total}) within {timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} available. Lower "
                f"resources.pools.{self.name}.*, or start Ray with more resources."
            )
        return self

    def remove(self) -> None:
        """Release the placement groups (actors still placed on them are killed by Ray)."""
        from ray.util.placement_group import remove_placement_group

        pgs, self.placement_groups = self.placement_groups, []
        for pg in pgs:
            remove_placement_group(pg)


class ResourcePoolManager:
    """The pools of a recipe and the role → pool mapping; creates and removes the placement groups."""

    def __init__(self, resources: ResourcesConfig, device: str | None = None):
        if not resources.pools:
            raise WorkerError("resources.pools is empty; declare at least one pool (e.g. pools.global).")
        unknown = {r: p for r, p in resources.roles.items() if p not in resources.pools}
        if unknown:
            raise WorkerError(
                f"resources.roles maps {unknown} to pools that do not exist; "
                f"declared pools: {sorted(resources.pools)}."
            )
        self.resources = resources
        self.device = device or resolve_device(resources.device)
        self.pools = {name: ResourcePool(name, cfg, self.device) for name, cfg in resources.pools.items()}

    def pool_name_for(self, role: str) -> str:
        return self.resources.roles.get(role, next(iter(self.resources.pools)))

    def pool_for(self, role: str) -> ResourcePool:
        """The pool ``role`` runs on (created on first use)."""
        return self.pools[self.pool_name_for(role)].create()

    def colocated(self, roles: Iterable[str]) -> dict[str, list[str]]:
        """``{pool name: [roles]}`` for the given roles, in the order given."""
        out: dict[str, list[str]] = {}
        for role in roles:
            out.setdefault(self.pool_name_for(role), []).append(role)
        return out

    def create_all(self) -> None:
        for pool in self.pools.values():
            pool.create()

    def remove_all(self) -> None:
        for pool in self.pools.values():
            pool.remove()

    def cpu_demand(self) -> int:
        return math.ceil(pool_cpu_demand(self.resources))
