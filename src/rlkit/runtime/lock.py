"""One writer per output folder: ``rlkit run`` holds an exclusive ``fcntl.flock`` on
``<output_dir>/.rlkit-run.lock`` (and on a metrics file kept elsewhere) from validation to exit, with a JSON
record of the holder (pid, host, start, command) for the message a second run gets; docs/reliability.md, "One
writer per output folder".

    locks = lock_run_outputs(recipe)   # OutputBusyError naming the holder if a live run has the folder
    ...
    for lock in locks: lock.release()
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError
from rlkit.recipe import Recipe
from rlkit.runtime.build import output_dir_of

__all__ = ["LOCK_FILE", "OutputBusyError", "RunLock", "lock_run_outputs"]

log = logging.getLogger("rlkit.runtime.lock")


class OutputBusyError(RlkitError):
    """Another live run holds the output folder (or tracking file) this run would write."""


LOCK_FILE = ".rlkit-run.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLock:
    """One writer per output folder: an exclusive ``fcntl.flock`` on ``path``, which holds a JSON record of
    the holder.

    The kernel drops a flock when its holder dies (SIGKILL included), so a dead run's lock is free at once;
    its record stays, and the next run takes over with a message naming it. The file descriptor is
    close-on-exec (Ray's processes do not inherit it); forked scoring children do, and die with the driver.
    On NFS (v4, and v3 with lockd) Linux maps flock to a POSIX lock the server arbitrates, so runs on two
    hosts exclude each other too. A file system without locks (ENOLCK/EOPNOTSUPP) falls back to the record
    alone, with a warning: a record of a live process on this host, or of any other host, refuses the start.
    """

    def __init__(self, path: Path, fd: int | None, what: str):
        self.path, self.fd, self.what = path, fd, what

    @classmethod
    def acquire(cls, path: str | Path, what: str) -> RunLock:
        """Take the lock on ``path`` or raise OutputBusyError; ``what`` names the locked thing in messages."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(path)
            os.close(fd)
            raise OutputBusyError(_busy_message(path, what, holder)) from None
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                os.close(fd)
                raise
            log.warning(
                "%s: the file system does not support locks (%s); one writer per folder is checked "
                "from the holder record only",
                path,
                exc.strerror,
            )
            _refuse_if_live(path, what)
        previous = _read_holder(path)
        if previous:
            log.warning(
                "%s: took over the lock of an earlier run that is gone (%s); its partial checkpoints "
                "are cleaned up as after any kill",
                what,
                _describe(previous),
            )
        lock = cls(path, fd, what)
        lock._write(_holder_record())
        return lock

    def _write(self, record: dict[str, Any]) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Clear the record, then unlock (a clean exit leaves an empty lock file: nothing to take over)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv),
    }


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown: its record is empty"
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}, "
        f"command: {holder.get('command')}"
    )


def _busy_message(path: Path, what: str, holder: dict[str, Any]) -> str:
    return (
        f"{what} is in use by another run ({_describe(holder)}; lock file {path}). Two runs writing "
        "one folder corrupt its metrics and checkpoints. Set trainer.output_dir (or "
        "trainer.experiment_name) to another folder, or stop the other run first (then the same command "
        "resumes from its last checkpoint)."
    )


def _refuse_if_live(path: Path, what: str) -> None:
    """Without flock: refuse when the record names a live process here, or another host."""
    import psutil

    holder = _read_holder(path)
    if not holder or holder.get("pid") == os.getpid():
        return
    here = holder.get("host") == socket.gethostname()
    if not here or psutil.pid_exists(int(holder.get("pid", 0))):
        raise OutputBusyError(_busy_message(path, what, holder) + f" If that run is gone, delete {path}.")


def lock_run_outputs(recipe: Recipe) -> list[RunLock]:
    """Lock the output folder, and the metrics file when ``tracking.jsonl_path`` puts it elsewhere.

    The MLflow store (``<output_dir>/../mlflow.db`` by default) is shared by the experiments of a project on
    purpose: SQLite serializes its writers, and each run writes only its own run id, which lives in the
    (locked) output folder's checkpoints."""
    out = output_dir_of(recipe)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RlkitError(
            f"trainer.output_dir: cannot create {out}: {exc.strerror}. Choose a folder you can "
            "write (trainer.output_dir=...)."
        ) from exc
    locks = [RunLock.acquire(out / LOCK_FILE, f"output folder {out}")]
    jsonl = recipe.tracking.jsonl_path
    if jsonl and Path(jsonl).expanduser().resolve().parent != out.resolve():
        path = Path(jsonl).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            locks.append(RunLock.acquire(path.with_name(path.name + ".lock"), f"metrics file {path}"))
        except BaseException:
            locks[0].release()
            raise
    return locks
