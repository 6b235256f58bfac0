"""Resource pools: ray placement groups per ``resources.pools`` entry, and roles mapped to pools.

A pool ``{nodes: 2, bundles_per_node: 4}`` reserves ``2 × 4`` bundles; each bundle is one rank of every
worker group placed on the pool. On the CPU a bundle is ``{CPU: cpus_per_bundle}``; on CUDA it is
``{GPU: gpus_per_bundle, CPU: cpus_per_bundle}``. Each node's bundles form one STRICT_PACK placement
group, and the groups of one pool land on distinct Ray nodes (a node-id label selector excludes the
nodes already used), so ``nodes`` means nodes. Roles named in ``resources.roles`` go to their pool;
every other role goes to the first pool declared. Roles that share a pool share its bundles: the
trainer builds one worker group per (pool, role class) and gives each group its ``share`` of a bundle;
``ResourcePool.claim`` refuses shares that add up to more than one bundle.

Placement never waits silently: ``check_placement`` compares what the pools ask for with the cluster
(per node and in total) and raises ``WorkerError`` at once when it can never fit; what passes the check
but still is not placed (another job holds the resources) fails after ``PLACEMENT_TIMEOUT_S``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import WorkerError
from rlkit.recipe.schema import PoolConfig, ResourcesConfig

__all__ = [
    "ResourcePool",
    "ResourcePoolManager",
    "resolve_device",
    "pool_cpu_demand",
    "check_placement",
    "PLACEMENT_TIMEOUT_S",
]

PLACEMENT_TIMEOUT_S = 30.0  # longest wait for placement groups that passed check_placement
NODE_ID_LABEL = "ray.io/node-id"  # label every Ray node carries (its hex id)
_EPS = 1e-6


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without a GPU is refused
    (``rlkit.hardware.device_plan`` decides)."""
    from rlkit.hardware import device_plan

    try:
        return device_plan(device).device
    except ValueError as exc:
        raise WorkerError(str(exc)) from exc


def pool_cpu_demand(resources: ResourcesConfig) -> float:
    """Logical CPUs all pools reserve together (the local cluster registers at least this many)."""
    return sum(p.nodes * p.bundles_per_node * p.cpus_per_bundle for p in resources.pools.values())


def _fmt(resources: Mapping[str, float]) -> str:
    """``{CPU: 2, GPU: 1}`` with whole numbers unpadded."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in need.items() if v > 0)


def _roles_text(roles: Sequence[str]) -> str:
    return f"roles {', '.join(repr(r) for r in roles)}" if roles else "no role named yet"


@dataclass
class ResourcePool:
    """``nodes`` placement groups of ``bundles_per_node`` bundles, one STRICT_PACK group per Ray node
    (distinct nodes); rank ``i`` of a group takes bundle ``i % bundles_per_node`` of placement group
    ``i // bundles_per_node``, so a node's ranks stay together."""

    name: str
    config: PoolConfig
    device: str  # "cpu" | "cuda"
    placement_groups: list[Any] = field(default_factory=list, repr=False)  # ray PlacementGroup per node
    roles: list[str] = field(default_factory=list)  # roles placed here (named in errors)
    # group id -> (role, share)
    claims: dict[int, tuple[str, float]] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.config.nodes * self.config.bundles_per_node

    def bundle(self) -> dict[str, float]:
        """The resources of one bundle."""
        b = {"CPU": float(self.config.cpus_per_bundle)}
        if self.device == "cuda" and self.config.gpus_per_bundle > 0:
            b["GPU"] = float(self.config.gpus_per_bundle)
        return b

    def node_demand(self) -> dict[str, float]:
        """What one node must hold: ``bundles_per_node`` bundles (one STRICT_PACK group)."""
        return {k: v * self.config.bundles_per_node for k, v in self.bundle().items()}

    def demand(self) -> dict[str, float]:
        """What the whole pool reserves: ``nodes × bundles_per_node`` bundles."""
        return {k: v * self.world_size for k, v in self.bundle().items()}

    def location(self, rank: int) -> tuple[Any, int]:
        """``(placement group, bundle index)`` hosting ``rank``."""
        if not self.placement_groups:
            raise WorkerError(f"resource pool '{self.name}' is not created yet; call create() first.")
        per_node = self.config.bundles_per_node
        return self.placement_groups[rank // per_node], rank % per_node

    def node_ids(self) -> list[str]:
        """The Ray node id (hex) each placement group landed on, in rank order."""
        import ray

        return [ray.util.placement_group_table(pg)["bundles_to_node_id"][0] for pg in self.placement_groups]

    def create(
        self, timeout_s: float = PLACEMENT_TIMEOUT_S, roles: Sequence[str] | None = None
    ) -> ResourcePool:
        """Reserve one placement group per node, each on a node the previous ones do not use.

        Raises ``WorkerError`` at once when the cluster can never hold the pool (``check_placement``),
        and after ``timeout_s`` when Ray still has not placed every bundle (resources held elsewhere).
        ``roles`` (the roles that will run here) only make the errors say who asked.
        """
        import ray
        from ray.util.placement_group import placement_group

        if roles is not None:
            self.roles = list(roles)
        if self.placement_groups:
            return self
        check_placement([self])
        deadline = time.monotonic() + timeout_s
        per_node = self.config.bundles_per_node
        used: list[str] = []
        for _ in range(self.config.nodes):
            # Exclude the nodes this pool already holds: STRICT_PACK keeps a node's bundles together,
            # the selector keeps the pool's nodes apart.
            selector = [{NODE_ID_LABEL: f"!in({','.join(used)})"}] * per_node if used else None
            pg = placement_group(
                [self.bundle() for _ in range(per_node)],
                strategy="STRICT_PACK",
                bundle_label_selector=selector,
            )
            self.placement_groups.append(pg)
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                placed = len(self.placement_groups) - 1
                self.remove()
                raise self._unplaced_error(placed, timeout_s)
            used.append(ray.util.placement_group_table(pg)["bundles_to_node_id"][0])
        return self

    def _unplaced_error(self, placed: int, timeout_s: float) -> WorkerError:
        import ray

        return WorkerError(
            f"resource pool '{self.name}' ({_roles_text(self.roles)}): Ray placed {placed} of "
            f"{self.config.nodes} node group(s) of {self.config.bundles_per_node} bundle(s) "
            f"{_fmt(self.bundle())} within {timeout_s:g} s, although the cluster's nodes are large enough. "
            f"Something else holds the resources: available now {_fmt(_base(ray.available_resources()))}, "
            f"cluster total {_fmt(_base(ray.cluster_resources()))}. Stop the other job (see `ray status`), "
            f"or lower resources.pools.{self.name}.bundles_per_node / cpus_per_bundle / gpus_per_bundle."
        )

    def claim(self, owner: object, role: str, share: float) -> None:
        """Record that ``owner`` (a worker group) takes ``share`` of every bundle; refuse a share that
        does not fit beside the groups already on the pool (Ray would wait for it forever)."""
        held = sum(s for _, s in self.claims.values())
        if held + share > 1.0 + _EPS:
            holders = ", ".join(f"'{r}' {s:g}" for r, s in self.claims.values())
            raise WorkerError(
                f"resource pool '{self.name}': role '{role}' asks for share {share:g} of each bundle "
                f"{_fmt(self.bundle())}, but {holders} already hold {held:g} of it; the shares of the roles "
                "on one pool must add up to at most 1. Give each of the k roles on the pool share 1/k, or "
                f"map '{role}' to a pool of its own (resources.pools.<name>: {{...}} and "
                f"resources.roles.{role}=<name>)."
            )
        self.claims[id(owner)] = (role, share)

    def release(self, owner: object) -> None:
        """Forget ``owner``'s share (its actors are gone)."""
        self.claims.pop(id(owner), None)

    def remove(self) -> None:
        """Release the placement groups (actors still placed on them are killed by Ray)."""
        from ray.util.placement_group import remove_placement_group

        pgs, self.placement_groups = self.placement_groups, []
        self.claims.clear()
        for pg in pgs:
            remove_placement_group(pg)


def _base(resources: Mapping[str, float]) -> dict[str, float]:
    """Only CPU and GPU (Ray also lists memory, node:<ip> and per-placement-group resources)."""
    return {k: float(v) for k, v in resources.items() if k in ("CPU", "GPU")}


def check_placement(
    pools: Iterable[ResourcePool],
    roles_by_pool: Mapping[str, Sequence[str]] | None = None,
    *,
    nodes: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
    """Raise ``WorkerError`` at once if the cluster can never hold ``pools`` together.

    Checks, against the resources the nodes have (not what is free right now): every pool finds
    ``nodes`` distinct nodes that each hold one node group (``bundles_per_node`` bundles, STRICT_PACK),
    and all pools together ask for no more CPU/GPU than the nodes have in all. ``roles_by_pool``
    (``{pool name: [role, ...]}``, default: each pool's ``roles``) names the roles in the message.
    ``nodes`` (``{node address: {CPU: n, GPU: m}}``) describes the cluster without asking Ray, e.g.
    ``{"local": local_node(resources)}`` (``rlkit.workers.cluster``) for the cluster ``RayCluster``
    would start, before it starts; by default the live nodes of the connected Ray cluster.
    """
    pools = list(pools)
    roles = {p.name: list((roles_by_pool or {}).get(p.name, p.roles)) for p in pools}
    if nodes is None:
        import ray

        nodes = {
            f"{n['NodeManagerAddress']} (node {n['NodeID'][:8]})": n["Resources"]
            for n in ray.nodes()
            if n.get("Alive")
        }
    sizes = {addr: _base(res) for addr, res in nodes.items()}
    for pool in pools:
        _check_pool_fits(pool, roles[pool.name], sizes)
    _check_pools_fit_together(pools, roles, sizes)


def _check_pool_fits(pool: ResourcePool, roles: list[str], sizes: Mapping[str, Mapping[str, float]]) -> None:
    """Raise ``WorkerError`` unless ``pool.config.nodes`` of the nodes (``{address: resources}``) each hold
    one of its node groups."""
    need = pool.node_demand()
    fit = sum(_fits(need, have) for have in sizes.values())
    if fit >= pool.config.nodes:
        return
    per = "; ".join(f"{addr} {_fmt(have)}" for addr, have in sizes.items())
    if pool.config.nodes > fit >= 1:
        fix = (
            f"set resources.pools.{pool.name}.nodes={fit}"
            + (
                f" and bundles_per_node={pool.config.bundles_per_node * pool.config.nodes // fit}"
                if len(sizes) == 1
                else ""
            )
            + ", or join a cluster with more nodes (resources.ray_address)"
        )
    else:
        fix = (
            f"lower resources.pools.{pool.name}.bundles_per_node, cpus_per_bundle or gpus_per_bundle, "
            f"or start Ray with more resources per node"
        )
    raise WorkerError(
        f"resource pool '{pool.name}' ({_roles_text(roles)}) asks for {pool.config.nodes} "
        f"node(s) that each hold {pool.config.bundles_per_node} bundle(s) of {_fmt(pool.bundle())} = "
        f"{_fmt(need)} per node; the Ray cluster has {len(sizes)} node(s) ({per}), {fit} of them large "
        f"enough. It can never be placed: {fix}."
    )


def _check_pools_fit_together(
    pools: list[ResourcePool], roles: Mapping[str, list[str]], sizes: Mapping[str, Mapping[str, float]]
) -> None:
    """Raise ``WorkerError`` where several pools together ask for more CPU/GPU than the nodes have in all."""
    total: dict[str, float] = {}
    for have in sizes.values():
        for k, v in have.items():
            total[k] = total.get(k, 0.0) + v
    asked: dict[str, float] = {}
    for pool in pools:
        for k, v in pool.demand().items():
            asked[k] = asked.get(k, 0.0) + v
    short = {k: v for k, v in asked.items() if v > total.get(k, 0.0) + _EPS}
    if short and len(pools) > 1:
        each = "; ".join(f"'{p.name}' ({_roles_text(roles[p.name])}) {_fmt(p.demand())}" for p in pools)
        raise WorkerError(
            f"the resource pools together ask for {_fmt(asked)} but the Ray cluster has {_fmt(total)} in all "
            f"({each}). Map roles onto one pool to share its bundles (resources.roles.<role>=<pool>), lower "
            f"resources.pools.<name>.bundles_per_node / cpus_per_bundle / gpus_per_bundle, or give Ray more."
        )


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
        self.checked = False  # check() ran (pool_for runs it once before the first placement)

    def pool_name_for(self, role: str) -> str:
        return self.resources.roles.get(role, next(iter(self.resources.pools)))

    def pool_for(self, role: str) -> ResourcePool:
        """The pool ``role`` runs on (created on first use, after ``check`` of every declared pool)."""
        if not self.checked:
            self.check()
        pool = self.pools[self.pool_name_for(role)]
        return pool.create(roles=sorted({*pool.roles, role}))

    def colocated(self, roles: Iterable[str]) -> dict[str, list[str]]:
        """``{pool name: [roles]}`` for the given roles, in the order given."""
        out: dict[str, list[str]] = {}
        for role in roles:
            out.setdefault(self.pool_name_for(role), []).append(role)
        return out

    def check(
        self,
        roles_by_pool: Mapping[str, Sequence[str]] | None = None,
        *,
        nodes: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """``check_placement`` for the pools in ``roles_by_pool`` (``{pool: [roles]}``, the roles the run
        builds; pools without roles are not checked), or for every declared pool with the roles
        ``resources.roles`` maps to it. Raises ``WorkerError`` at once, naming pools and roles.
        ``nodes``: see ``check_placement`` (default: the connected Ray cluster's live nodes)."""
        if roles_by_pool is None:
            roles_by_pool = {
                name: [r for r, p in self.resources.roles.items() if p == name] for name in self.pools
            }
        unknown = sorted(set(roles_by_pool) - set(self.pools))
        if unknown:
            raise WorkerError(
                f"roles_by_pool names pools {unknown} that resources.pools does not declare "
                f"(declared: {sorted(self.pools)})."
            )
        for name, roles in roles_by_pool.items():
            self.pools[name].roles = list(roles)
        check_placement([self.pools[n] for n in roles_by_pool], roles_by_pool, nodes=nodes)
        self.checked = nodes is None  # a check against described nodes does not replace the live one

    def create_all(
        self, roles_by_pool: Mapping[str, Sequence[str]] | None = None, timeout_s: float = PLACEMENT_TIMEOUT_S
    ) -> None:
        """``check`` the pools, then create them (all declared pools, or those in ``roles_by_pool``)
        within one shared ``timeout_s``."""
        self.check(roles_by_pool)
        deadline = time.monotonic() + timeout_s
        for name in roles_by_pool or self.pools:
            self.pools[name].create(timeout_s=max(0.0, deadline - time.monotonic()))

    def remove_all(self) -> None:
        for pool in self.pools.values():
            pool.remove()

    def cpu_demand(self) -> int:
        return math.ceil(pool_cpu_demand(self.resources))
