"""Run untrusted Python in a child process behind an OS boundary; report every violation as a result.

Two isolation levels (``SandboxLimits.isolation``, the python tool's ``isolation`` param):

``strict`` (default) — the boundary is the kernel's, built from util-linux (``unshare``, ``setpriv``)
by ``rlkit.rollout.tools.sandbox_init``:

=================  ==================================================================================
who                real, effective and saved uid/gid 65534 (``nobody``), no supplementary groups,
                   ``no_new_privs``, empty bounding/permitted/effective/inheritable/ambient capability
                   sets. Not root: inside a user namespace (``--map-root-user``) uid 0 of that
                   namespace, i.e. the invoking user outside, with the same empty capability sets.
files              own mount namespace; root is a read-only tmpfs holding read-only binds of ``/usr``,
                   the Python prefixes, five ``/etc`` files and ``/dev/{null,zero,random,urandom}``;
                   ``/tmp`` (cwd, HOME, TMPDIR) a private size-limited tmpfs; the host's root detached.
processes          own pid namespace (the trainer is invisible; pid 1 is the sandbox's init, whose exit
                   kills everything left), ``RLIMIT_NPROC``
network / IPC      own network (no interface but a down ``lo``), IPC and UTS namespaces
resources          ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``;
                   wall time: the parent kills the process group (the namespace dies with its init)
environment        a fixed allow-list (PATH, LANG, HOME, TMPDIR, OMP_NUM_THREADS)
=================  ==================================================================================

``weak`` — what runs where strict cannot (no root and no user namespaces): the same rlimits, a private
directory, a network namespace and a uid drop where the OS gives them, and a PEP 578 audit hook that
refuses files outside the directory, sockets, fork/exec/kill and ctypes. The hook is a Python-level
guard that C-level code can step around; the tool warns when it is used.

``isolation()`` reports what a probe child actually observed (uids, capabilities, namespaces, a write
to ``/``), never what is assumed. ``PythonTool`` refuses to start when strict is asked for and the
probe fails.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from rlkit.errors import RlkitError
from rlkit.rollout.tools.sandbox_hook import BOOTSTRAP, NOBODY_UID, weak_wrappers

__all__ = ["SandboxLimits", "SandboxResult", "SandboxError", "run_python", "isolation", "require_isolation"]

ISOLATION_LEVELS = ("strict", "weak")
_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py")
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}


class SandboxError(RlkitError):
    """The sandbox asked for cannot be given on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock seconds before the process group is killed
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS); Python itself needs ~30 MiB
    max_processes: int = 16  # RLIMIT_NPROC for the sandbox uid
    max_file_mb: int = 16  # largest file the code may write, stdout/stderr included (RLIMIT_FSIZE)
    max_output_chars: int = 4000  # stdout and stderr are each cut to this many characters
    max_open_files: int = 64  # RLIMIT_NOFILE
    isolation: str = "strict"  # "strict": the OS boundary or refuse; "weak": audit hook + what the OS gives


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    # None, "timeout", "cpu", "memory", "file_size", "policy", "killed", "setup"
    violation: str | None
    wall_s: float
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.violation is None


# ----- strict: unshare + sandbox_init (mounts, pivot_root) + setpriv --------------------------------
@dataclass(frozen=True)
class _Plan:
    prefix: tuple[str, ...]  # unshare ... --
    drop: tuple[str, ...]  # setpriv ... --
    uid: int  # the sandbox's uid inside its namespaces
    user_ns: bool


def _plan(user_ns: bool) -> _Plan | str:
    """The strict launcher as root (``user_ns=False``) or in a user namespace; or why it cannot be."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if not unshare or not setpriv:
        return "util-linux `unshare` and `setpriv` are not both on PATH"
    setpriv = os.path.realpath(setpriv)
    if not setpriv.startswith("/usr/"):
        return f"`setpriv` is at {setpriv}, outside /usr (the sandbox's root only binds /usr)"
    ns = ("--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts")
    caps = ("--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all")
    if user_ns:  # setgroups is denied in the namespace; the only mapped id is 0 (= the invoking user)
        return _Plan((unshare, "--user", "--map-root-user", *ns, "--"), (setpriv, *caps, "--"), 0, True)
    ids = (f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups")
    return _Plan((unshare, *ns, "--"), (setpriv, *ids, *caps, "--"), NOBODY_UID, False)


def _binds() -> list[tuple[str, str]]:
    """(host path, path in the sandbox): /usr and the interpreter's prefixes, under their real path and
    under the spelling the interpreter uses (a venv behind a symlinked directory); nested ones dropped."""
    prefixes = (
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    )
    pairs = {"/usr": "/usr"}
    for p in prefixes:
        real = os.path.realpath(p)
        pairs.setdefault(real, real)
        pairs.setdefault(os.path.abspath(p), real)
    pairs = {dst: src for dst, src in pairs.items() if dst != "/" and os.path.isdir(src)}
    return sorted((src, dst) for dst, src in pairs.items() if not any(dst.startswith(q + "/") for q in pairs))


_PROBE = r"""
import json, os, resource, socket
def status():
    try:
        with open("/proc/self/status") as f:
            return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    except OSError:
        return {}
def can_write(path):
    try:
        open(path, "w").close()
        return True
    except OSError:
        return False
st = status()
ns = {}
for n in ("mnt", "pid", "net", "ipc", "uts", "user"):
    try:
        ns[n] = os.readlink("/proc/self/ns/" + n)
    except OSError:
        ns[n] = None
print(json.dumps({
    "resuid": os.getresuid(), "resgid": os.getresgid(), "groups": os.getgroups(),
    "caps": {k: st.get(k, "?").strip() for k in ("CapPrm", "CapEff", "CapBnd", "CapInh", "CapAmb")},
    "no_new_privs": st.get("NoNewPrivs", "?").strip(), "ns": ns, "pid": os.getpid(),
    "root_writable": can_write("/probe"), "tmp_writable": can_write("/tmp/probe"),
    "interfaces": [name for _, name in socket.if_nameindex()], "env": sorted(os.environ),
    "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[1], "as": resource.getrlimit(resource.RLIMIT_AS)[1],
    "root_entries": sorted(os.listdir("/"))}))
"""


def _host_ns() -> dict:
    return {n: os.readlink(f"/proc/self/ns/{n}") for n in ("mnt", "pid", "net", "ipc", "uts", "user")}


def _judge(plan: _Plan, seen: dict, wall: float) -> dict | str:
    """The isolation report from what the probe child saw, or why it falls short of strict."""
    host = _host_ns()
    fresh = sorted(n for n in ("mnt", "pid", "net", "ipc", "uts") if seen["ns"].get(n) not in (None, host[n]))
    no_caps = all(v == "0000000000000000" for v in seen["caps"].values())
    problems = []
    if seen["resuid"] != [plan.uid] * 3 or seen["resgid"] != [plan.uid] * 3:
        problems.append(f"uids {seen['resuid']} gids {seen['resgid']} (expected {plan.uid})")
    if not plan.user_ns and seen["groups"]:
        problems.append(f"supplementary groups {seen['groups']} were not cleared")
    if not no_caps:
        problems.append(f"capabilities left: {seen['caps']}")
    if seen["no_new_privs"] != "1":
        problems.append("no_new_privs is not set")
    if fresh != ["ipc", "mnt", "net", "pid", "uts"]:
        problems.append(f"only these namespaces are new: {fresh}")
    if seen["root_writable"] or not seen["tmp_writable"]:
        problems.append("/ is writable or /tmp is not")
    if problems:
        return "the probe child " + "; ".join(problems)
    outer = os.getuid() if plan.user_ns else plan.uid
    return {
        "mode": "strict",
        "mechanism": "util-linux unshare + pivot_root + setpriv",
        "user_namespace": plan.user_ns,
        "uid": f"{plan.uid} real/effective/saved"
        + (f" in a user namespace (= uid {outer} outside)" if plan.user_ns else " (nobody)"),
        "groups": seen["groups"],
        "capabilities": "none",
        "no_new_privs": True,
        "namespaces": fresh,
        "filesystem": f"read-only root {seen['root_entries']}, private tmpfs /tmp",
        "network": f"interfaces {seen['interfaces']} (own namespace)",
        "rlimits": "cpu, as, fsize, nofile, nproc, core",
        "wall": "killpg + pid-namespace init",
        "environment": seen["env"],
        "startup_s": round(wall, 3),
    }


@functools.lru_cache(maxsize=1)
def _strict() -> tuple[_Plan, dict] | str:
    """The strict plan for this user, with its probed report; or why it falls short (probed once).
    Root gets the uid drop, never the user-namespace path: there uid 0 inside is the real root outside,
    whose file permissions would be no boundary."""
    plan = _plan(user_ns=os.geteuid() != 0)
    if isinstance(plan, str):
        return plan
    report = _probe(plan)
    return report if isinstance(report, str) else (plan, report)


def _probe(plan: _Plan) -> dict | str:
    """Run the probe child under ``plan``: its isolation report, or why the boundary is not there."""
    res = _run_strict(_PROBE, SandboxLimits(wall_s=20.0, cpu_s=10), plan)
    if not res.ok:
        where = "user namespace" if plan.user_ns else "root"
        return f"the probe child failed ({where}): {res.stderr.strip()[-600:] or res.violation}"
    return _judge(plan, json.loads(res.stdout), res.wall_s)


def isolation(level: str = "strict") -> dict:
    """What the sandbox of ``level`` enforces here, as a probe child observed it.
    Strict where unavailable: ``{"mode": "unavailable", "reason": ...}``."""
    if level == "weak":
        return dict(weak_wrappers()[2])
    strict = _strict()
    if isinstance(strict, str):
        return {"mode": "unavailable", "reason": strict}
    return dict(strict[1])


def require_isolation(level: str, where: str = "python tool") -> dict:
    """Check that ``level`` can be given here (``SandboxError`` if strict cannot); warn on weak."""
    if level not in ISOLATION_LEVELS:
        raise SandboxError(f"{where}: isolation {level!r} is not a level; valid: {list(ISOLATION_LEVELS)}.")
    if level == "weak":
        import warnings

        warnings.warn(
            f"{where}: isolation 'weak' — model-written code runs behind an audit hook and rlimits "
            "only, no OS boundary: C-level code can escape it. Use it only for trusted code.",
            RuntimeWarning,
            stacklevel=3,
        )
        return isolation("weak")
    strict = _strict()
    if isinstance(strict, str):
        raise SandboxError(
            f"{where}: strict isolation is not available on this machine: {strict}. It needs util-linux "
            "`unshare` and `setpriv` under /usr, and root or unprivileged user namespaces "
            "(user.max_user_namespaces > 0; on Ubuntu also kernel.apparmor_restrict_unprivileged_userns=0). "
            "Fix that, or opt into the weaker audit-hook sandbox by name: "
            "rollout.tools: [{name: python, isolation: weak}]."
        )
    return dict(strict[1])


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
    if "[sandbox-setup]" in stderr:
        return "setup"
    if "MemoryError" in stderr:
        return "memory"
    if "File too large" in stderr:
        return "file_size"
    if "[sandbox]" in stderr:
        return "policy"
    return None


def _rlimits(limits: SandboxLimits, nproc: bool) -> dict:
    out = {
        "RLIMIT_CPU": int(limits.cpu_s),
        "RLIMIT_AS": int(limits.memory_mb) << 20,
        "RLIMIT_FSIZE": int(limits.max_file_mb) << 20,
        "RLIMIT_CORE": 0,
        "RLIMIT_NOFILE": int(limits.max_open_files),
    }
    if nproc:
        out["RLIMIT_NPROC"] = int(limits.max_processes)
    return out


def _bootstrap(workdir: str, rlimits: dict, hook: bool) -> list[str]:
    cfg = {"workdir": workdir, "rlimits": rlimits, "hook": hook}
    return [sys.executable, "-I", "-c", BOOTSTRAP, json.dumps(cfg)]


def _run_strict(code: str, limits: SandboxLimits, plan: _Plan) -> SandboxResult:
    root = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    try:
        os.mkdir(os.path.join(root, "newroot"))
        with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        status = os.path.join(root, "status")
        cfg = {
            "newroot": os.path.join(root, "newroot"),
            "uid": plan.uid,
            "binds": _binds(),
            "code_path": os.path.join(root, "main.py"),
            "status_path": status,
            "tmp_bytes": 4 * (int(limits.max_file_mb) << 20),
            "lifetime_s": math.ceil(limits.wall_s) + 1,
            "tmp_inodes": 4096,
            "rlimits": _rlimits(limits, nproc=True),
            "argv": [*plan.drop, *_bootstrap("/tmp", {}, hook=False)],
        }
        cmd = [*plan.prefix, sys.executable, "-I", "-S", _INIT, json.dumps(cfg)]
        env = {**_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}
        res = _spawn(cmd, env, root, limits)
        try:
            with open(status, encoding="utf-8") as f:
                reported = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            reported = {}
        # unshare --fork re-raising its child's SIGKILL says so on stderr: not the user's output
        res.stderr = "".join(
            line
            for line in res.stderr.splitlines(keepends=True)
            if not line.startswith("unshare: sigprocmask")
        )
        if "exit_code" in reported and res.violation != "timeout":
            res.exit_code = reported["exit_code"]
            res.violation = _classify(res.exit_code, False, res.stderr)
        elif res.violation is None and not reported:
            res.violation = "setup"  # unshare or the init died before reporting
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_weak(code: str, limits: SandboxLimits) -> SandboxResult:
    net, drop, info = weak_wrappers()
    root = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    work = os.path.join(root, "work")
    os.mkdir(work)
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        nproc = bool(drop)  # RLIMIT_NPROC counts every process of a uid: only under the dropped uid
        cmd = [*net, *drop, *_bootstrap(work, _rlimits(limits, nproc), hook=True)]
        env = {**_ENV, "HOME": work, "TMPDIR": work}
        res = _spawn(cmd, env, root, limits, cwd=work)
        res.isolation = info
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _spawn(
    cmd: list[str], env: dict, root: str, limits: SandboxLimits, cwd: str | None = None
) -> SandboxResult:
    """Run ``cmd`` in its own session, stdout/stderr in files under ``root``; kill its group at the end."""
    out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
    start = time.perf_counter()
    timed_out = False
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd or root,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            return SandboxResult(
                "", f"[sandbox-setup] could not start the sandbox: {exc}", None, "setup", 0.0
            )
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_children(proc)
        _kill_group(proc.pid)
        proc.wait()
    wall = time.perf_counter() - start
    stdout = _read(out_path, limits.max_output_chars)
    stderr = _read(err_path, limits.max_output_chars, tail=True)
    return SandboxResult(stdout, stderr, proc.returncode, _classify(proc.returncode, timed_out, stderr), wall)


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh private directory under ``limits``; never raises for
    anything the code does (errors and violations are in the result). Strict isolation that this
    machine cannot give is a ``setup`` violation here (``PythonTool`` refuses earlier)."""
    limits = limits or SandboxLimits()
    if limits.isolation == "weak":
        return _run_weak(code, limits)
    strict = _strict()
    if isinstance(strict, str):
        return SandboxResult(
            "",
            f"[sandbox-setup] strict isolation is unavailable: {strict}",
            None,
            "setup",
            0.0,
            {"mode": "unavailable", "reason": strict},
        )
    res = _run_strict(code, limits, strict[0])
    res.isolation = dict(strict[1])
    return res


def _kill_children(proc: subprocess.Popen) -> None:
    """Kill the direct children of ``proc`` and wait for ``proc``: for ``unshare --fork`` the child is the
    pid namespace's init, and ``unshare`` returns only once the kernel has killed everything in it."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children", encoding="ascii") as f:
            children = [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
