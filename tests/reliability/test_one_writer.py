"""One writer per output folder: `rlkit run` locks its output folder (``rlkit.runtime.lock.RunLock``) before
it writes.

A second run into a busy folder refuses at once, naming the holder; a lock left by a killed run is taken over
with a message; two real concurrent runs leave the first one's metrics and checkpoints intact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from rlkit_harness import (
    check_checkpoints,
    finish,
    ray_session,
    records,
    sessions_started_by,
    start,
    wait_until_reaped,
)

from rlkit.runtime.lock import LOCK_FILE, OutputBusyError, RunLock


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    path = tmp_path / LOCK_FILE
    first = RunLock.acquire(path, f"output folder {tmp_path}")
    try:
        # a second open file of the lock: flock conflicts even within one process
        with pytest.raises(OutputBusyError) as refused:
            RunLock.acquire(path, f"output folder {tmp_path}")
        message = str(refused.value)
        holder = f"(pid {os.getpid()} on host {socket.gethostname()}"
        assert f"output folder {tmp_path} is in use by another run {holder}" in message
        assert "started 20" in message and "command: " in message
        assert (
            "Set trainer.output_dir (or trainer.experiment_name) to another folder, or stop the other run"
            in message
        )
        # the refusal left the holder's record alone
        assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        first.release()
    assert path.read_text() == ""  # a clean release leaves nothing to take over
    RunLock.acquire(path, "again").release()


def test_the_lock_of_a_killed_process_is_taken_over_with_a_message(tmp_path, caplog):
    """A real process takes the lock and SIGKILLs itself: the kernel frees the flock, its record names it."""
    path = tmp_path / LOCK_FILE
    code = (
        f"import os, signal; from rlkit.runtime.lock import RunLock; RunLock.acquire({str(path)!r}, 'x'); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead = json.loads(path.read_text())
    assert dead["host"] == socket.gethostname() and dead["pid"] != os.getpid()
    with caplog.at_level("WARNING", logger="rlkit.runtime.build"):
        lock = RunLock.acquire(path, f"output folder {tmp_path}")
    lock.release()
    assert (
        f"took over the lock of an earlier run that is gone (pid {dead['pid']} on host {dead['host']}"
        in caplog.text
    )


def test_without_flock_a_live_holder_record_still_refuses(tmp_path, monkeypatch):
    """A file system without locks (ENOLCK): the holder record alone refuses a live holder, and says so."""
    import errno
    import fcntl

    path = tmp_path / LOCK_FILE
    path.write_text(
        json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": "then", "command": "c"})
    )

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OutputBusyError, match=f"pid {os.getppid()} on host .* If that run is gone, delete"):
        RunLock.acquire(path, "output folder")


def test_a_second_run_into_a_busy_output_folder_refuses_and_the_first_stays_intact(recipe, tmp_path):
    """Two real `rlkit run` into one folder: the second exits 1 at once naming the first (pid, host, start
    time, command) and starts no Ray cluster; the first finishes with one metrics row per step, steps strictly
    increasing, and every checkpoint complete and loadable."""
    out = tmp_path / "out"
    path = recipe(out, steps=4)
    first = start("run", str(path))
    lock = out / LOCK_FILE
    deadline = time.time() + 240
    while not (lock.exists() and lock.read_text().strip()):  # the first run holds the folder
        assert first.poll() is None and time.time() < deadline, f"no lock record (rc={first.poll()})"
        time.sleep(0.05)
    launched = time.time()
    proc = start("run", str(path))
    second = finish(proc, timeout=180)
    still_running = first.poll() is None
    result = finish(first)
    assert result.returncode == 0, result.stderr[-3000:]
    assert still_running, "the second run did not refuse before the first one ended"
    assert second.returncode == 1, second.stderr[-3000:]
    error = second.stderr[second.stderr.index("error: ") :]
    assert (
        f"error: output folder {out} is in use by another run (pid {first.pid} on host {socket.gethostname()}"
        in error
    )
    assert "started 20" in error and f"run {path}" in error and "Traceback" not in second.stderr
    assert sessions_started_by(proc.pid, since=launched) == []
    steps = [r["step"] for r in records(out) if "training/global_step" in r]
    assert steps == [1, 2, 3, 4], steps  # no duplicate, no step going backwards
    assert check_checkpoints(out) == [1, 2, 3, 4]
    assert lock.read_text() == ""  # released at the end
    wait_until_reaped(ray_session(out))


def test_second_run_starts_no_ray_session(recipe, tmp_path):
    """A refused run is refused before Ray: no session of its pid exists (the lock is held by this test)."""
    out = tmp_path / "out"
    path = recipe(out, steps=1)
    out.mkdir(parents=True)
    held = RunLock.acquire(out / LOCK_FILE, f"output folder {out}")
    try:
        launched = time.time()
        proc = start("run", str(path))
        result = finish(proc, timeout=180)
    finally:
        held.release()
    assert (
        result.returncode == 1
        and f"output folder {out} is in use by another run (pid {os.getpid()}" in result.stderr
    )
    assert sessions_started_by(proc.pid, since=launched) == []
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
