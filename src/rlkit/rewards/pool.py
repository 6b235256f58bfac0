"""``ScorePool``: score functions run in child processes, each call with a timeout; a hung child is killed.

    pool = ScorePool(fn, num_workers=1)
    results = pool.run([args_0, args_1, ...], timeout_s=10.0)  # [(status, value)]; ok | error | timeout
    pool.close()

Each task is one call ``fn(*args)`` in a worker process. A worker gets its tasks in one chunk and
answers in one message (one pipe round trip per chunk, not per task); it marks in shared memory when
each task starts and how many are done, so the driver times every task on its own. A call that runs
past ``timeout_s`` is stopped by killing its worker (SIGTERM, then SIGKILL), which is replaced (the
rest of its chunk is scored again by a worker); a worker that dies is replaced too. So a hanging call
costs at most ``timeout_s`` of one worker's time.

Workers start at the first ``run`` and are kept between calls. On Linux they are forked, so they
inherit ``fn`` as it is (even a function loaded from a file by ``reward.custom_score``), ignore
SIGINT (the driver decides when a run stops; Ctrl-C in a terminal reaches the whole process group)
and die with the driver (``PR_SET_PDEATHSIG``), so no scorer outlives a killed run. With
``mp_context="spawn"`` (the only choice on macOS/Windows) ``fn`` must be picklable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
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


def _worker_main(conn: Connection, fn: Callable[..., Any], parent_pid: int, started: Any, done: Any) -> None:
    """Loop: receive a chunk ``[(i, args), ...]``, score it, send back ``[(i, "ok", value) or (i, "error",
    message), ...]`` in one message; ``None`` stops. ``started`` / ``done`` (shared memory) tell the
    driver when the current task started and how many of the chunk are done, without a message each."""
    _detach_from_driver_signals(parent_pid)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        replies = []
        for n, (i, args) in enumerate(chunk):
            started.value = time.monotonic()
            try:
                replies.append((i, "ok", fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
                replies.append((i, "error", f"raised {type(exc).__name__}: {exc}"))
            done.value = n + 1
        try:
            conn.send(replies)
        except Exception:  # noqa: BLE001 - an unpicklable return value: send the others, name that one
            conn.send([_picklable(reply) for reply in replies])


def _picklable(reply: tuple[int, str, Any]) -> tuple[int, str, Any]:
    try:
        pickle.dumps(reply)
        return reply
    except Exception as exc:  # noqa: BLE001
        return reply[0], "error", f"returned a value that cannot be sent back ({type(exc).__name__}: {exc})"


class _Worker:
    def __init__(self, ctx: Any, fn: Callable[..., Any]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.started = ctx.Value("d", 0.0, lock=False)  # time.monotonic() when its current task started
        self.done = ctx.Value("i", 0, lock=False)  # tasks of its current chunk done
        self.process = ctx.Process(
            target=_worker_main,
            args=(child, fn, os.getpid(), self.started, self.done),
            daemon=True,
            name="rlkit-reward",
        )
        self.process.start()
        child.close()
        self.tasks: list[int] = []  # the chunk it is scoring (task ids); empty when idle
        self.seen_done = 0  # ``done`` at the driver's last look

    def send(self, chunk: list[int], tasks: list[tuple]) -> None:
        self.started.value, self.done.value, self.seen_done = time.monotonic(), 0, 0
        self.conn.send([(i, tasks[i]) for i in chunk])
        self.tasks = chunk

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
            raise RlkitError(f"reward.manager.num_workers must be >= 1, got {num_workers}.")
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
        """Each idle worker gets a chunk of the tasks in one message and answers in one message; each task
        has ``timeout_s`` from its own start. A task that runs longer gets ``timeout``: its worker is
        killed and replaced, and the rest of its chunk (done or not; the answers died with it) is sent
        again."""
        while len(self.workers) < self.num_workers:
            self.workers.append(_Worker(self.ctx, self.fn))
        for worker in list(self.workers):
            if not worker.process.is_alive() or worker.tasks:  # dead, or left busy by an interrupt
                self._replace(worker)
        results: list[tuple[str, Any] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or any(w.tasks for w in self.workers):
            idle = [w for w in self.workers if not w.tasks]
            for n, worker in enumerate(idle):
                if pending:
                    # ceil: spread what is left over the idle workers
                    size = -(-len(pending) // (len(idle) - n))
                    chunk = [pending.popleft() for _ in range(size)]
                    try:
                        worker.send(chunk, tasks)
                    except (OSError, ValueError):  # the worker died while idle: replace, retry once
                        self._replace(worker).send(chunk, tasks)
            busy = [w for w in self.workers if w.tasks]
            wait_s = max(0.0, min(w.started.value for w in busy) + timeout_s - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=wait_s))
            for worker in busy:
                if worker.conn in ready:
                    try:
                        for i, status, value in worker.conn.recv():
                            results[i] = (status, value)
                        worker.tasks = []
                        continue
                    except (EOFError, OSError):
                        self._lost(
                            worker,
                            results,
                            pending,
                            "error",
                            f"the worker process died while scoring (exit code {worker.process.exitcode})",
                        )
                        continue
                done = worker.done.value
                if done == worker.seen_done and time.monotonic() >= worker.started.value + timeout_s:
                    self._lost(
                        worker,
                        results,
                        pending,
                        "timeout",
                        f"did not return within reward.timeout_s={timeout_s:g} s",
                    )
                worker.seen_done = done
        return results  # type: ignore[return-value]

    def _lost(self, worker: _Worker, results: list, pending: deque[int], status: str, message: str) -> None:
        """The worker's running task failed (``status``); kill it, send the rest of its chunk again."""
        worker.kill()
        chunk, worker.tasks = worker.tasks, []
        done = min(worker.done.value, len(chunk) - 1)  # read after the kill: final
        results[chunk[done]] = (status, message)
        pending.extendleft(reversed(chunk[:done] + chunk[done + 1 :]))
        self._replace(worker)

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
