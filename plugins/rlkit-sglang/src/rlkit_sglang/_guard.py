"""Run a server command; end its whole process group when the launching process dies.

Usage: ``python _guard.py PARENT_PID [--remove PATH]... CMD...`` — run as a file by any Python (the
SGLang venv has no rlkit), as the leader of the server's own process group (``start_new_session``).
Exits with the server's exit code; on SIGTERM, or when ``PARENT_PID`` is no longer its parent, it sends
SIGTERM to the group, then SIGKILL after 10 s. When the parent died, each ``--remove`` folder (the
run's weights folder, which the parent would have removed) is deleted first. The server itself gets SIGKILL if
this guard dies first (Linux ``PR_SET_PDEATHSIG``, set in the child: this process has one thread, so
``preexec_fn`` is safe here) — measured: when a Ray worker is stopped, Ray SIGKILLs what the worker left
behind, this guard included, and a server without it survived. SGLang's scheduler and detokenizer die with the
server (SGLang sets the same signal on them). Standard library only.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

CHILD = None
REMOVE: list = []
PR_SET_PDEATHSIG = 1


def _die_with_guard() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _end_group(*_args) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches this process too
    os.killpg(0, signal.SIGTERM)
    try:
        CHILD.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)  # stragglers (the server's subprocesses), and this process


def _orphaned() -> None:
    for path in REMOVE:
        shutil.rmtree(path, ignore_errors=True)
    _end_group()


def main() -> int:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    while cmd[:1] == ["--remove"]:
        REMOVE.append(cmd[1])
        cmd = cmd[2:]
    global CHILD
    signal.signal(signal.SIGTERM, _end_group)
    CHILD = subprocess.Popen(cmd, preexec_fn=_die_with_guard if sys.platform == "linux" else None)
    while True:
        code = CHILD.poll()
        if code is not None:
            return code
        if os.getppid() != parent:
            _orphaned()
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
