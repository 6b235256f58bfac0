"""Fault injection for the reliability tests, armed only by this test entry (never by the environment).

    python -m rlkit.testing.faults gen:3,nan_adv:2 -- run recipe.yaml [overrides]

parses the plan, builds ``FaultHooks`` and calls ``rlkit.cli.main(argv, hooks=...)``: the trainer and the
checkpoint writer get the hooks object as an argument (``rlkit.step.hooks.RunHooks``). Production code reads
no fault variable; a plain ``rlkit run`` cannot be made to kill itself or poison its advantages.

A plan is ``<phase>:<step>[,<phase>:<step>...]``; ``step`` is the global step being run (or saved), ``*``
matches every step.

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

An unknown phase is refused so a typo cannot silently test nothing.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from rlkit.errors import RlkitError
from rlkit.step.hooks import RunHooks

__all__ = ["KILL_PHASES", "POISONS", "FaultHooks", "FaultSpecError", "parse", "main"]

KILL_PHASES = (
    "gen",
    "reward",
    "update_actor",
    "sync_weights",
    "logged",
    "checkpoint_write",
    "checkpoint_publish",
)
POISONS = ("nan_adv", "inf_adv")
USAGE = "usage: python -m rlkit.testing.faults <phase>:<step>[,...] -- <rlkit command and arguments>"


class FaultSpecError(RlkitError):
    """A fault plan names an unknown phase or a bad step."""


def parse(spec: str) -> dict[str, set[str]]:
    """``"gen:3,nan_adv:*"`` → ``{"gen": {"3"}, "nan_adv": {"*"}}``; raises FaultSpecError on a bad entry."""
    plan: dict[str, set[str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        phase, _, step = item.partition(":")
        if phase not in KILL_PHASES + POISONS or not (step == "*" or step.isdigit()):
            raise FaultSpecError(
                f"fault plan {spec!r}: bad entry {item!r}; use <phase>:<step> with a phase of "
                f"{', '.join(KILL_PHASES + POISONS)} and a step number or '*'."
            )
        plan.setdefault(phase, set()).add(step if step == "*" else str(int(step)))
    return plan


class FaultHooks(RunHooks):
    """``RunHooks`` that SIGKILL the driver at armed kill points and poison armed advantages."""

    def __init__(self, spec: str):
        self.plan = parse(spec)

    def _matches(self, phase: str, step: int) -> bool:
        steps = self.plan.get(phase)
        return bool(steps) and ("*" in steps or str(step) in steps)

    def on_phase(self, phase: str, step: int) -> None:
        if self._matches(phase, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_checkpoint(self, phase: str, step: int) -> None:
        self.on_phase(phase, step)

    def advantages(self, advantages: Any, step: int) -> Any:
        import torch

        for kind, value in (("nan_adv", float("nan")), ("inf_adv", float("inf"))):
            if self._matches(kind, step):
                advantages = torch.full_like(advantages, value)
        return advantages


def main(argv: list[str] | None = None) -> int:
    """``PLAN -- COMMAND...``: run the rlkit command with ``FaultHooks(PLAN)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    try:
        hooks = FaultHooks(argv[0])
    except FaultSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from rlkit.cli import main as rlkit_main

    return rlkit_main(argv[2:], hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
