"""The C allocator of rlkit's worker processes (``resources.allocator``).

An update allocates and frees the same large tensors at every step (activations, the [V, H] gradients).
glibc's defaults hand much of that memory back to the kernel when it is freed (blocks it served by ``mmap``,
the heap's top past its trim threshold), so the next step faults the pages in again: 110,000–420,000 minor
faults per worker step of a 2 × 4 × 256 SmolLM2 GRPO step, and 720,000–890,000 at the second step, which cost
5–6 s of it (docs/benchmarks.md, "The workers' allocator keeps freed memory"). ``keep_freed`` starts the
workers with ``GLIBC_TUNABLES`` set to one arena, no ``mmap``'d blocks and no heap trim
(``KEEP_FREED_TUNABLES``): freed memory stays in the process for the next step, which then takes almost no
faults. The process keeps the memory of its largest step (which it needs again at every step).

* ``auto``: ``keep_freed`` for CPU workers of a local cluster where this Python runs on glibc, unless
  ``GLIBC_TUNABLES`` is already set (the local cluster's workers inherit the driver's); else ``system``.
* ``keep_freed``: set (it replaces an inherited ``GLIBC_TUNABLES`` in the workers); refused at validation
  where a local cluster's C library is not glibc (``keep_freed_unavailable``): the variable would do nothing.
* ``system``: the workers' environment is left as it is.

The variable reaches the workers through Ray's ``runtime_env`` (set before the process starts, where glibc
reads it); ``rlkit.runtime.build`` asks each worker whether it started with it (``Worker.started_with``).
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "KEEP_FREED_TUNABLES",
    "AllocatorPlan",
    "check_workers",
    "keep_freed_unavailable",
    "plan_allocator",
]

log = logging.getLogger("rlkit.hardware.allocator")

KEEP_FREED_TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
)


def keep_freed_unavailable(local: bool, libc: str | None = None) -> str | None:
    """Why ``resources.allocator: keep_freed`` cannot work here (a local cluster's workers share this
    Python's C library, and the variable does nothing outside glibc), or None (``rlkit.recipe.rules``)."""
    libc = platform.libc_ver()[0] if libc is None else libc
    if local and libc != "glibc":
        return (
            "keep_freed sets glibc's malloc tunables, but this machine's C library is "
            f"{libc or 'not glibc'}; set resources.allocator=system (or auto)"
        )
    return None


@dataclass(frozen=True)
class AllocatorPlan:
    name: str  # "keep_freed" | "system"
    reason: str  # one line
    env: dict[str, str] = field(default_factory=dict)  # what the workers start with


def plan_allocator(
    setting: str,
    device: str,
    *,
    local: bool,
    libc: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> AllocatorPlan:
    """The workers' allocator for ``resources.allocator`` = ``setting`` (module docstring): ``device`` the
    run's resolved device, ``local`` whether rlkit starts the Ray cluster here; ``libc`` (default: this
    Python's, ``platform.libc_ver``) and ``environ`` (default ``os.environ``) for tests."""
    libc = platform.libc_ver()[0] if libc is None else libc
    environ = os.environ if environ is None else environ
    keep = AllocatorPlan(
        "keep_freed",
        f"GLIBC_TUNABLES={KEEP_FREED_TUNABLES} (freed memory stays in the worker for the next step)",
        {"GLIBC_TUNABLES": KEEP_FREED_TUNABLES},
    )
    if setting == "system":
        return AllocatorPlan("system", "set in the recipe (resources.allocator: system)")
    if setting == "keep_freed":  # where it cannot work, validation refused it (keep_freed_unavailable)
        return keep
    if device != "cpu":
        return AllocatorPlan("system", f"auto: {device} workers (the update's memory is the device's)")
    if not local:
        return AllocatorPlan(
            "system", "auto: a remote Ray cluster (its workers' C library is not known here)"
        )
    if libc != "glibc":
        return AllocatorPlan("system", f"auto: the C library is {libc or 'not glibc'}")
    if "GLIBC_TUNABLES" in environ:
        return AllocatorPlan("system", "auto: GLIBC_TUNABLES is set here, and the workers inherit it")
    return AllocatorPlan(keep.name, "auto: CPU workers on glibc; " + keep.reason, keep.env)


def check_workers(plan: AllocatorPlan, groups: Iterable) -> tuple[str, AllocatorPlan]:
    """(``resolved.allocator_in_workers``: ``yes`` or the ranks that did not start with the plan's variable,
    the plan as it took effect) for the started worker ``groups`` (``rlkit.workers.WorkerGroup``), each rank
    asked ``Worker.started_with``; a rank without it (a cluster whose workers ignore ``runtime_env``) is
    warned about, and the plan becomes ``system``."""
    name = next(iter(plan.env))
    missing = [
        f"{group.role} rank {rank}"
        for group in groups
        for rank, started in enumerate(group.call("started_with", name, dispatch="all"))
        if not started
    ]
    if not missing:
        return "yes", plan
    ranks = ", ".join(missing)
    log.warning(
        "resources.allocator %s: %s started without %s; their allocator is the system's",
        plan.name,
        ranks,
        name,
    )
    return f"no: {ranks}", AllocatorPlan("system", f"{plan.name} asked, but {ranks} started without {name}")
