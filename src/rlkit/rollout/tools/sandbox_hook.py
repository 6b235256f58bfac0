"""The sandboxed child's bootstrap (both levels) and the weak level's audit hook and OS probing.

``BOOTSTRAP`` runs in the child before the user's code (as ``python -I -c BOOTSTRAP CONFIG``): at the
weak level it lowers the rlimits and installs a PEP 578 audit hook; at both it runs ``main.py`` in the
work dir and shows the user's frames only. ``weak_wrappers()`` probes which OS pieces the weak level
can add (a network namespace, a real-uid drop).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

__all__ = ["BOOTSTRAP", "NOBODY_UID", "weak_wrappers"]

NOBODY_UID = 65534

# Runs in the child before the user's code: (weak) lower the limits, install the audit hook; run main.py.
BOOTSTRAP = r"""
import json, os, resource, sys, traceback
_cfg = json.loads(sys.argv[1])
def _set(which, soft, hard):
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass
for _name, _value in _cfg["rlimits"].items():  # weak mode only: strict sets them before setpriv
    _set(getattr(resource, _name), _value, _value + 1 if _name == "RLIMIT_CPU" else _value)

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
_roots = [_work] + [os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                  *[p for p in sys.path if os.path.isabs(p)]}]
os.chdir(_work)
sys.argv = ["main.py"]
sys.path[:] = [_work] + [p for p in sys.path if os.path.isabs(p)]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
if _cfg["hook"]:
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
"""


def _works(cmd: list[str]) -> bool:
    try:
        return (
            subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=1)
def weak_wrappers() -> tuple[tuple[str, ...], tuple[str, ...], dict]:
    """Weak mode: (network prefix, uid-drop prefix, description) available here, probed once."""
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
        "mode": "weak",
        "network": "netns+audit_hook" if net else "audit_hook",
        "processes": "rlimit_nproc+audit_hook" if drop or os.geteuid() != 0 else "audit_hook",
        "files": "audit_hook+private_cwd",
        "wall": "killpg",
        "cpu": "rlimit_cpu",
        "memory": "rlimit_as",
    }
    return net, drop, info
