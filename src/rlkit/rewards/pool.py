"""``ScorePool``: score functions run in child processes, each call with a timeout; a hung child is killed.

    pool = ScorePool(fn, num_workers=1)
    results = pool.run([args_0, args_1, ...], timeout_s=10.0)   # [(status, value)], status ok | error | timeout
    pool.close()

Each task is one call ``fn(*args)`` in a worker process; a worker gets its tasks in one chunk and
answers each as soon as it is done (one pipe round trip per chunk, not per task). A call that runs
past ``timeout_s`` (counted from the previous answer of its worker) is
stopped by killing its worker (SIGTERM, then SIGKILL), which is replaced; a worker that dies is
replaced too. So a hanging call costs at most ``timeout_s`` of one worker's time.

Workers start at the first ``run`` and are kept between calls. On Linux they are forked, so they
inherit ``fn`` as it is (even a function loaded from a file by ``reward.custom_score``), ignore
SIGINT (the driver decides when a run stops; Ctrl-C in a terminal reaches the whole process group)
and die with the driver (``PR_SET_PDEATHSIG``), so no scorer outlives a killed run. With
``mp_context="spawn"`` (the only choice on macOS/Windows) ``fn`` must be picklable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from rlkit.errors import RlkitError

__all__ = ["ScorePool"]


def _detach_from_driver_signals(parent_pid: int) -> None:
    """In a worker: leave stopping to the driver, and die when the driver dies (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        signal.set_wakeup_fd(-1)  # a forked child must not write into the driver's signal pipe
    except ValueError:
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent_pid:  # the driver died before prctl took effect
            os._exit(1)


def _worker_main(conn: Connection, fn: Callable[..., Any], parent_pid: int) -> None:
    """Loop: receive a chunk ``[(i, args), ...]``, send ``(i, "ok", value)`` or ``(i, "error", message)`` for
    each task as soon as it is done; ``None`` stops."""
    _detach_from_driver_signals(parent_pid)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for i, args in chunk:
            try:
                reply = (i, "ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
                reply = (i, "error", f"raised {type(exc).__name__}: {exc}")
            try:
                conn.send(reply)
            except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
                conn.send((i, "error", f"returned a value that cannot be sent back ({type(exc).__name__}: {exc})"))


class _Worker:
    def __init__(self, ctx: Any, fn: Callable[..., Any]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, fn, os.getpid()), daemon=True,
                                   name="rlkit-reward")
        self.process.start()
        child.close()
        self.tasks: deque[int] = deque()  # ids sent and not answered yet; the first one is running
        self.deadline = 0.0  # when the running task times out

    def kill(self, grace_s: float = 0.5) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(grace_s)
            if self.process.is_alive():
                self.process.kill()
        self.process.join(0.5)
        self.conn.close()


class ScorePool:
    """``num_workers`` processes running ``fn``; ``run(tasks, timeout_s)`` returns one ``(status, value)``
    per task, in order, with status ``ok``, ``error`` (value: the message) or ``timeout``."""

    def __init__(self, fn: Callable[..., Any], num_workers: int = 1, mp_context: str | None = None):
        if num_workers < 1:
            raise RlkitError(f"reward.num_workers must be >= 1, got {num_workers}.")
        if mp_context is None:
            mp_context = "fork" if sys.platform.startswith("linux") else "spawn"
        self.ctx = mp.get_context(mp_context)
        self.fn = fn
        self.num_workers = num_workers
        self.workers: list[_Worker] = []
        self._timeout_s = 0.0

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.ctx, self.fn)
        self.workers[self.workers.index(worker)] = fresh
        return fresh

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    def run(self, tasks: list[tuple], timeout_s: float) -> list[tuple[str, Any]]:
        """Each worker gets a chunk of the tasks in one message and answers task by task; each task has
        ``timeout_s`` from when the previous one of its chunk answered (one pipe round trip per chunk)."""
        self._timeout_s = timeout_s
        while len(self.workers) < self.num_workers:
            self.workers.append(_Worker(self.ctx, self.fn))
        for worker in list(self.workers):
            if not worker.process.is_alive() or worker.tasks:  # dead, or left busy by an interrupt
                self._replace(worker)
        results: list[tuple[str, Any] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or any(w.tasks for w in self.workers):
            idle = [w for w in self.workers if not w.tasks]
            for worker in idle:
                if not pending:
                    break
                size = -(-len(pending) // len(idle))  # ceil: spread what is left over the idle workers
                chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                try:
                    worker.conn.send([(i, tasks[i]) for i in chunk])
                except (OSError, ValueError):  # the worker died while idle: replace, retry once
                    worker = self._replace(worker)
                    worker.conn.send([(i, tasks[i]) for i in chunk])
                worker.tasks.extend(chunk)
                worker.deadline = time.monotonic() + timeout_s
            busy = [w for w in self.workers if w.tasks]
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=wait_s))
            for worker in busy:
                if worker.conn in ready:
                    self._receive(worker, results, pending)
                elif time.monotonic() >= worker.deadline:
                    results[worker.tasks.popleft()] = ("timeout", f"did not return within reward.timeout_s={timeout_s:g} s")
                    pending.extendleft(reversed(worker.tasks))  # the rest of its chunk goes to another worker
                    worker.tasks.clear()
                    self._replace(worker)
        return results  # type: ignore[return-value]

    def _receive(self, worker: _Worker, results: list, pending: deque[int]) -> None:
        """Read every answer the worker has sent so far."""
        while worker.tasks and worker.conn.poll():
            try:
                i, status, value = worker.conn.recv()
            except (EOFError, OSError):
                code = worker.process.exitcode
                results[worker.tasks.popleft()] = ("error", f"the worker process died while scoring (exit code {code})")
                pending.extendleft(reversed(worker.tasks))
                worker.tasks.clear()
                self._replace(worker)
                return
            assert i == worker.tasks[0], (i, worker.tasks)
            worker.tasks.popleft()
            results[i] = (status, value)
            worker.deadline = time.monotonic() + self._timeout_s
    def close(self) -> None:
        """Stop every worker: idle ones are asked to exit, busy ones (a hung call) are killed at once."""
        for worker in self.workers:
            if not worker.tasks:
                try:
                    worker.conn.send(None)
                except (OSError, ValueError):
                    pass
        for worker in self.workers:
            if not worker.tasks:
                worker.process.join(0.5)
            worker.kill(grace_s=0.2)
        self.workers = []
