"""A small process that outlives a killed driver just long enough to kill the Ray processes it started.

Ray fate-shares gcs_server, the raylet and the workers with the driver that started them, but the
raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) outlive a SIGKILLed driver (for how
long: docs/reliability.md). Nothing in a SIGKILLed process can run, so a second process does it:

    reaper = Reaper()                  # right after ray.init; a child of the driver, in its own session
    reaper.watch(processes)            # psutil.Process objects; may be called again with more
    reaper.close()                     # a normal end: the reaper exits and kills nothing

The reaper reads ``pid start_time`` lines on its stdin. When stdin reaches EOF without a ``close``
line (the driver died, however), it SIGTERMs every process it was given that still runs (same pid
*and* start time, so a reused pid is never hit), waits 1 s, SIGKILLs the rest and exits. It ignores
SIGINT and runs in its own session, so a Ctrl-C in the terminal is left to the driver.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["Reaper", "kill_processes"]

_PROGRAM = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

watched = {}
for line in sys.stdin:
    if line.strip() == "close":
        sys.exit(0)
    pid, _, started = line.strip().partition(" ")
    watched[int(pid)] = started
def alive():
    return [pid for pid, started in watched.items() if started == "?" or start_time(pid) == started]
for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.0)):
    for pid in alive():
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks); ``?`` where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


class Reaper:
    """See the module docstring."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-c", _PROGRAM],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
        )
        self._sent: set[int] = set()

    def watch(self, processes: Iterable[Any]) -> None:
        """Add processes (``psutil.Process``) to kill if the driver dies."""
        lines = []
        for proc in processes:
            if proc.pid not in self._sent:
                self._sent.add(proc.pid)
                lines.append(f"{proc.pid} {_start_time(proc.pid)}\n")
        if lines and self.process.poll() is None:
            try:
                self.process.stdin.write("".join(lines))
                self.process.stdin.flush()
            except OSError:
                pass

    def close(self) -> None:
        """The driver stopped its processes itself: let the reaper go without killing anything."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write("close\n")
                self.process.stdin.close()
            except OSError:
                pass
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()


def kill_processes(processes: Iterable[Any], grace_s: float = 2.0) -> list[int]:
    """SIGTERM each ``psutil.Process`` still running (same pid *and* start time), wait up to ``grace_s``,
    then SIGKILL what is left; returns the pids that had to be SIGKILLed. ``grace_s=0``: SIGKILL at once."""
    import psutil

    alive, seen = [], set()
    for proc in processes:
        if proc.pid in seen:
            continue
        seen.add(proc.pid)
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    if grace_s > 0:
        for proc in alive:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return [p.pid for p in alive]
