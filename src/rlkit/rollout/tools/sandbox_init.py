"""Stage 1 of the strict sandbox: build the child's world, then start it with no privilege.

Run by ``rlkit.rollout.tools.sandbox`` as ``unshare --mount --pid --fork --net --ipc --uts [--user
--map-root-user] -- python -I -S sandbox_init.py CONFIG``: it is pid 1 of a fresh pid namespace and
(namespace) root in a fresh mount namespace, with only the standard library. It

1. mounts a tmpfs as the new root and bind-mounts into it, read-only and without submounts, only what
   the interpreter needs (``/usr``, the Python prefixes, a few ``/etc`` files, four ``/dev`` nodes);
2. mounts a private tmpfs at ``/tmp`` (the work dir, size-limited, owned by the sandbox uid) holding
   ``main.py``, and a ``/proc`` of the new pid namespace;
3. ``pivot_root``s into it, detaches the old root and remounts ``/`` read-only;
4. forks the child, which lowers its rlimits and execs ``setpriv`` (drop uid/gid to the sandbox id,
   clear groups, ``no_new_privs``, empty bounding/inheritable/ambient capability sets) and then Python;
5. reaps every process until the child exits, writes its status to the host's status file and exits
   — which makes the kernel kill whatever the child left behind in the namespace. It also exits after
   its own lifetime (wall limit + 2 s), so the namespace ends even if the parent died without killing it.

Any failure before step 4 is written to stderr as ``[sandbox-setup] ...`` and exits 125: the caller
treats that as "the boundary could not be built", never as the user's code failing.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_RELATIME = 1 << 21
MNT_DETACH = 2
PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEV_NODES = ("null", "zero", "random", "urandom")
ETC_FILES = ("ld.so.cache", "localtime", "passwd", "group", "nsswitch.conf")
SETUP_FAILED = 125
TIMED_OUT = 124

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(_b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), _b(data)),
        f"mount {src or ''} -> {dst} ({fstype or 'bind/remount'})",
    )


def _kept_flags(path: str) -> int:
    """The per-mount flags of ``path``'s mount: a remount must keep them (they are locked in a user ns)."""
    f = os.statvfs(path).f_flag
    pairs = (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    )
    return sum(ms for st, ms in pairs if f & st)


def bind_ro(src: str, root: str, dst: str | None = None, *, nodev: bool = True) -> None:
    """Bind ``src`` (no submounts) read-only at ``root + (dst or src)``, creating the mount point."""
    target = root + (dst or src)
    if os.path.isdir(src):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "a"):
            pass
    mount(src, target, None, MS_BIND)
    extra = MS_NOSUID | (MS_NODEV if nodev else 0)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra | _kept_flags(src))


def build_root(cfg: dict) -> dict:
    """Steps 1-3 of the module docstring; returns what was set up (for the probe's report)."""
    root, uid = cfg["newroot"], cfg["uid"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.mkdir(root + "/tmp", 0o700)  # first: a Python prefix under /tmp (a CI venv) is bound inside it
    tmp_opts = f"mode=0700,uid={uid},gid={uid},size={cfg['tmp_bytes']},nr_inodes={cfg['tmp_inodes']}"
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
    for top in ("bin", "lib", "lib64", "sbin"):  # merged-/usr links (/bin -> usr/bin) or real dirs
        host = "/" + top
        if os.path.islink(host):
            os.symlink(os.readlink(host), root + host)
        elif os.path.isdir(host):
            bind_ro(host, root)
    for src, dst in cfg["binds"]:
        bind_ro(src, root, dst)
    for name in ETC_FILES:
        if os.path.exists("/etc/" + name):
            bind_ro(os.path.realpath("/etc/" + name), root, "/etc/" + name)
    for name in DEV_NODES:
        bind_ro("/dev/" + name, root, "/dev/" + name, nodev=False)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    with open(cfg["code_path"], "rb") as src, open(root + "/tmp/main.py", "wb") as dst:
        dst.write(src.read())
    os.chown(root + "/tmp/main.py", uid, uid)
    os.mkdir(root + "/proc", 0o555)
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        proc = True
    except SetupError:  # e.g. a user namespace under a masked /proc: the child simply has no /proc
        proc = False
    _pivot(root)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return {"proc": proc}


def _pivot(root: str) -> None:
    """Make ``root`` the root of this mount namespace and detach the old one (no way back up)."""
    os.chdir(root)
    nr = PIVOT_ROOT_NR.get(platform.machine())
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _limit(cfg: dict) -> None:
    for name, value in cfg["rlimits"].items():
        which = getattr(resource, name)
        soft, hard = (value, value + 1) if name == "RLIMIT_CPU" else (value, value)
        resource.setrlimit(which, (soft, hard))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status = open(cfg["status_path"], "w", encoding="utf-8")  # host file: opened before the pivot
    try:
        built = build_root(cfg)
    except (SetupError, OSError) as exc:
        sys.stderr.write(f"[sandbox-setup] {exc}\n")
        status.write(json.dumps({"setup_error": str(exc)}))
        status.close()
        os._exit(SETUP_FAILED)
    os.chdir("/tmp")
    # a lifetime of its own: should the parent die without killing us, the namespace still ends
    signal.signal(signal.SIGALRM, lambda *_: os._exit(TIMED_OUT))
    signal.alarm(int(cfg["lifetime_s"]) + 1)
    child = os.fork()
    if child == 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            _limit(cfg)
            os.execv(cfg["argv"][0], cfg["argv"])
        except BaseException as exc:  # noqa: BLE001 - report anything, then die
            sys.stderr.write(f"[sandbox-setup] starting the child: {exc}\n")
        os._exit(SETUP_FAILED)
    code = None
    while True:
        try:
            pid, wstatus = os.wait()
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(wstatus)
            break
    status.write(json.dumps({"exit_code": code, **built}))
    status.close()
    os._exit(0)


if __name__ == "__main__":
    main()
