"""Stopping ``rlkit run`` on SIGINT (Ctrl-C) or SIGTERM: within seconds, without a partial checkpoint.

    stopper = StopHandler().install()      # main thread, for the life of the run
    stopper.track(runtime.owned_processes) # what a hard stop kills
    ...                                    # the first signal raises RunInterrupted here
    stopper.restore()

**First signal.** ``RunInterrupted`` (a ``KeyboardInterrupt``) is raised in the main thread, wherever
it waits (worker waits are sliced so they see it within 0.25 s; the scoring pipe and file writes see
it at once). Unwinding does the clean stop: the checkpoint writer removes its temporary folder (no
``global_step_N`` is published), the CLI prints which checkpoint a resume will use, the runtime kills
the worker actors, marks the tracking run KILLED, stops Ray and then every process the run recorded
(SIGTERM, then SIGKILL). The exit code is 128 + the signal: 130 for SIGINT, 143 for SIGTERM.

**Deadline.** The first signal also starts a timer: if the clean stop has not finished after
``grace_s`` (default 4 s), the run's recorded processes are SIGKILLed and the process exits.

**Second signal.** Immediate: SIGKILL every recorded process, exit with the first signal's code.

The deadline and the second signal are handled by a helper thread woken through
``signal.set_wakeup_fd``, so they work even while the main thread is stuck inside a C call (where
Python signal handlers cannot run).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from rlkit.workers.reaper import kill_processes

__all__ = ["RunInterrupted", "StopHandler", "SIGNALS"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """A stop signal arrived; ``exit_code`` is 128 + ``signum`` (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class StopHandler:
    """SIGINT/SIGTERM handling for one ``rlkit run`` (see the module docstring)."""

    def __init__(self, grace_s: float = 4.0, stream: TextIO | None = None):
        self.grace_s = grace_s
        self.stream = stream or sys.stderr
        self.signum: int | None = None
        self._owned: Callable[[], Iterable[Any]] | None = None
        self._resume_hint: Callable[[], str] | None = None
        self._where: Callable[[], str] = lambda: ""
        self._announced = False
        self._raised = False
        self._seen = 0  # signals the helper thread has read
        self._lock = threading.RLock()  # the main thread's signal handler may interrupt a holder
        self._deadline: threading.Timer | None = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None

    # ----- set-up -----------------------------------------------------------------------------
    def install(self) -> StopHandler:
        """Install the handlers (main thread only; elsewhere this is a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._old_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="rlkit-stop").start()
        return self

    @property
    def installed(self) -> bool:
        return self._pipe is not None

    @property
    def exit_code(self) -> int:
        """128 + the first signal (130 when none was seen: a plain KeyboardInterrupt)."""
        return 128 + (self.signum or signal.SIGINT)

    def restore(self) -> None:
        """Put the previous handlers back (the helper thread ends)."""
        if self._pipe is None:
            return
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._old_wakeup_fd)
        if self._deadline is not None:
            self._deadline.cancel()
        os.close(self._pipe[1])  # the helper thread reads EOF and ends; it closes the read end
        self._pipe = None

    def track(self, owned: Callable[[], Iterable[Any]]) -> None:
        """``owned()`` lists the ``psutil.Process`` objects a hard stop kills (Ray's processes, workers).

        Called once Ray is up; it also takes SIGTERM back: ``ray.init`` installs its own SIGTERM handler
        in the driver (it prints a stack trace and ends the process without any clean-up)."""
        self._owned = owned
        if self._pipe is not None:
            for signum in SIGNALS:
                signal.signal(signum, self._on_signal)

    def set_resume_hint(self, hint: Callable[[], str]) -> None:
        self._resume_hint = hint

    def set_where(self, where: Callable[[], str]) -> None:
        """``where()`` names the running phase in the stop message (e.g. ``" during phase 'gen' of step
        3"``)."""
        self._where = where

    # ----- what happens on a signal -----------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        """Python-level handler (main thread): the first signal raises, later ones are the helper's."""
        self._first(signum)
        if not self._raised:
            self._raised = True
            raise RunInterrupted(signum)

    def _first(self, signum: int) -> None:
        with self._lock:
            if self.signum is not None:
                return
            self.signum = signum
            self._deadline = threading.Timer(
                self.grace_s, self._hard_stop, args=(f"did not stop within {self.grace_s:g} s",)
            )
            self._deadline.daemon = True
            self._deadline.start()
        name = signal.Signals(signum).name
        try:
            where = self._where()
        except Exception:  # noqa: BLE001
            where = ""
        self._say(
            f"rlkit: {name} received{where}; stopping (killing the workers' calls in flight). "
            f"{'Press Ctrl-C again' if signum == signal.SIGINT else 'Send it again'} to kill at once."
        )

    def _watch(self, read_fd: int) -> None:
        """Helper thread: one byte per signal from the wakeup fd; the second signal is a hard stop."""
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:
                    return
                for signum in data:
                    if signum not in SIGNALS:
                        continue
                    self._seen += 1
                    if self._seen == 1:
                        self._first(signum)
                    else:
                        self._hard_stop(f"{signal.Signals(signum).name} received again")
        finally:
            os.close(read_fd)

    def announce(self) -> None:
        """Print, once, which checkpoint a resume will use."""
        with self._lock:
            if self._announced or self._resume_hint is None:
                return
            self._announced = True
        try:
            self._say(f"rlkit: {self._resume_hint()}")
        except Exception as exc:  # noqa: BLE001 - a stop must not fail on its message
            self._say(f"rlkit: could not tell which checkpoint a resume will use ({exc}).")

    def _hard_stop(self, why: str) -> None:
        """SIGKILL what the run owns and exit now (from the helper thread or the deadline timer)."""
        code = self.exit_code
        self._say(f"rlkit: {why}; killing the run's processes and exiting.")
        try:
            killed = kill_processes(list(self._owned() if self._owned else []), grace_s=0)
            if killed:
                self._say(f"rlkit: killed {len(killed)} process(es) of the run: {killed}")
        except Exception as exc:  # noqa: BLE001
            self._say(f"rlkit: could not kill every process of the run ({exc}).")
        self.announce()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)

    def _say(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except Exception:  # noqa: BLE001 - a closed stream
            pass
