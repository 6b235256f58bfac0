"""The pieces a stop relies on, with real processes: kill by pid (SIGTERM, then SIGKILL), the reaper that
outlives a killed driver, and the stop handler's exit codes. The whole stop is tested end to end in
tests/reliability/test_stop_signals.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from rlkit.runtime.stop import RunInterrupted, StopHandler
from rlkit.workers.reaper import Reaper, kill_processes

SLEEPER = "import time; time.sleep(120)"
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(120)"
)


def spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if "ready" in code:
        assert proc.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    return proc


def test_kill_processes_terminates_then_kills_what_ignores_sigterm():
    polite, stubborn = spawn(SLEEPER), spawn(STUBBORN)
    try:
        killed = kill_processes([psutil.Process(polite.pid), psutil.Process(stubborn.pid)], grace_s=0.5)
        assert killed == [stubborn.pid]  # the polite one ended on SIGTERM (psutil reaped both children)
        assert polite.wait(5) is not None and stubborn.wait(5) == -signal.SIGKILL
    finally:
        polite.kill(), stubborn.kill()


def test_reaper_kills_what_it_watches_when_the_driver_goes_away_and_nothing_after_close():
    victim, survivor = spawn(STUBBORN), spawn(SLEEPER)
    try:
        dying = Reaper()
        dying.watch([psutil.Process(victim.pid)])
        dying.process.stdin.close()  # what a killed driver's end of the pipe does
        assert dying.process.wait(10) == 0
        assert victim.wait(5) == -signal.SIGKILL  # it ignored SIGTERM, so it got SIGKILL after 1 s

        closed = Reaper()
        closed.watch([psutil.Process(survivor.pid)])
        closed.close()
        assert closed.process.returncode == 0 and survivor.poll() is None
    finally:
        victim.kill(), survivor.kill()


def test_exit_codes_follow_the_signal():
    assert RunInterrupted(signal.SIGINT).exit_code == 130
    assert RunInterrupted(signal.SIGTERM).exit_code == 143
    # `except Exception` never swallows it
    assert isinstance(RunInterrupted(signal.SIGINT), KeyboardInterrupt)
    assert StopHandler().exit_code == 130  # a plain KeyboardInterrupt, no signal seen
