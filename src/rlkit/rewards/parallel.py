"""The ``parallel`` reward manager: score functions run in worker processes with a per-sample timeout.

A worker whose sample runs past ``timeout_s`` is killed (SIGTERM, then SIGKILL) and replaced, and the
sample gets ``default_score`` (counted in ``reward/timeouts``); a worker that dies is replaced too
(counted in ``reward/errors``). So a hanging scorer costs at most ``timeout_s`` of one worker's time:
a batch with one hanging sample returns after about ``timeout_s``, and in the worst case (every sample
hangs) after ``ceil(B / num_workers) * timeout_s``.

Workers are started on the first call and kept between calls (``close()`` stops them). By default
they are forked (Linux), so they inherit the score function as it is, even one loaded from a file by
``reward.custom_score``; with ``mp_context="spawn"`` (the only choice on macOS/Windows) the score
function must be picklable (importable by module name).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from rlkit.errors import RlkitError
from rlkit.rewards.managers import NaiveRewardManager, ScoreOutcome, normalize_score

__all__ = ["ParallelRewardManager", "ScorePool"]


def _worker_main(conn: Connection, score_fn: Callable[..., Any]) -> None:
    """Loop: receive ``(i, args)``, send ``(i, "ok", value)`` or ``(i, "error", message)``; ``None`` stops."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        i, args = message
        try:
            reply = (i, "ok", score_fn(*args))
        except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
            reply = (i, "error", f"raised {type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send((i, "error", f"returned a value that cannot be sent back ({type(exc).__name__}: {exc})"))


class _Worker:
    def __init__(self, ctx: Any, score_fn: Callable[..., Any]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, score_fn), daemon=True, name="rlkit-reward")
        self.process.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(0.5)
            if self.process.is_alive():
                self.process.kill()
        self.process.join(0.5)
        self.conn.close()


class ScorePool:
    """``num_workers`` processes running ``score_fn``; ``run(tasks, timeout_s)`` returns one
    ``(status, value)`` per task, in order, with status ``ok``, ``error`` or ``timeout``."""

    def __init__(self, score_fn: Callable[..., Any], num_workers: int, mp_context: str | None = None):
        if num_workers < 1:
            raise RlkitError(f"reward.num_workers must be >= 1, got {num_workers}.")
        if mp_context is None:
            mp_context = "fork" if sys.platform.startswith("linux") else "spawn"
        self.ctx = mp.get_context(mp_context)
        self.score_fn = score_fn
        self.num_workers = num_workers
        self.workers: list[_Worker] = []

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.ctx, self.score_fn)
        self.workers[self.workers.index(worker)] = fresh
        return fresh

    def run(self, tasks: list[tuple], timeout_s: float) -> list[tuple[str, Any]]:
        while len(self.workers) < self.num_workers:
            self.workers.append(_Worker(self.ctx, self.score_fn))
        for worker in list(self.workers):
            if not worker.process.is_alive():
                self._replace(worker)
        results: list[tuple[str, Any] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or any(w.task is not None for w in self.workers):
            for worker in list(self.workers):
                if worker.task is None and pending:
                    i = pending.popleft()
                    try:
                        worker.conn.send((i, tasks[i]))
                    except (OSError, ValueError):  # the worker died while idle: replace, retry once
                        worker = self._replace(worker)
                        worker.conn.send((i, tasks[i]))
                    worker.task, worker.deadline = i, time.monotonic() + timeout_s
            busy = [w for w in self.workers if w.task is not None]
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=wait_s))
            for worker in busy:
                i = worker.task
                if worker.conn in ready:
                    try:
                        _, status, value = worker.conn.recv()
                    except (EOFError, OSError):
                        code = worker.process.exitcode
                        results[i] = ("error", f"the worker process died while scoring (exit code {code})")
                        self._replace(worker)
                        continue
                    results[i] = (status, value)
                    worker.task = None
                elif time.monotonic() >= worker.deadline:
                    results[i] = ("timeout", f"did not return within reward.timeout_s={timeout_s:g} s")
                    self._replace(worker)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self.workers:
            worker.process.join(0.5)
            worker.kill()
        self.workers = []


class ParallelRewardManager(NaiveRewardManager):
    """``naive``'s contract, scored in a process pool with a per-sample timeout.

    Params (``ParallelManagerParams``): ``num_workers`` (default 2); the per-sample timeout is
    ``reward.timeout_s``. ``mp_context``: ``fork`` on Linux, else ``spawn``.
    """

    def __init__(self, tokenizer: Any, score_fn: Callable[..., Any] | None, *, params: Any = None,
                 mp_context: str | None = None, **kwargs: Any):
        super().__init__(tokenizer, score_fn, params=params, **kwargs)
        num_workers = params.num_workers if params is not None else 2
        self.pool = ScorePool(score_fn, int(num_workers), mp_context) if score_fn is not None else None

    def score_all(self, items: list[tuple[str, str, Any, dict | None]]) -> list[ScoreOutcome]:
        assert self.pool is not None
        outcomes = []
        for status, value in self.pool.run(items, self.timeout_s):
            if status == "ok":
                outcomes.append(normalize_score(value, self.default_score))
            else:
                outcomes.append(ScoreOutcome(self.default_score, error=value, timeout=status == "timeout"))
        return outcomes

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> ParallelRewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
