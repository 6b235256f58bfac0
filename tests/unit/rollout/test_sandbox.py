"""Each escape attempt is stopped quickly and reported as a failed tool result, never raised."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from rlkit.rollout.tools.python import PythonTool
from rlkit.rollout.tools.sandbox import SandboxLimits, _wrappers, isolation, run_python

FAST = dict(wall_s=2.0, cpu_s=1, memory_mb=256, max_output_chars=500)


def _run(code: str, **limits):
    tool = PythonTool(**{**FAST, **limits})
    start = time.perf_counter()
    res = asyncio.run(tool.execute({"code": code}))
    return res, time.perf_counter() - start


def test_plain_code_runs_and_prints():
    res, _ = _run("import math\nprint(sum(range(10)), math.sqrt(16))")
    assert res.ok and res.text.strip() == "45 4.0"


def test_files_inside_the_private_directory_work():
    res, _ = _run("open('a.txt', 'w').write('hi')\nimport os\nprint(open('a.txt').read(), os.listdir('.'))")
    assert res.ok and "hi" in res.text and "a.txt" in res.text


def test_socket_is_refused():
    res, took = _run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))")
    assert not res.ok and "refuses" in res.text and "network access" in res.text
    assert took < 3


def test_write_outside_the_directory_is_refused(tmp_path):
    target = tmp_path / "escape.txt"
    res, _ = _run(f"open({str(target)!r}, 'w').write('x')")
    assert not res.ok and "outside the sandbox directory" in res.text
    assert not target.exists()
    res, _ = _run("import os\nos.remove('/etc/hostname')")
    assert not res.ok and "os.remove" in res.text


def test_fork_bomb_is_stopped():
    res, took = _run("import os\nwhile True:\n    os.fork()")
    assert not res.ok and "os.fork" in res.text
    res, _ = _run("import subprocess\nsubprocess.run(['true'])")
    assert not res.ok and "subprocess.Popen" in res.text
    assert took < 3


def test_too_much_memory_is_stopped():
    res, took = _run("x = bytearray(2 << 30)")
    assert not res.ok and "ran out of memory" in res.text and "MemoryError" in res.text
    assert took < 3


def test_endless_loop_is_stopped_by_the_cpu_limit():
    res, took = _run("while True:\n    pass")
    assert not res.ok and "CPU time" in res.text
    assert took < 3


def test_endless_sleep_is_stopped_by_the_wall_limit():
    res, took = _run("import time\ntime.sleep(60)", wall_s=1.0)
    assert not res.ok and "wall-time limit" in res.text
    assert res.metrics["violation"] == "timeout" and took < 3


def test_output_is_truncated():
    res, _ = _run("print('x' * 100000)")
    assert res.ok and len(res.text) < 700 and "output truncated" in res.text
    flood, took = _run("while True:\n    print('y' * 1000)", max_file_mb=1)
    assert not flood.ok and "wrote more than 1 MiB" in flood.text and took < 3


def test_exceptions_are_reported_with_the_users_frames_only():
    res, _ = _run("def f():\n    return 1 / 0\nf()")
    assert not res.ok and "ZeroDivisionError" in res.text and 'File "main.py", line 2' in res.text
    assert "<string>" not in res.text


@pytest.mark.skipif(isolation()["network"] != "netns+audit_hook", reason="no network namespace here")
def test_network_namespace_is_a_hard_boundary_without_the_hook():
    net, _, _ = _wrappers()
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))"
    proc = subprocess.run([*net, sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10)
    assert proc.returncode != 0 and "unreachable" in proc.stderr.lower()


@pytest.mark.skipif(isolation()["processes"] != "rlimit_nproc+audit_hook", reason="no process limit here")
def test_process_limit_is_a_hard_boundary_without_the_hook():
    _, drop, _ = _wrappers()
    code = ("import os, resource, time\nresource.setrlimit(resource.RLIMIT_NPROC, (8, 8))\nn = 0\n"
            "try:\n    for _ in range(64):\n        if os.fork() == 0:\n            time.sleep(1); os._exit(0)\n"
            "        n += 1\nexcept OSError:\n    pass\nprint(n)")
    proc = subprocess.run([*drop, sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0 and int(proc.stdout) < 8, proc.stderr


def test_run_python_never_raises_on_odd_input():
    res = run_python("\x00", SandboxLimits(**FAST))
    assert not res.ok
