"""Each escape attempt is stopped quickly and reported as a failed tool result, never raised.

The contract (output, truncation, limits, error text) holds at both isolation levels; the audit-hook
messages are the weak level's (the strict level's OS boundary: test_sandbox_attacks.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import warnings

import pytest

from rlkit.rollout.tools import sandbox
from rlkit.rollout.tools.python import PythonTool
from rlkit.rollout.tools.sandbox import SandboxError, SandboxLimits, isolation, run_python
from rlkit.rollout.tools.sandbox_hook import weak_wrappers

FAST = dict(wall_s=2.0, cpu_s=1, memory_mb=256, max_output_chars=500)
LEVELS = [
    pytest.param(
        "strict", marks=pytest.mark.skipif(isolation()["mode"] != "strict", reason="no strict sandbox here")
    ),
    "weak",
]


@pytest.fixture(params=LEVELS)
def level(request):
    return request.param


def _run(code: str, level: str = "weak", **limits):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tool = PythonTool(**{**FAST, **limits, "isolation": level})
    start = time.perf_counter()
    res = asyncio.run(tool.execute({"code": code}))
    return res, time.perf_counter() - start


def test_plain_code_runs_and_prints(level):
    res, _ = _run("import math\nprint(sum(range(10)), math.sqrt(16))", level)
    assert res.ok and res.text.strip() == "45 4.0"


def test_files_inside_the_private_directory_work(level):
    res, _ = _run(
        "open('a.txt', 'w').write('hi')\nimport os\nprint(open('a.txt').read(), os.listdir('.'))", level
    )
    assert res.ok and "hi" in res.text and "a.txt" in res.text


def test_socket_is_refused():
    res, _ = _run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))")
    assert not res.ok and "refuses" in res.text and "network access" in res.text


def test_write_outside_the_directory_is_refused(tmp_path):
    target = tmp_path / "escape.txt"
    res, _ = _run(f"open({str(target)!r}, 'w').write('x')")
    assert not res.ok and "outside the sandbox directory" in res.text
    assert not target.exists()
    res, _ = _run("import os\nos.remove('/etc/hostname')")
    assert not res.ok and "os.remove" in res.text


def test_fork_bomb_is_stopped():
    res, _ = _run("import os\nwhile True:\n    os.fork()")
    assert not res.ok and "os.fork" in res.text
    res, _ = _run("import subprocess\nsubprocess.run(['true'])")
    assert not res.ok and "subprocess.Popen" in res.text


def test_too_much_memory_is_stopped(level):
    res, _ = _run("x = bytearray(2 << 30)", level)
    assert not res.ok and "ran out of memory" in res.text and "MemoryError" in res.text


def test_endless_loop_is_stopped_by_the_cpu_limit(level):
    res, _ = _run("while True:\n    pass", level, wall_s=30.0)  # a loaded machine: CPU time accrues slowly
    assert not res.ok and "CPU time" in res.text


def test_endless_sleep_is_stopped_by_the_wall_limit(level):
    res, _ = _run("import time\ntime.sleep(60)", level, wall_s=1.0)
    assert not res.ok and "wall-time limit" in res.text
    assert res.metrics["violation"] == "timeout"


def test_output_is_truncated(level):
    res, _ = _run("print('x' * 100000)", level)
    assert res.ok and len(res.text) < 700 and "output truncated" in res.text
    flood, _ = _run("while True:\n    print('y' * 1000)", level, max_file_mb=1)
    assert not flood.ok and "wrote more than 1 MiB" in flood.text


def test_exceptions_are_reported_with_the_users_frames_only(level):
    res, _ = _run("def f():\n    return 1 / 0\nf()", level)
    assert not res.ok and "ZeroDivisionError" in res.text and 'File "main.py", line 2' in res.text
    assert "<string>" not in res.text


@pytest.mark.skipif(isolation("weak")["network"] != "netns+audit_hook", reason="no network namespace here")
def test_network_namespace_is_a_hard_boundary_without_the_hook():
    net, _, _ = weak_wrappers()
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))"
    proc = subprocess.run(
        [*net, sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10
    )
    assert proc.returncode != 0 and "unreachable" in proc.stderr.lower()


@pytest.mark.skipif(
    isolation("weak")["processes"] != "rlimit_nproc+audit_hook", reason="no process limit here"
)
def test_process_limit_is_a_hard_boundary_without_the_hook():
    _, drop, _ = weak_wrappers()
    code = (
        "import os, resource, time\nresource.setrlimit(resource.RLIMIT_NPROC, (8, 8))\nn = 0\n"
        "try:\n    for _ in range(64):\n        if os.fork() == 0:\n            time.sleep(1); os._exit(0)\n"
        "        n += 1\nexcept OSError:\n    pass\nprint(n)"
    )
    proc = subprocess.run(
        [*drop, sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 0 and int(proc.stdout) < 8, proc.stderr


def test_run_python_never_raises_on_odd_input():
    for level in ("strict", "weak"):
        res = run_python("\x00", SandboxLimits(**FAST, isolation=level))
        assert not res.ok


def test_without_the_os_boundary_strict_refuses_and_weak_warns(monkeypatch):
    reason = "util-linux `unshare` and `setpriv` are not both on PATH"
    monkeypatch.setattr(sandbox, "_strict", lambda: reason)  # a machine that cannot give the boundary
    with pytest.raises(
        SandboxError, match=r"strict isolation is not available.*not both on PATH.*isolation: weak"
    ):
        PythonTool()
    assert isolation() == {"mode": "unavailable", "reason": reason}
    with pytest.warns(RuntimeWarning, match="isolation 'weak'"):
        tool = PythonTool(isolation="weak")
    assert tool.isolation["mode"] == "weak"
    res = asyncio.run(tool.execute({"code": "print(6 * 7)"}))
    assert res.ok and res.text.strip() == "42"
    assert run_python("print(1)").violation == "setup"  # strict asked directly: never runs unguarded


def test_a_missing_util_linux_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "not both on PATH" in sandbox._plan(False)
    with pytest.raises(SandboxError, match="not a level"):
        sandbox.require_isolation("none")


@pytest.mark.skipif(isolation()["mode"] != "strict", reason="no strict sandbox here")
def test_isolation_reports_what_a_probe_child_saw():
    report = isolation()
    assert report["capabilities"] == "none" and report["no_new_privs"] is True
    assert report["namespaces"] == ["ipc", "mnt", "net", "pid", "uts"]
    assert report["environment"] == ["HOME", "LANG", "OMP_NUM_THREADS", "PATH", "TMPDIR"]
    assert report["uid"].startswith(
        "65534 real/effective/saved" if not report["user_namespace"] else "0 real"
    )
    assert PythonTool().isolation == report


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the user-namespace path can be tried too")
def test_the_user_namespace_path_gives_the_same_boundary():
    report = sandbox._probe(sandbox._plan(user_ns=True))
    assert isinstance(report, dict), report
    assert report["user_namespace"] is True and report["namespaces"] == ["ipc", "mnt", "net", "pid", "uts"]
    assert report["capabilities"] == "none" and report["uid"].startswith("0 real/effective/saved")


def _pgrep(marker: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


@pytest.mark.skipif(isolation()["mode"] != "strict", reason="no strict sandbox here")
def test_the_sandbox_ends_when_its_parent_dies_without_killing_it():
    suffix = f"{os.getpid()}-{time.time_ns()}"
    marker = f"rlkit-orphan-{suffix}"  # in the child's argv for pgrep; not in the parent's (built there)
    code = f"import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 600', 'rlkit-orphan-' + {suffix!r}])"
    parent = f"from rlkit.rollout.tools.sandbox import *\nrun_python({code!r}, SandboxLimits(wall_s=3.0))"
    trainer = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not _pgrep(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pgrep(marker), "the sandboxed child never started"
    trainer.kill()  # the parent dies between its polls: nobody kills the sandbox's process group
    trainer.wait()
    deadline = time.monotonic() + 60
    while _pgrep(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pgrep(marker), "the sandbox outlived its parent (its init's own lifetime did not end it)"


def test_isolation_and_open_files_come_through_the_recipe():
    from rlkit.errors import RecipeError
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe import validate_recipe
    from rlkit.recipe.compose import compose

    registries = build_registries(make_plugin_manager())
    raw = {
        "model": {"path": "m"},
        "data": {"train_files": ["t.parquet"], "train_batch_size": 4},
        "rollout": {"n": 2},
    }

    def recipe(tool: str):
        overrides = ["rollout.agent=tool", f"rollout.tools=[{tool}]"]
        return validate_recipe(raw, overrides, registries=registries, check_files=False)

    with pytest.warns(RuntimeWarning, match="isolation 'weak'"):
        resolved = compose(recipe("{name: python, isolation: weak, max_open_files: 32}"), registries)
        tool = resolved.tools[0].build()
    assert tool.limits.isolation == "weak" and tool.limits.max_open_files == 32
    code = "import resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE))"
    res = asyncio.run(tool.execute({"code": code}))
    assert res.ok and res.text.strip() == "(32, 32)", res.text
    with pytest.raises(RecipeError, match="rollout.tools.0.isolation"):
        recipe("{name: python, isolation: none}")


@pytest.mark.parametrize("level", LEVELS)
def test_the_child_runs_under_every_rlimit(level):
    code = (
        "import resource as r\nprint(*[r.getrlimit(getattr(r, 'RLIMIT_' + n))[1] for n in "
        "('CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE')])"
    )
    res, _ = _run(code, level, cpu_s=3, memory_mb=300, max_file_mb=5, max_open_files=40)
    assert res.ok and res.text.split() == ["4", str(300 << 20), str(5 << 20), "40", "0"], res.text
