"""``WorkerGroup``: N Ray actors of one role class on one resource pool, joined in one process group.

    pool = ResourcePoolManager(recipe.resources).pool_for("actor_rollout_ref")
    group = WorkerGroup(ActorRolloutRefWorker, pool, role="actor_rollout_ref", role_kwargs={...})
    out = group.call("compute_log_prob", batch, balance=True)   # split, call on all, concat in order
    metrics = group.call("update_actor", batch, dispatch="all")  # same arguments, list of per-rank results
    group.shutdown()

Colocation: roles that share a pool share one process by being one class (the hybrid engine's
``ActorRolloutRefWorker`` holds actor + rollout + ref). Two different classes on one pool are two
groups whose actors each take ``share`` of every bundle (e.g. 0.5 each).

Dispatch modes of ``call``/``submit``:

- ``split`` (default): a ``Batch`` is cut into ``world_size`` parts (contiguous, or token-balanced with
  ``balance=True``: equal sample counts, near-equal ``attention_mask`` sums), rank ``i`` gets part
  ``i``; results that are Batches are concatenated back in the batch's original sample order, other
  results come back as a list by rank. Balancing records veRL's ``global_seqlen/*`` metrics in
  ``group.last_metrics``.
- ``all``: every rank gets the same arguments (the batch is put in the object store once); list by rank.
- ``rank0``: every rank runs the method (SPMD code needs all ranks), rank 0's result is returned.

Failures: an exception on a rank raises ``WorkerError`` on the driver naming the role, the rank and the
method, with the remote traceback (``err.remote_traceback``). A rank whose process died raises
``WorkerError`` with "worker process died". The first failure wins; the group is then unusable
(other ranks may be blocked in a collective) and must be shut down. A group whose ``share`` does not
fit beside the groups already on its pool is refused at once (``ResourcePool.claim``); a rank that Ray
leaves unscheduled for want of its share fails after ``schedule_timeout_s`` (docs/placement.md).

Waiting: the driver waits in slices of ``WAIT_SLICE_S`` so a stop signal (``rlkit.runtime.stop``) is seen
within that time. ``in_flight()`` lists the calls being waited on and the ranks that have not
answered; ``probe(ranks)`` asks those ranks a liveness question that runs beside the busy method
(each actor has a ``liveness`` concurrency group, so its methods run on a worker thread, one at a
time as before): a rank that does not answer within the timeout is hung, not just busy.
``kill()`` ends every actor at once (a stop); ``shutdown()`` ends them gracefully.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.workers.balance import balanced_partitions, contiguous_partitions, seqlen_balance_metrics
from rlkit.workers.base import find_free_port
from rlkit.workers.pools import ResourcePool

__all__ = [
    "WorkerGroup",
    "PendingCall",
    "InFlight",
    "Dispatch",
    "worker_error",
    "unscheduled_ranks",
    "SCHEDULE_TIMEOUT_S",
]

Dispatch = Literal["split", "all", "rank0"]
SCHEDULE_TIMEOUT_S = 20.0  # longest wait for a rank whose share of its bundle is not free
WAIT_SLICE_S = 0.25  # longest uninterrupted ray.wait: how soon a stop signal is seen
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote tracebacks


def worker_error(role: str, rank: int, method: str, exc: BaseException) -> WorkerError:
    """Turn a Ray failure of one rank into a ``WorkerError`` with ``role``, ``rank``, ``method`` and
    ``remote_traceback`` attributes."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        # ray.get raises a subclass of both RayTaskError and the remote exception's class, whose
        # str() is Ray's report: the remote traceback with the pid and address of the rank.
        tb = _ANSI.sub("", getattr(exc, "traceback_str", None) or str(exc))
        what = f"{type(cause).__name__}: {cause}" if cause is not None else "an exception"
        msg = (
            f"role '{role}', rank {rank}, method '{method}' raised {what}\n"
            f"--- remote traceback (rank {rank}) ---\n{tb}"
        )
    elif isinstance(exc, RayActorError):
        init = getattr(exc, "actor_init_failed", False)
        why = "its constructor raised" if init else "worker process died"
        tb = _ANSI.sub("", str(exc))
        msg = (
            f"role '{role}', rank {rank}, method '{method}': {why} ({type(exc).__name__}). "
            f"The group cannot continue; shut it down and restart from a checkpoint.\n{tb}"
        )
    else:
        tb = str(exc)
        msg = f"role '{role}', rank {rank}, method '{method}': {type(exc).__name__}: {exc}"
    err = WorkerError(msg)
    err.role, err.rank, err.method, err.remote_traceback = role, rank, method, tb
    err.died = isinstance(exc, RayActorError) and not getattr(exc, "actor_init_failed", False)  # restartable
    return err


def unscheduled_ranks(actors: Sequence[Any], pool: ResourcePool, ranks: Sequence[int]) -> list[int]:
    """The ``ranks`` whose actor Ray has not given a worker process because the resources it asks of its
    bundle are not free (not the ranks whose process is still starting or loading a model).

    An actor without a worker is ``PENDING_CREATION`` with an empty address in the GCS actor table; it
    waits for resources when its bundle's resources are also in the cluster's pending demand (a process
    that is starting already holds them). Private Ray APIs: if they fail, the actor table alone decides.
    """
    from ray._private import state  # private API: the GCS actor table, no dashboard needed

    no_worker = []
    for rank in ranks:
        info = state.actors(actor_id=actors[rank]._actor_id.hex())
        if (
            info.get("State") in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")
            and not info["Address"]["IPAddress"]
        ):
            no_worker.append(rank)
    if not no_worker:
        return []
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status  # private API: pending resource demand

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        demanded = {
            key
            for d in status.resource_demands.ray_task_actor_demand
            for req in d.bundles_by_count
            for key in req.bundle
        }
    except Exception:  # noqa: BLE001 - fall back to the actor table alone
        return no_worker
    out = []
    for rank in no_worker:
        pg, index = pool.location(rank)
        if any(key.endswith(f"_group_{index}_{pg.id.hex()}") for key in demanded):
            out.append(rank)
    return out


@ray.remote(num_cpus=0)
def _address_on_node() -> tuple[str, int]:
    """Runs inside bundle 0 of a pool on another node: that node's address and a free port."""
    ip = ray.util.get_node_ip_address()
    return ip, find_free_port(ip)


@dataclass
class PendingCall:
    """A dispatched call; ``get()`` waits for every rank and assembles the result."""

    group: WorkerGroup
    method: str
    dispatch: Dispatch
    refs: list[Any]
    parts: list[list[int]] | None = None  # split: the original indices each rank received
    submitted_at: float = field(default_factory=time.perf_counter)

    def get(self, timeout_s: float | None = None) -> Any:
        results = self.group._gather(self.refs, self.method, timeout_s)
        if self.dispatch == "rank0":
            return results[0]
        if self.dispatch == "all" or not all(isinstance(r, Batch) for r in results):
            return results
        return _restore_order(results, self.parts, self.group.role, self.method)


@dataclass
class InFlight:
    """A call the driver is waiting on: which ranks have answered, and since when it runs."""

    method: str
    ranks: int
    started: float = field(default_factory=time.monotonic)
    answered: set[int] = field(default_factory=set)

    @property
    def waiting(self) -> list[int]:
        return sorted(set(range(self.ranks)) - self.answered)


def _restore_order(results: list[Batch], parts: list[list[int]], role: str, method: str) -> Batch:
    sizes = [len(r) for r in results]
    if sizes != [len(p) for p in parts]:
        raise WorkerError(
            f"role '{role}', method '{method}': ranks returned {sizes} samples for parts of "
            f"{[len(p) for p in parts]}; a split call must return one row per input sample "
            f"(return a list or use dispatch='all' for anything else)."
        )
    sent = [i for p in parts for i in p]  # concat position j holds original sample sent[j]
    where = [0] * len(sent)
    for j, i in enumerate(sent):
        where[i] = j
    return Batch.concat(results).reorder(where)


class WorkerGroup:
    """``pool.world_size`` actors of ``cls`` (a ``Worker`` subclass), rank ``i`` in bundle ``i``."""

    def __init__(
        self,
        cls: type,
        pool: ResourcePool,
        *,
        role: str,
        threads: int = 1,
        share: float = 1.0,
        role_kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        start_timeout_s: float | None = 600.0,
        schedule_timeout_s: float = SCHEDULE_TIMEOUT_S,
    ):
        if hasattr(cls, "remote"):
            raise WorkerError(
                f"WorkerGroup takes the plain role class, not a Ray actor class (role '{role}')."
            )
        if not 0 < share <= 1:
            raise WorkerError(f"WorkerGroup share must be in (0, 1], got {share} (role '{role}').")
        self.cls = cls
        self.pool = pool.create()
        self.role = role
        self.share = share
        self.world_size = pool.world_size
        self.device = pool.device
        self.last_metrics: dict[str, float] = {}
        self.start_s: float | None = None
        self.actors: list[Any] = []
        self._in_flight: dict[int, InFlight] = {}
        self._pids: list[int] = []  # known after pids()
        t0 = time.perf_counter()
        pool.claim(self, role, share)  # refuses at once a share that cannot fit beside the other groups
        try:
            self.master_addr, self.master_port = self._rendezvous_address()
            self._spawn(role_kwargs or {}, threads, env_vars)
            # Constructors rendezvous with each other; a ping per rank waits until all are up.
            self._await_start(start_timeout_s, schedule_timeout_s)
        except BaseException:
            self._kill()
            raise
        self.start_s = time.perf_counter() - t0

    def _spawn(self, role_kwargs: dict[str, Any], threads: int, env_vars: dict[str, str] | None) -> None:
        """One actor per rank, rank ``i`` in its bundle, each taking ``share`` of the bundle."""
        bundle = self.pool.bundle()
        remote_cls = ray.remote(concurrency_groups={"liveness": 1})(self.cls)
        for rank in range(self.world_size):
            pg, index = self.pool.location(rank)
            options: dict[str, Any] = {
                "num_cpus": bundle["CPU"] * self.share,
                "num_gpus": bundle.get("GPU", 0.0) * self.share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index
                ),
                "max_restarts": 0,
            }
            if env_vars:
                options["runtime_env"] = {"env_vars": dict(env_vars)}
            self.actors.append(
                remote_cls.options(**options).remote(
                    rank,
                    self.world_size,
                    self.master_addr,
                    self.master_port,
                    self.device,
                    threads,
                    **role_kwargs,
                )
            )

    def _await_start(self, timeout_s: float | None, schedule_timeout_s: float) -> None:
        """Wait for every rank's ``ping``; a rank that Ray has not scheduled because its share of the
        bundle is not free fails after ``schedule_timeout_s`` (model loading is bounded by ``timeout_s``)."""
        refs = [a.ping.remote() for a in self.actors]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting_since: dict[int, float] = {}  # rank -> when it was first seen waiting for resources
        pending = list(range(len(refs)))
        while pending:
            ready = set(ray.wait([refs[r] for r in pending], num_returns=len(pending), timeout=1.0)[0])
            for rank in [r for r in pending if refs[r] in ready]:
                try:
                    ray.get(refs[rank])
                except (RayTaskError, RayActorError, GetTimeoutError) as exc:
                    raise worker_error(self.role, rank, "__init__", exc) from None
                pending.remove(rank)
            now = time.monotonic()
            if pending and deadline is not None and now >= deadline:
                raise WorkerError(
                    f"role '{self.role}', method '__init__': rank(s) {pending} did not start within "
                    f"{timeout_s} s."
                )
            stuck = unscheduled_ranks(self.actors, self.pool, pending) if pending else []
            waiting_since = {rank: waiting_since.get(rank, now) for rank in stuck}
            late = [rank for rank, since in waiting_since.items() if now - since >= schedule_timeout_s]
            if late:
                raise self._unschedulable(late, schedule_timeout_s)

    def _unschedulable(self, ranks: list[int], waited_s: float) -> WorkerError:
        others = [f"'{r}' {s:g}" for key, (r, s) in self.pool.claims.items() if key != id(self)]
        return WorkerError(
            f"role '{self.role}': rank(s) {ranks} could not be scheduled for {waited_s:g} s: each asks for "
            f"share {self.share:g} of a bundle {self.pool.bundle()} of resource pool '{self.pool.name}', and "
            f"that share is not free (groups on the pool: {', '.join(others) or 'none of this driver'}; "
            "anything else placed in the pool's placement groups holds the rest). Give the roles on pool "
            f"'{self.pool.name}' shares that add up to at most 1, or map '{self.role}' to a pool of its own "
            f"(resources.pools.<name> and resources.roles.{self.role}=<name>)."
        )

    def _kill(self) -> None:
        """Kill the actors started so far and give back the share (a failed start leaves nothing)."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray is going down
                pass
        self.actors = []
        self.pool.release(self)

    def _rendezvous_address(self, timeout_s: float = 120.0) -> tuple[str, int]:
        """Address of rank 0's node and a free port there: the driver's node address when rank 0's
        bundle is on the driver's node (127.0.0.1 for a local cluster), else what a zero-CPU task in
        that bundle reports from its node (tests/unit/workers/test_multinode.py)."""
        pg, index = self.pool.location(0)
        node_of_bundle = ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(index)
        if node_of_bundle is None or node_of_bundle == ray.get_runtime_context().get_node_id():
            ip = ray.util.get_node_ip_address()
            return ip, find_free_port(ip)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        try:
            addr, port = ray.get(
                _address_on_node.options(scheduling_strategy=strategy).remote(), timeout=timeout_s
            )
        except (GetTimeoutError, RayTaskError) as exc:
            raise WorkerError(
                f"role '{self.role}': could not learn the address of rank 0's node {node_of_bundle} "
                f"(resource pool '{self.pool.name}') within {timeout_s:g} s: {exc}. Check that the node is "
                "alive (`ray status`) and that it can import rlkit."
            ) from None
        return addr, port

    # ----- dispatch ---------------------------------------------------------------------------
    def submit(
        self,
        method: str,
        batch: Batch | None = None,
        *,
        dispatch: Dispatch = "split",
        balance: bool = False,
        balance_key: str = "attention_mask",
        **kwargs: Any,
    ) -> PendingCall:
        """Start ``method`` on every rank without waiting; ``.get()`` the returned ``PendingCall``."""
        if not callable(getattr(self.cls, method, None)) or method.startswith("_"):
            public = sorted(
                m for m in dir(self.cls) if not m.startswith("_") and callable(getattr(self.cls, m))
            )
            raise WorkerError(
                f"role '{self.role}' ({self.cls.__name__}) has no method '{method}'. Methods: {public}."
            )
        if dispatch == "split":
            parts = self._split(batch, balance, balance_key, method)
            refs = [
                getattr(actor, method).remote(batch[part], **kwargs)
                for actor, part in zip(self.actors, parts)
            ]
            return PendingCall(self, method, dispatch, refs, parts)
        if dispatch in ("all", "rank0"):
            # an ObjectRef (another group's result) goes as it is: Ray hands each rank its value, unfetched by
            # the driver
            args = () if batch is None else (batch if isinstance(batch, ray.ObjectRef) else ray.put(batch),)
            refs = [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]
            return PendingCall(self, method, dispatch, refs)
        raise WorkerError(f"dispatch must be 'split', 'all' or 'rank0', got {dispatch!r}.")

    def call(
        self,
        method: str,
        batch: Batch | None = None,
        *,
        dispatch: Dispatch = "split",
        balance: bool = False,
        balance_key: str = "attention_mask",
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``method`` on every rank and wait (see the module docstring for ``dispatch``)."""
        pending = self.submit(
            method, batch, dispatch=dispatch, balance=balance, balance_key=balance_key, **kwargs
        )
        return pending.get(timeout_s)

    def _split(self, batch: Batch | None, balance: bool, balance_key: str, method: str) -> list[list[int]]:
        if not isinstance(batch, Batch):
            raise WorkerError(
                f"role '{self.role}', method '{method}': dispatch='split' needs a Batch, got "
                f"{type(batch).__name__}; use dispatch='all' to send the same arguments to every rank."
            )
        n = len(batch)
        if n < self.world_size:
            raise WorkerError(
                f"role '{self.role}', method '{method}': cannot split {n} sample(s) across {self.world_size} "
                f"ranks; make the batch at least as large as the world size."
            )
        if not balance:
            return contiguous_partitions(n, self.world_size)
        if balance_key not in batch.tensors.keys():
            raise WorkerError(
                f"role '{self.role}', method '{method}': balance=True counts tokens with '{balance_key}', "
                f"which the batch lacks (fields: {sorted(batch.keys())}); pass balance_key= or balance=False."
            )
        seqlens = batch[balance_key].reshape(n, -1).sum(-1).tolist()  # [N] tokens per sample
        parts = balanced_partitions(seqlens, self.world_size)
        self.last_metrics = seqlen_balance_metrics(seqlens, parts)
        return parts

    def _gather(self, refs: Sequence[Any], method: str, timeout_s: float | None = None) -> list[Any]:
        """Results by rank; the first rank to fail raises ``WorkerError`` without waiting for the rest."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        call = InFlight(method, len(refs))
        self._in_flight[id(call)] = call
        try:
            while pending:
                left = (
                    WAIT_SLICE_S
                    if deadline is None
                    else min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
                )
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    ranks = sorted(rank_of[r] for r in pending)
                    raise WorkerError(
                        f"role '{self.role}', method '{method}': rank(s) {ranks} did not answer within "
                        f"{timeout_s} s (a rank may be blocked in a collective after another failed)."
                    )
                for ref in ready:
                    rank = rank_of[ref]
                    try:
                        results[rank] = ray.get(ref)
                    except (RayTaskError, RayActorError, GetTimeoutError) as exc:
                        raise worker_error(self.role, rank, method, exc) from None
                    call.answered.add(rank)
        finally:
            del self._in_flight[id(call)]
        return results

    def in_flight(self) -> list[InFlight]:
        """The calls the driver is waiting on now (safe to read from another thread)."""
        return list(self._in_flight.values())

    def probe(self, ranks: Sequence[int], timeout_s: float = 10.0) -> dict[int, dict[str, Any]]:
        """Ask ``ranks`` where they are (``Worker.where``, run beside a busy method). Per rank:
        ``{"state": "alive", "pid", "method", "at"}``, ``{"state": "no answer"}`` (hung: stuck with the
        GIL held, stopped, or its node is unreachable) or ``{"state": "dead", "error"}``."""
        actors = self.actors
        refs = {rank: actors[rank].where.options(concurrency_group="liveness").remote() for rank in ranks}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        ready = set(ready)
        out: dict[int, dict[str, Any]] = {}
        for rank, ref in refs.items():
            if ref not in ready:
                out[rank] = {
                    "state": "no answer",
                    "pid": self._pids[rank] if rank < len(self._pids) else None,
                }
                try:
                    ray.cancel(ref)
                except Exception:  # noqa: BLE001 - best effort
                    pass
                continue
            try:
                out[rank] = {"state": "alive", **ray.get(ref)}
            except (RayTaskError, RayActorError) as exc:
                out[rank] = {"state": "dead", "error": type(exc).__name__}
        return out

    # ----- life cycle -------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Process id of each rank."""
        self._pids = [pid for _, _, pid in self.call("ping", dispatch="all")]
        return list(self._pids)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """``destroy()`` every rank (best effort), then kill the actors. The pool stays reserved."""
        if not self.actors:
            return
        try:
            ray.wait(
                [a.destroy.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s
            )
        except Exception:  # noqa: BLE001 - a dead rank must not stop the others from being killed
            pass
        self.kill()

    def kill(self) -> None:
        """End every rank now: its calls in flight fail; nothing is saved or destroyed (a stop)."""
        self._kill()

    def __repr__(self) -> str:
        return (
            f"WorkerGroup(role={self.role!r}, cls={self.cls.__name__}, world_size={self.world_size}, "
            f"device={self.device})"
        )
