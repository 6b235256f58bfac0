"""Run untrusted Python in a child process with limits; report every violation as a result.

What stops what (measured on Linux, root in a container — see docs/agents-and-tools.md):

=================  ==========================================================  ==================
limit              mechanism                                                   kind
=================  ==========================================================  ==================
wall time          parent kills the child's whole process group (own session)  OS (hard)
CPU time           ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL one second later)     OS (hard)
memory             ``RLIMIT_AS`` (allocation fails: ``MemoryError``)           OS (hard)
file size          ``RLIMIT_FSIZE`` (also bounds what stdout/stderr can write)  OS (hard)
processes          ``RLIMIT_NPROC`` under real uid 65534 with no capabilities  OS (hard) [1]
                   + audit hook refusing fork/exec/spawn/kill/ctypes           Python-level
network            a fresh network namespace (``unshare --net``: no devices,   OS (hard) [2]
                   not even loopback) + audit hook refusing ``socket.*``       Python-level
files              private temp dir as cwd/HOME/TMPDIR; audit hook refusing    Python-level
                   writes outside it and reads outside it and Python's paths
=================  ==========================================================  ==================

[1] ``RLIMIT_NPROC`` does not apply to uid 0, so when the parent is root the child runs under
``setpriv --ruid 65534 --bounding-set -all --no-new-privs``: real uid ``nobody`` (what the process
count is charged to), effective uid 0 (so it can still read the interpreter under ``/root``), and
no capabilities at all. The count is per uid, shared by concurrent sandboxes. When that is not
available (not root, no ``setpriv``) only the audit hook stops forks.
[2] When ``unshare --net`` fails (no privilege, no user namespaces), only the audit hook stops it.

An audit hook (PEP 578) is a Python-level guard: it sees everything Python code does through the
interpreter, but code that reaches the C level another way could step around it (ctypes is refused
for that reason). Treat the hard limits as the security boundary and the hook as a strong guard.
``isolation()`` says which mechanisms this machine provides.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "isolation"]

NOBODY_UID = 65534


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock seconds before the process group is killed
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS); Python itself needs ~30 MiB
    max_processes: int = 16  # RLIMIT_NPROC for the sandbox uid (where the uid drop works)
    max_file_mb: int = 16  # largest file the code may write, stdout/stderr included (RLIMIT_FSIZE)
    max_output_chars: int = 4000  # stdout and stderr are each cut to this many characters


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    violation: str | None  # None, "timeout", "cpu", "memory", "file_size", "policy", "killed"
    wall_s: float
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.violation is None


# Runs in the child before the user's code: lower the limits, install the audit hook, run main.py.
_BOOTSTRAP = r'''
import json, os, resource, sys, traceback
_cfg = json.loads(sys.argv[1])
def _set(which, soft, hard):
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass
_set(resource.RLIMIT_CPU, _cfg["cpu_s"], _cfg["cpu_s"] + 1)
_set(resource.RLIMIT_AS, _cfg["memory_bytes"], _cfg["memory_bytes"])
_set(resource.RLIMIT_FSIZE, _cfg["file_bytes"], _cfg["file_bytes"])
_set(resource.RLIMIT_CORE, 0, 0)
if _cfg["nproc"]:
    _set(resource.RLIMIT_NPROC, _cfg["nproc"], _cfg["nproc"])

def _make_hook(work, read_roots):
    realpath, fspath, fsdecode, sep = os.path.realpath, os.fspath, os.fsdecode, os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    refuse_exact = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec",
                    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
                    "resource.setrlimit", "resource.prlimit", "ctypes.dlopen", "ctypes.dlsym",
                    "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer", "os.chroot",
                    "sys.remote_exec", "os.setuid", "os.setgid"}
    one_path = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                "os.setxattr", "os.removexattr", "shutil.rmtree", "os.chflags", "os.lchflags"}
    two_paths = {"os.rename", "os.link"}

    def inside(path, roots):
        if isinstance(path, int):
            return True
        p = realpath(fsdecode(fspath(path)))
        return p in devices or any(p == r or p.startswith(r + sep) for r in roots)

    def deny(what):
        raise PermissionError("[sandbox] " + what + " is not allowed in this sandbox")

    def hook(event, args):
        if event in refuse_exact:
            deny(event)
        elif event.startswith("socket."):
            deny("network access (" + event + ")")
        elif event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path, (work,)):
                deny("writing " + repr(path) + " (outside the sandbox directory)")
            if not writing and not inside(path, read_roots):
                deny("reading " + repr(path) + " (outside the sandbox directory)")
        elif event in one_path:
            if not inside(args[0], (work,)):
                deny(event + " on " + repr(args[0]) + " (outside the sandbox directory)")
        elif event in two_paths:
            if not (inside(args[0], (work,)) and inside(args[1], (work,))):
                deny(event + " outside the sandbox directory")
        elif event == "os.symlink":
            if not inside(args[1], (work,)):
                deny("os.symlink outside the sandbox directory")
    return hook

_work = os.path.realpath(_cfg["workdir"])
_roots = [_work] + [os.path.realpath(p) for p in
                    {sys.prefix, sys.base_prefix, sys.exec_prefix, *[p for p in sys.path if os.path.isabs(p)]}]
os.chdir(_work)
sys.argv = ["main.py"]
sys.path[:] = [_work] + [p for p in sys.path if os.path.isabs(p)]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
sys.addaudithook(_make_hook(_work, tuple(_roots)))
del _f, _set, _make_hook, _roots, _work, json, resource
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _exc:  # show the user's frames only (not this bootstrap's or the hook's)
    _te = traceback.TracebackException(type(_exc), _exc, _exc.__traceback__)
    _te.stack = traceback.StackSummary.from_list([f for f in _te.stack if f.filename != "<string>"])
    sys.stderr.write("".join(_te.format()))
    sys.stderr.flush()
    os._exit(1)
'''


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=1)
def _wrappers() -> tuple[tuple[str, ...], tuple[str, ...], dict]:
    """(network prefix, uid-drop prefix, description) available on this machine, probed once."""
    net: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if unshare and _works([unshare, "--net", "--", "true"]):
        net = (unshare, "--net", "--")
    elif unshare and _works([unshare, "--net", "--map-root-user", "--", "true"]):
        net = (unshare, "--net", "--map-root-user", "--")
    drop: tuple[str, ...] = ()
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv and not (net and "--map-root-user" in net):
        cand = (setpriv, f"--ruid={NOBODY_UID}", "--bounding-set=-all", "--no-new-privs", "--")
        if _works([*cand, "true"]):
            drop = cand
    info = {
        "network": "netns+audit_hook" if net else "audit_hook",
        "processes": "rlimit_nproc+audit_hook" if drop or os.geteuid() != 0 else "audit_hook",
        "files": "audit_hook+private_cwd",
        "wall": "killpg", "cpu": "rlimit_cpu", "memory": "rlimit_as",
    }
    return net, drop, info


def isolation() -> dict:
    """Which mechanism enforces each limit on this machine (see the module docstring)."""
    return dict(_wrappers()[2])


def _read(path: str, limit: int, *, tail: bool = False) -> str:
    """The first (or, for ``tail``, the last) ``limit`` characters of a file, saying what was cut."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit * 4 - 16) if tail else 0)
        data = f.read(limit * 4 + 16)
    text = data.decode("utf-8", errors="replace")
    if len(text) <= limit and len(data) == size:
        return text
    if tail:
        return f"[... output truncated; {size} bytes in all]\n" + text[-limit:]
    return text[:limit] + f"\n[... output truncated; {size} bytes in all]"


def _classify(code: int | None, timed_out: bool, stderr: str) -> str | None:
    if timed_out:
        return "timeout"
    if code == -signal.SIGXCPU or code == -signal.SIGKILL:
        return "cpu" if code == -signal.SIGXCPU else "killed"
    if code == -signal.SIGXFSZ:
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    if "File too large" in stderr:
        return "file_size"
    if "[sandbox]" in stderr:
        return "policy"
    return None


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh private directory under ``limits``; never raises for
    anything the code does (errors and violations are in the result)."""
    limits = limits or SandboxLimits()
    net, drop, info = _wrappers()
    root = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    work = os.path.join(root, "work")
    os.mkdir(work)
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cfg = {
            "workdir": work, "cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_mb) << 20,
            "file_bytes": int(limits.max_file_mb) << 20,
            "nproc": int(limits.max_processes) if (drop or os.geteuid() != 0) else 0,
        }
        if os.geteuid() != 0:  # RLIMIT_NPROC counts every process of this user, not only the sandbox's
            cfg["nproc"] = 0
        cmd = [*net, *drop, sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work, "OMP_NUM_THREADS": "1"}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        start = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work, env=env,
                                        start_new_session=True)
            except OSError as exc:
                return SandboxResult("", f"could not start the sandbox: {exc}", None, "killed", 0.0, info)
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        wall = time.perf_counter() - start
        stdout = _read(out_path, limits.max_output_chars)
        stderr = _read(err_path, limits.max_output_chars, tail=True)
        return SandboxResult(stdout, stderr, proc.returncode, _classify(proc.returncode, timed_out, stderr), wall,
                             info)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
