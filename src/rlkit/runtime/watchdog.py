"""No silent hang: a driver thread that says which phase is slow and which ranks it still waits on.

    watch = PhaseWatch(lambda: runtime.groups, recipe.trainer.watchdog)
    watch.start()
    timer = Timer(on_enter=watch.enter, on_exit=watch.exit)   # the trainer's phases
    ...
    watch.stop()

Every ``poll_s`` the thread looks at the innermost running phase (``gen``, ``reward``,
``update_actor``, ``validate``, ``save``, ...):

- **Slow phase.** A phase that has run longer than ``max(slow_min_s, slow_factor × median)`` of its
  last runs (``first_slow_s`` while it has fewer than ``MIN_HISTORY`` finished runs) is reported
  once, then again each time its running time doubles: the phase, the step, how long, the
  comparison, and for every worker call in flight the role, the method, the ranks that answered,
  the ranks still working, and where each of those is (``WorkerGroup.probe``).
- **Worker not answering.** A call whose ranks have not answered for ``ping_after_s`` gets a
  liveness ping on those ranks (every ``ping_after_s``); a rank that does not answer within
  ``ping_timeout_s`` is reported with its role, rank and pid: it is hung (stuck holding the GIL,
  stopped, or its node is gone), not merely busy. A rank whose process died ends the wait with a
  ``WorkerError`` (``WorkerGroup``), which is not the watchdog's job.

The watchdog only reports; it never stops the run (Ctrl-C does, see ``rlkit.runtime.stop``).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PhaseWatch", "slow_limit", "MIN_HISTORY"]

log = logging.getLogger("rlkit.runtime.watchdog")

MIN_HISTORY = 3  # finished runs of a phase before its median is trusted
HISTORY = 10  # runs of a phase the median is taken over
IGNORED = ("step",)  # the sum of the other phases: never the one to name


def slow_limit(history: list[float], *, factor: float, min_s: float, first_s: float) -> tuple[float, str]:
    """Seconds after which a phase with these past durations is slow, and why (for the report).

    With 3 finished runs of 4 s each, factor 5 and min 60 s: 5 × 4 = 20 s < 60 s, so the limit is 60 s.
    """
    if len(history) < MIN_HISTORY:
        return (
            first_s,
            f"it has {len(history)} earlier run(s), so the first-run limit of {first_s:g} s applies",
        )
    median = statistics.median(history)
    limit = max(min_s, factor * median)
    return (
        limit,
        f"over {limit:g} s = max({min_s:g} s, {factor:g} × its median {median:.3g} s of the last "
        f"{len(history)} runs)",
    )


@dataclass
class _Running:
    phase: str
    step: int
    started: float = field(default_factory=time.monotonic)
    next_report: float = 0.0  # seconds of running time at which to report (again)


class PhaseWatch:
    """See the module docstring. ``config`` has ``slow_factor``, ``slow_min_s``, ``first_slow_s``,
    ``ping_after_s``, ``ping_timeout_s`` (``trainer.watchdog``)."""

    def __init__(self, groups: Callable[[], list[Any]], config: Any, *, poll_s: float = 0.5):
        self.groups = groups
        self.config = config
        self.poll_s = poll_s
        self.step = 0
        self._stack: list[_Running] = []
        self._history: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=HISTORY))
        # (id of the in-flight call, rank) -> when pinged last
        self._pinged: dict[tuple[int, int], float] = {}
        self._reported_hung: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- phases (called by the trainer's Timer, main thread) ---------------------------------
    def enter(self, phase: str) -> None:
        if phase not in IGNORED:
            self._stack.append(_Running(phase, self.step))

    def exit(self, phase: str, seconds: float) -> None:
        if phase in IGNORED:
            return
        if self._stack and self._stack[-1].phase == phase:
            self._stack.pop()
        self._history[phase].append(seconds)

    def where(self) -> str:
        """``" during phase 'gen' of step 3"``, or ``""`` outside any phase."""
        running = self._stack[-1] if self._stack else None
        return f" during phase '{running.phase}' of step {running.step}" if running else ""

    # ----- the thread ----------------------------------------------------------------------------
    def start(self) -> PhaseWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="rlkit-watchdog")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the watchdog must never take the run down
                log.debug("watchdog check failed: %s", exc)

    def check(self) -> None:
        """One look: report a slow phase, ping ranks that have been silent for ``ping_after_s``."""
        running = self._stack[-1] if self._stack else None
        if running is not None:
            elapsed = time.monotonic() - running.started
            cfg = self.config
            limit, why = slow_limit(
                list(self._history[running.phase]),
                factor=cfg.slow_factor,
                min_s=cfg.slow_min_s,
                first_s=cfg.first_slow_s,
            )
            if elapsed > max(limit, running.next_report):
                running.next_report = 2 * elapsed
                log.warning(
                    "phase '%s' of step %d has run %.0f s, %s.%s",
                    running.phase,
                    running.step,
                    elapsed,
                    why,
                    self._waiting_on(probe=True),
                )
        self._ping_silent_ranks()

    def _waiting_on(self, probe: bool) -> str:
        """What the driver waits for now: per call in flight, the ranks that answered and where the others
        are."""
        lines = []
        for group in self.groups():
            for call in group.in_flight():
                waiting = call.waiting
                done = sorted(call.answered)
                lines.append(
                    f"\n  role '{group.role}', method "
                    f"'{call.method}' "
                    f"({time.monotonic() - call.started:.0f} "
                    f"s): rank(s) {waiting} still working" + (f", rank(s) {done} answered" if done else "")
                )
                if probe and waiting:
                    for rank, state in group.probe(waiting, self.config.ping_timeout_s).items():
                        lines.append(f"\n    rank {rank}: {_describe(state, self.config.ping_timeout_s)}")
        return "".join(lines) or " The driver is not waiting on any worker (it is working itself)."

    def _ping_silent_ranks(self) -> None:
        now = time.monotonic()
        for group in self.groups():
            for call in group.in_flight():
                if now - call.started < self.config.ping_after_s or not call.waiting:
                    continue
                due = [
                    r
                    for r in call.waiting
                    if now - self._pinged.get((id(call), r), call.started) >= self.config.ping_after_s
                    and (id(call), r) not in self._reported_hung
                ]
                if not due:
                    continue
                for rank in due:
                    self._pinged[(id(call), rank)] = now
                for rank, state in group.probe(due, self.config.ping_timeout_s).items():
                    if state["state"] != "alive":
                        self._reported_hung.add((id(call), rank))
                        log.warning(
                            "role '%s', rank %d %s, while the driver has waited %.0f s for its '%s'. "
                            "Ctrl-C stops the run (a resume continues from the last checkpoint).",
                            group.role,
                            rank,
                            _describe(state, self.config.ping_timeout_s),
                            now - call.started,
                            call.method,
                        )


def _describe(state: dict[str, Any], timeout_s: float) -> str:
    if state["state"] == "alive":
        where = f", running '{state['method']}' at {state['at']}" if state.get("method") else ", idle"
        return f"answers a liveness ping (pid {state['pid']}{where})"
    if state["state"] == "dead":
        return f"is dead ({state.get('error')})"
    pid = f" (pid {state['pid']})" if state.get("pid") else ""
    return (
        f"does not answer a liveness ping within {timeout_s:g} s{pid}: it is hung (stuck holding the GIL, "
        f"stopped, or its node is unreachable)"
    )
