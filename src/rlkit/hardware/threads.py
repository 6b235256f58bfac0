"""Threads per worker, a machine crowded by the run or by other work, and one run's hardware plan.

Threads (``resources.threads_per_worker: auto``): the CPUs Ray gives a worker, ``floor(cpus_per_bundle ×
share)``, at least 1. ``oversubscription`` says, with numbers, when the machine has fewer cores than the
run asks for or is already busy. ``plan_run`` resolves both and the precision once, on the driver
(``rlkit.runtime.build``)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlkit.hardware.allocator import AllocatorPlan, plan_allocator
from rlkit.hardware.cpu import log, usable_cpus
from rlkit.hardware.packed_probe import Layer
from rlkit.hardware.precision import ResolvedPrecision, resolve_precision

__all__ = [
    "worker_threads",
    "oversubscription",
    "RunHardware",
    "plan_run",
    "warn_once",
]


def worker_threads(requested: int | str, cpus_per_bundle: float, share: float = 1.0) -> int:
    """``auto`` → the CPUs Ray gives the worker: ``floor(cpus_per_bundle × share)``, at least 1."""
    if requested == "auto":
        return max(1, math.floor(cpus_per_bundle * share + 1e-9))
    return int(requested)


def oversubscription(
    *, pool_cpus: float, worker_threads_total: int, cores: int | None = None, load_1min: float | None = None
) -> str | None:
    """One line with the numbers when the run asks for more CPUs or threads than there are cores, or the
    machine is already busy (1-minute load above the cores); None when it fits."""
    cores = cores or usable_cpus()
    if load_1min is None:
        try:
            load_1min = os.getloadavg()[0]
        except OSError:
            load_1min = 0.0
    problems = []
    if pool_cpus > cores:
        problems.append(f"the resource pools reserve {pool_cpus:g} CPUs")
    if worker_threads_total > cores:
        problems.append(f"the workers run {worker_threads_total} torch threads")
    if load_1min > cores:
        problems.append(f"the 1-minute load average is already {load_1min:.1f}")
    if not problems:
        return None
    return (
        f"this machine has {cores} usable cores but "
        + " and ".join(problems)
        + ": threads will wait for each "
        "other and steps will be slower (torch's threads spin against other busy processes). Lower "
        "resources.pools.*.cpus_per_bundle / threads_per_worker, or stop the other work."
    )


@dataclass(frozen=True)
class RunHardware:
    """What a run's ``auto`` settings became on this machine (``rlkit.runtime.build`` builds it once, on the
    driver)."""

    precision: ResolvedPrecision
    threads: dict[str, int]  # role -> torch threads per worker process
    oversubscribed: str | None  # the warning, or None
    allocator: AllocatorPlan  # the workers' C allocator

    def params(self) -> dict[str, Any]:
        """Run parameters, logged under ``resolved.``."""
        threads = {f"threads_per_worker.{role}": n for role, n in self.threads.items()}
        allocator = {"allocator": self.allocator.name, "allocator_reason": self.allocator.reason}
        return self.precision.params() | threads | allocator

    def summary(self) -> str:
        """The line printed at start."""
        p = self.precision
        mark = {
            k: " (set in the recipe)" if k in p.explicit else "" for k in ("mixed_precision", "decode_dtype")
        }
        decode = f", rollout decode {p.decode_dtype}{mark['decode_dtype']}" if p.decode_dtype else ""
        decode += " on onnxruntime linears" if p.decode_linears == "onnxruntime" else ""
        threads = ", ".join(f"{role} {n}" for role, n in self.threads.items())
        return (
            f"rlkit: precision {p.mixed_precision}{mark['mixed_precision']}{decode}; torch threads per "
            f"worker: {threads}; workers' allocator {self.allocator.name}. auto: {p.decision.reason}"
            + (f"; decode: {p.decode_reason}" if p.decode_reason else "")
            + (f"; linears: {p.linears_reason}" if p.linears_reason else "")
        )


def plan_run(
    recipe: Any,
    *,
    device: str,
    placed: Mapping[str, str],
    decode_dtype: str | None,
    layer: Callable[[], Layer | None] | None = None,
    decode_linears: str | None = None,
    graph: Callable[[int, bool], tuple[str, str, str] | None] | None = None,
) -> RunHardware:
    """Resolve ``recipe``'s ``auto`` precision and threads for ``device``; ``layer``: the model's decoder
    layer shapes, asked only where ``auto`` weighs fp16 decode weights (``rlkit.hardware.fp16``; None: the
    rollout backend has none, the hf backend's fbgemm path).

    ``placed``: step slot → pool of every role the run builds (``Pipeline.roles``); roles on one pool
    share its bundles equally, as ``rlkit.runtime.build`` places them. ``decode_dtype``: the rollout backend's
    requested decode dtype (``auto`` / ``float32`` / ``bfloat16``), None when the backend has no such
    option; ``decode_linears`` its requested CPU decode linears (``auto`` / ``torch`` / ``onnxruntime``), the
    same; ``graph``: the one-graph decode step's choice (``resolve_precision``), None where the model has
    none."""
    res = recipe.resources
    per_pool: dict[str, int] = {}
    for pool in placed.values():
        per_pool[pool] = per_pool.get(pool, 0) + 1
    shares = {slot: 1.0 / per_pool[pool] for slot, pool in placed.items()}
    threads = {
        slot: worker_threads(res.threads_per_worker, res.pools[placed[slot]].cpus_per_bundle, share)
        for slot, share in shares.items()
    }
    warning = None
    if res.ray_address is None:  # a local cluster: the workers run on this machine's cores
        pools = res.pools
        ranks = {slot: pools[placed[slot]].nodes * pools[placed[slot]].bundles_per_node for slot in shares}
        warning = oversubscription(
            pool_cpus=sum(p.nodes * p.bundles_per_node * p.cpus_per_bundle for p in pools.values()),
            worker_threads_total=sum(threads[slot] * ranks[slot] for slot in shares),
        )
    precision = resolve_precision(
        recipe.actor.mixed_precision,
        decode_dtype,
        device,
        max_new_tokens=recipe.data.max_response_length,
        layer=layer,
        linears=decode_linears,
        graph=graph,
    )
    allocator = plan_allocator(res.allocator, device, local=res.ray_address is None)
    return RunHardware(precision=precision, threads=threads, oversubscribed=warning, allocator=allocator)


_warned: set[str] = set()


def warn_once(kind: str, message: str | None) -> None:
    """Log ``message`` as a warning the first time this process sees ``kind`` (restarts do not repeat it)."""
    if message and kind not in _warned:
        _warned.add(kind)
        log.warning(message)
