"""Fault injection for the reliability tests: ``RLKIT_FAULT=<phase>:<step>[,<phase>:<step>...]``.

The trainer calls ``arm()`` once when it starts; afterwards ``maybe_fail(phase, step)`` and
``poisoned(kind, step)`` are a dictionary-membership test (nothing at all when the variable is unset).
``step`` is the global step being run (or saved); ``*`` matches every step.

Kill points (the driver SIGKILLs itself, as a preemption or OOM kill would)::

    gen                before the rollout of the step
    reward             before scoring
    update_actor       before the actor update
    sync_weights       after the update, before the rollout gets the new weights
    logged             after the step's metrics were logged, before its checkpoint
    checkpoint_write   inside the checkpoint writer: workers wrote their shards, COMPLETE not yet written
    checkpoint_publish COMPLETE written in the temporary folder, not yet renamed into place

Poison (the run goes on with a bad value, as a numerical blow-up would)::

    nan_adv / inf_adv  the step's advantages become NaN / +inf before the actor update, so the actor's
                       loss and gradient are non-finite (skipped and counted in actor/nonfinite_skips)

Not for production use; an unknown phase is refused so a typo cannot silently test nothing.
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV", "KILL_PHASES", "POISONS", "arm", "maybe_fail", "poison", "poisoned", "parse"]

ENV = "RLKIT_FAULT"
KILL_PHASES = ("gen", "reward", "update_actor", "sync_weights", "logged", "checkpoint_write", "checkpoint_publish")
POISONS = ("nan_adv", "inf_adv")

_plan: dict[str, set[str]] = {}  # phase -> steps ("*" = every step); empty = no faults


def parse(spec: str) -> dict[str, set[str]]:
    """``"gen:3,nan_adv:*"`` → ``{"gen": {"3"}, "nan_adv": {"*"}}``; raises ValueError on a bad entry."""
    plan: dict[str, set[str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        phase, _, step = item.partition(":")
        if phase not in KILL_PHASES + POISONS or not (step == "*" or step.isdigit()):
            raise ValueError(
                f"{ENV}={spec!r}: bad entry {item!r}; use <phase>:<step> with a phase of "
                f"{', '.join(KILL_PHASES + POISONS)} and a step number or '*'."
            )
        plan.setdefault(phase, set()).add(step if step == "*" else str(int(step)))
    return plan


def arm(spec: str | None = None) -> None:
    """Read ``RLKIT_FAULT`` (or ``spec``) once; an empty value disarms every fault."""
    global _plan
    _plan = parse(spec if spec is not None else os.environ.get(ENV, ""))


def _matches(phase: str, step: int) -> bool:
    steps = _plan.get(phase)
    return bool(steps) and ("*" in steps or str(step) in steps)


def maybe_fail(phase: str, step: int) -> None:
    """SIGKILL this process when ``phase:step`` is armed."""
    if _plan and _matches(phase, step):
        os.kill(os.getpid(), signal.SIGKILL)


def poisoned(kind: str, step: int) -> bool:
    """Whether the value ``kind`` (``nan_adv``, ``inf_adv``) is to be poisoned at ``step``."""
    return bool(_plan) and _matches(kind, step)


def poison(batch, step: int):
    """The batch with its ``advantages`` made NaN / +inf when ``nan_adv`` / ``inf_adv`` is armed at ``step``."""
    import torch

    for kind, value in (("nan_adv", float("nan")), ("inf_adv", float("inf"))):
        if poisoned(kind, step):
            batch["advantages"] = torch.full_like(batch["advantages"], value)
    return batch
