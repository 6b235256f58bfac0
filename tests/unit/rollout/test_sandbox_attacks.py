"""Attacks on the ``python`` tool's strict sandbox, each run through the real tool call path
(``call_tool(PythonTool(...), {"code": ...})``, what the agent loop calls), each asserting that its
effect did NOT happen on the host.

The host side (module fixture ``host``) holds: a root-owned 0600 secret and a 0600 canary owned by
another uid, both inside a directory the sandbox can see (the Python prefix, bound read-only), and a
copy in the host's /tmp it cannot see; a listening TCP socket on 127.0.0.1 and an abstract unix socket;
a victim process; a secret in the environment; the paths an attacker would write to (/root, /etc,
the repo, the host's /tmp, the interpreter's site-packages). ``_assert_host_intact`` checks all of
them after every attack.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlkit.rollout.tools import sandbox
from rlkit.rollout.tools.base import call_tool
from rlkit.rollout.tools.python import PythonTool
from rlkit.rollout.tools.sandbox import isolation

STRICT = isolation("strict")
pytestmark = pytest.mark.skipif(
    STRICT["mode"] != "strict", reason=f"strict sandbox unavailable here: {STRICT.get('reason')}"
)
REPO = Path(__file__).resolve().parents[3]
LIMITS = dict(wall_s=8.0, cpu_s=2, memory_mb=256, max_processes=16, max_output_chars=6000)


class Host:
    def __init__(self, base: Path):
        self.token = secrets.token_hex(8)
        self.secret_text = "S3CRET-" + self.token
        self.hidden_text = "HIDDEN-" + self.token
        self.env_secret = "ENVTOKEN-" + self.token
        visible = Path(sys.prefix)  # bound read-only into the sandbox: permissions are what protect these
        self.secret = visible / f"rlkit-attack-secret-{self.token}"
        self.other = visible / f"rlkit-attack-other-{self.token}"
        self.hidden = base / "secret-in-host-tmp"
        for path, text in (
            (self.secret, self.secret_text),
            (self.other, self.secret_text),
            (self.hidden, self.hidden_text),
        ):
            path.write_text(text)
            path.chmod(0o600)
        if os.geteuid() == 0:
            os.chown(self.other, 1000, 1000)
        name = f"rlkit-attack-{self.token}"
        purelib = Path(sysconfig.get_paths()["purelib"])
        self.targets = [
            Path("/root") / name,
            Path("/etc") / name,
            REPO / name,
            base / name,
            Path("/tmp") / name,
            Path(sys.prefix) / name,
            purelib / f"{name}.pth",
        ]
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.server.setblocking(False)
        self.port = self.server.getsockname()[1]
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(f"\0rlkit-attack-{self.token}")
        self.abstract.listen(8)
        self.abstract.setblocking(False)
        self.victim = subprocess.Popen(["sleep", "600"])

    def close(self) -> None:
        self.victim.kill()
        self.victim.wait()
        self.server.close()
        self.abstract.close()
        for path in (self.secret, self.other, *self.targets):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = Host(tmp_path_factory.mktemp("attack-host"))
    os.environ["RLKIT_ATTACK_TOKEN"] = h.env_secret
    try:
        yield h
    finally:
        os.environ.pop("RLKIT_ATTACK_TOKEN", None)
        h.close()


@pytest.fixture(scope="module")
def tool():
    return PythonTool(**LIMITS)


def _attack(tool, code: str):
    return asyncio.run(call_tool(tool, {"code": code}))


def _accepted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except (BlockingIOError, OSError):
        return False
    conn.close()
    return True


def _assert_host_intact(h: Host, res, *, visible_secrets_readable: bool = False) -> None:
    if not visible_secrets_readable:
        assert h.secret_text not in res.text, res.text
    assert h.hidden_text not in res.text, res.text
    assert h.env_secret not in res.text, res.text
    for path in h.targets:
        assert not path.exists(), f"the sandbox wrote {path}"
    for path, text in ((h.secret, h.secret_text), (h.other, h.secret_text), (h.hidden, h.hidden_text)):
        assert path.read_text() == text and (path.stat().st_mode & 0o777) == 0o600
    assert h.victim.poll() is None, "the victim process was killed"
    assert not _accepted(h.server), "the sandbox connected to the host's 127.0.0.1 socket"
    assert not _accepted(h.abstract), "the sandbox connected to the host's abstract unix socket"


def _shell(h: Host) -> str:
    """What a shell started by the attacker tries: read secrets, write host files, kill the victim."""
    writes = "; ".join(f"echo pwned > {t}" for t in h.targets)
    return (
        f"id; cat {h.secret} {h.other} {h.hidden}; {writes}; kill -9 {h.victim.pid}; "
        f"cat /proc/{h.victim.pid}/environ; echo $RLKIT_ATTACK_TOKEN; echo done"
    )


def _python_payload(h: Host) -> str:
    """The same effects tried from Python, each error printed (the attacker's view)."""
    return f"""
import os, signal, socket
def attempt(what, fn):
    try:
        print(what, "->", fn())
    except BaseException as exc:
        print(what, "-> refused:", type(exc).__name__, exc)
for p in {[str(h.secret), str(h.other), str(h.hidden)]!r}:
    attempt("read " + p, lambda: open(p).read())
for t in {[str(t) for t in h.targets]!r}:
    attempt("write " + t, lambda: open(t, "w").write("pwned"))
attempt("kill victim", lambda: os.kill({h.victim.pid}, signal.SIGKILL))
attempt("connect tcp", lambda: socket.create_connection(("127.0.0.1", {h.port}), timeout=1))
def unix():
    s = socket.socket(socket.AF_UNIX)
    s.connect("\\0rlkit-attack-{h.token}")
attempt("connect abstract unix", unix)
attempt("environ", lambda: os.environ.get("RLKIT_ATTACK_TOKEN"))
"""


# ----- process creation at the C level: the process starts, its effects do not reach the host -----------
def test_posixsubprocess_fork_exec_shell(tool, host):
    code = f"""
import _posixsubprocess, os
args = [b"/bin/sh", b"-c", {_shell(host).encode()!r}]
r, w = os.pipe()
common = (args, [b"/bin/sh"], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, -1,
          None, -1, -1, None)
try:
    pid = _posixsubprocess.fork_exec(*common, False)
except TypeError:
    pid = _posixsubprocess.fork_exec(*common)
print("pid", pid, "status", os.waitpid(pid, 0)[1])
"""
    res = _attack(tool, code)
    assert "pid" in res.text and "done" in res.text, res.text  # the shell did run ...
    assert "uid=65534" in res.text or STRICT["user_namespace"]  # ... as nobody
    _assert_host_intact(host, res)


def test_posix_spawn_shell(tool, host):
    code = (
        f"import os\npid = os.posix_spawn('/bin/sh', ['/bin/sh', '-c', {_shell(host)!r}], {{}})\n"
        "print('status', os.waitpid(pid, 0)[1])"
    )
    res = _attack(tool, code)
    assert "done" in res.text, res.text
    _assert_host_intact(host, res)


def test_ctypes_fork_execve(tool, host):
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pid = libc.fork()
if pid == 0:
    argv = (ctypes.c_char_p * 4)(b"/bin/sh", b"-c", {_shell(host).encode()!r}, None)
    envp = (ctypes.c_char_p * 1)(None)
    libc.execve(b"/bin/sh", argv, envp)
    os._exit(127)
print("status", os.waitpid(pid, 0)[1])
"""
    res = _attack(tool, code)
    assert "done" in res.text, res.text
    _assert_host_intact(host, res)


def test_subprocess_python_payload(tool, host):
    code = (
        f"import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', {_python_payload(host)!r}], "
        "capture_output=True, text=True).stdout)"
    )
    res = _attack(tool, code)
    assert "kill victim -> refused" in res.text, res.text
    _assert_host_intact(host, res)


# ----- identity: no way back to root ---------------------------------------------------------------------
def test_setresuid_root_then_payload(tool, host):
    code = (
        "import os\ntry:\n    os.setresuid(0, 0, 0)\n    print('BECAME ROOT')\nexcept OSError as e:\n"
        "    print('setresuid refused', e)\n" + _python_payload(host)
    )
    res = _attack(tool, code)
    assert "setresuid refused" in res.text and "BECAME ROOT" not in res.text, res.text
    _assert_host_intact(host, res)


def test_setgroups_and_setgid_root(tool, host):
    code = """
import os
calls = [("setgroups", lambda: os.setgroups([0])), ("setgid", lambda: os.setgid(0)),
         ("setresgid", lambda: os.setresgid(0, 0, 0))]
for name, fn in calls:
    try:
        fn()
        print(name, "WORKED")
    except OSError as e:
        print(name, "refused", e.errno)
print(os.getresgid(), os.getgroups())
"""
    res = _attack(tool, code)
    assert "WORKED" not in res.text and res.text.count("refused") == 3, res.text
    _assert_host_intact(host, res)


def test_identity_is_unprivileged(tool, host):
    code = (
        "import os\nprint(os.getresuid(), os.getresgid(), os.getgroups())\n"
        "print(open('/proc/self/status').read())"
    )
    res = _attack(tool, code)
    uid = 0 if STRICT["user_namespace"] else 65534
    assert f"({uid}, {uid}, {uid}) ({uid}, {uid}, {uid}) []" in res.text, res.text
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert f"{cap}:\t0000000000000000" in res.text, res.text
    assert "NoNewPrivs:\t1" in res.text


def test_raw_syscalls_via_ctypes(tool, host):
    code = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": {"setuid": 105, "setgid": 106, "mount": 165, "chroot": 161, "unshare": 272},
      "aarch64": {"setuid": 146, "setgid": 144, "mount": 40, "chroot": 51, "unshare": 97}}[platform.machine()]
print("setuid", libc.syscall(nr["setuid"], 0), ctypes.get_errno())
print("setgid", libc.syscall(nr["setgid"], 0), ctypes.get_errno())
print("mount", libc.syscall(nr["mount"], b"none", b"/usr", b"tmpfs", 0, None), ctypes.get_errno())
print("chroot", libc.syscall(nr["chroot"], b"/tmp"), ctypes.get_errno())
print("unshare-mnt", libc.syscall(nr["unshare"], 0x00020000), ctypes.get_errno())
import os
print("uids", os.getresuid())
"""
    res = _attack(tool, code)
    for call in ("setuid", "setgid", "mount", "chroot", "unshare-mnt"):
        assert f"{call} -1 1" in res.text, res.text  # -1, EPERM
    assert "(0, 0, 0)" not in res.text or STRICT["user_namespace"]
    _assert_host_intact(host, res)


# ----- /proc -----------------------------------------------------------------------------------------------
def test_proc_1_root_and_cwd(tool, host):
    code = f"""
import os
for p in ["/proc/1/root{host.secret}", "/proc/1/root{host.hidden}", "/proc/1/cwd/main.py"]:
    try:
        print(p, open(p).read()[:40])
    except OSError as e:
        print(p, "refused", e)
try:
    print("pid1 root ->", os.readlink("/proc/1/root"))
except OSError as e:
    print("pid1 root refused", e)
"""
    res = _attack(tool, code)
    assert res.text.count("refused") == 4, res.text
    _assert_host_intact(host, res)


def test_parent_environ_and_pid_namespace(tool, host):
    code = (
        f"import os\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\nprint('pids', pids)\n"
        f"for pid in [{os.getpid()}, {host.victim.pid}, 1]:\n    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ').read())\n    except OSError as e:\n"
        "        print(pid, 'refused', type(e).__name__)\nprint(open('/proc/self/environ').read())\n"
        "print(dict(os.environ))"
    )
    res = _attack(tool, code)
    pids = json.loads(res.text.split("pids ")[1].split("\n")[0])
    assert os.getpid() not in pids and host.victim.pid not in pids and max(pids) < 50, res.text
    _assert_host_intact(host, res)


def test_proc_mem_of_init_and_sysctl_writes(tool, host):
    code = """
targets = [("/proc/1/mem", b"x"), ("/proc/sys/kernel/hostname", b"pwned"), ("/proc/sysrq-trigger", b"b"),
           ("/proc/sys/kernel/core_pattern", b"|/tmp/x")]
for path, data in targets:
    try:
        with open(path, "wb") as f:
            f.write(data)
        print(path, "WRITTEN")
    except OSError as e:
        print(path, "refused", type(e).__name__)
"""
    res = _attack(tool, code)
    assert "WRITTEN" not in res.text and res.text.count("refused") == 4, res.text
    assert socket.gethostname() != "pwned"
    _assert_host_intact(host, res)


def test_proc_self_mem_cannot_reach_beyond_the_process(tool, host):
    # writing one's own memory is allowed (it is one's own); it must not widen what the process may do
    code = "f = open('/proc/self/mem', 'r+b')\nf.close()\nprint('own mem opened')\n" + _python_payload(host)
    res = _attack(tool, code)
    _assert_host_intact(host, res)


# ----- files ----------------------------------------------------------------------------------------------
def test_python_payload_reads_and_writes_host_files(tool, host):
    res = _attack(tool, _python_payload(host))
    text = res.text
    # /tmp write lands in the private tmpfs
    assert text.count("-> refused") >= 3 + len(host.targets) - 1, text
    _assert_host_intact(host, res)


def test_host_tree_is_not_visible(tool, host):
    paths = [str(REPO / "pyproject.toml"), str(host.hidden), "/root/.bashrc", "/etc/shadow"]
    code = f"import os\nprint(sorted(os.listdir('/')))\nprint(*[os.path.exists(p) for p in {paths!r}])"
    res = _attack(tool, code)
    assert "False False False False" in res.text, res.text
    _assert_host_intact(host, res)


def test_fill_private_tmp(tool, host):
    code = """
n = 0
try:
    for i in range(1000):
        with open(f"/tmp/f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
        n += 1
except OSError as e:
    print("stopped", n, e)
"""
    res = _attack(tool, code)
    assert "stopped" in res.text or "wrote more than" in res.text, res.text
    _assert_host_intact(host, res)


# ----- signals and ptrace --------------------------------------------------------------------------------
def test_signal_parent_victim_and_everyone(tool, host):
    code = (
        f"import os, signal\nfor pid in [{os.getpid()}, {host.victim.pid}, {os.getppid()}]:\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n        print(pid, 'SIGNALLED', flush=True)\n"
        "    except OSError as e:\n        print(pid, 'refused', type(e).__name__, flush=True)\n"
        "os.kill(-1, signal.SIGKILL)"
    )
    res = _attack(tool, code)
    assert "SIGNALLED" not in res.text and res.text.count("refused") == 3, res.text
    _assert_host_intact(host, res)


def test_ptrace_attach(tool, host):
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
for pid in [{host.victim.pid}, {os.getpid()}, 1]:
    for req in (PTRACE_ATTACH, PTRACE_SEIZE):
        r = libc.ptrace(req, pid, None, None)
        print(pid, req, r, ctypes.get_errno())
"""
    res = _attack(tool, code)
    assert " 0 0" not in res.text, res.text  # no ptrace call returned 0 (success)
    _assert_host_intact(host, res)


# ----- resource bombs: the limit stops them, the tool answers, the host stays healthy --------------------
def test_fork_bomb(tool, host):
    res = _attack(
        tool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert not res.ok, res.text
    _assert_host_intact(host, res)
    assert _attack(tool, "print('alive')").text.strip() == "alive"


def test_memory_bomb(tool, host):
    res = _attack(tool, "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))")
    assert not res.ok and "ran out of memory" in res.text, res.text
    _assert_host_intact(host, res)


def test_cpu_loop(tool, host):
    res = _attack(tool, "while True:\n    pass")
    # whichever limit comes first on a loaded machine (the CPU limit alone: test_sandbox.py)
    assert not res.ok and ("CPU time" in res.text or "wall-time limit" in res.text), res.text
    _assert_host_intact(host, res)


def test_cpu_loop_in_children_that_escape_the_session(tool, host):
    marker = f"rlkit-spin-{host.token}"  # in the spinners' argv, so the host can look for them
    code = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
        f"        os.execv('/bin/sh', ['sh', '-c', 'while :; do :; done', {marker!r}])\ntime.sleep(60)"
    )
    res = _attack(tool, code)
    assert not res.ok and "wall-time limit" in res.text, res.text
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not leftover, f"setsid children outlived the call: {leftover}"
    _assert_host_intact(host, res)


# ----- namespaces and mounts -----------------------------------------------------------------------------
def test_mount_chroot_and_unshare(tool, host):
    code = f"""
import os, subprocess
for name, fn in [("chroot", lambda: os.chroot("/tmp")), ("unshare", lambda: os.unshare(os.CLONE_NEWNS))]:
    try:
        fn()
        print(name, "WORKED")
    except (OSError, AttributeError) as e:
        print(name, "refused", e)
for cmd in (["mount", "-t", "tmpfs", "none", "/usr"], ["mount", "-o", "remount,rw", "/"],
            ["unshare", "-Urm", "sh", "-c", "mount -o remount,rw /; umount -l /tmp; cat {host.hidden}; "
             "echo pwned > {host.targets[3]}; /usr/sbin/chroot / cat {host.secret}; echo inner-done"]):
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(cmd[0], p.returncode, p.stdout, p.stderr)
"""
    res = _attack(tool, code)
    assert "chroot refused" in res.text and "WORKED" not in res.text, res.text
    _assert_host_intact(host, res)


def test_network_namespace_has_no_route_out(tool, host):
    code = (
        "import socket\nprint([n for _, n in socket.if_nameindex()])\nfor addr in [('127.0.0.1', "
        f"{host.port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n    s = socket.socket()\n    s.settimeout(1)\n"
        "    try:\n        s.connect(addr)\n        print(addr, 'CONNECTED')\n    except OSError as e:\n"
        "        print(addr, 'refused', type(e).__name__)"
    )
    res = _attack(tool, code)
    assert "CONNECTED" not in res.text and res.text.count("refused") == 3, res.text
    _assert_host_intact(host, res)


def test_environment_is_a_clean_allow_list(tool, host):
    res = _attack(tool, "import os, json\nprint(json.dumps(sorted(os.environ)))")
    assert json.loads(res.text) == ["HOME", "LANG", "OMP_NUM_THREADS", "PATH", "TMPDIR"]
    _assert_host_intact(host, res)


def test_kill_every_process_group_does_not_touch_the_host(tool, host):
    res = _attack(tool, "import os, signal\nos.killpg(0, signal.SIGKILL)")
    _assert_host_intact(host, res)
    assert not res.ok


def test_attacks_leave_the_tool_working(tool):
    res = _attack(tool, "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())")
    assert res.ok and res.text.strip() == "hi /tmp", res.text


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, the user-namespace path is tried too")
def test_user_namespace_path_keeps_the_host_out(host, monkeypatch):
    """The path a non-root user gets, tried as root: uid 0 inside is the real root here, so file
    permissions protect nothing and the mount, pid and network namespaces are the whole boundary.
    (Files inside the bound Python prefix are readable on this path: documented.)"""
    plan = sandbox._plan(user_ns=True)
    report = sandbox._probe(plan)
    assert isinstance(report, dict), report
    monkeypatch.setattr(sandbox, "_strict", lambda: (plan, report))
    tool = PythonTool(**LIMITS)
    assert tool.isolation["user_namespace"] is True
    shell = ["sh", "-c", _shell(host)]
    spawn = f"import os\nprint(os.waitpid(os.posix_spawn('/bin/sh', {shell!r}, {{}}), 0))"
    for code in (_python_payload(host), spawn):
        res = _attack(tool, code)
        assert "done" in res.text or "kill victim -> refused" in res.text, res.text
        _assert_host_intact(host, res, visible_secrets_readable=True)
