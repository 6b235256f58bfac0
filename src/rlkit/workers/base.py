"""``Worker``: the base class of every role class (one instance per rank, one process per instance).

Constructor contract (``WorkerGroup`` calls it inside a Ray actor; torchrun-style launchers can too)::

    class MyRole(Worker):
        def __init__(self, rank, world_size, master_addr, master_port, device, threads=1, *, config):
            super().__init__(rank, world_size, master_addr, master_port, device, threads)
            ...  # build the model; torch.distributed is ready here

        def compute(self, batch: Batch) -> Batch: ...   # called by group.call("compute", batch)

The base constructor sets ``torch.set_num_threads(threads)``, picks the device (``cpu``, or the CUDA
device Ray assigned, which is ``cuda:0`` inside the actor since Ray narrows ``CUDA_VISIBLE_DEVICES``),
and joins the process group: gloo on the CPU, nccl on CUDA, rendezvous over ``tcp://master:port``
(on loopback, rank 0 serves the rendezvous store from a socket bound to 127.0.0.1 only).
Every rank's constructor must run at the same time (the rendezvous waits for all of them), which is
what ``WorkerGroup`` does. The role kwargs are the subclass's business.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.hardware import dist_backend

__all__ = ["Worker", "ephemeral_ports", "find_free_port", "loopback_ifname"]


# Ray's workers listen on 10002-19999 by default (ray start --min/max-worker-port); ports from 20000 up to the
# kernel's ephemeral range are handed out by nobody unless a program asks for one by number.
_FIRST_CHOSEN_PORT = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux: ``ip_local_port_range``; IANA's
    49152-65535 elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, chosen below the kernel's ephemeral range (from 20000 up), so that no
    port-0 bind or outgoing connection — Ray's processes make many — can take it before rank 0 binds it (a
    port the OS handed out once, as ``bind(0)`` gives, can be handed out again: "Address already in use" in
    a worker's constructor, seen in the test suite). Falls back to an OS-chosen port where that span is empty
    or full."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = ephemeral_ports()[0] - 1
    candidates = random.Random().sample(
        range(_FIRST_CHOSEN_PORT, top + 1), k=min(64, max(0, top - _FIRST_CHOSEN_PORT + 1))
    )
    for port in [*candidates, 0]:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on {host}")


def loopback_ifname() -> str | None:
    """The loopback interface name (``lo`` on Linux, ``lo0`` on macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n.startswith("lo")), None)


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


class Worker:
    """One rank of a worker group. Exposes ``rank``, ``world_size``, ``device``; ``destroy()`` at the end."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        device: str,
        threads: int = 1,
        *,
        timeout_s: float = 1800.0,
    ):
        self.rank = rank
        self.world_size = world_size
        self.threads = threads
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if device.startswith("cuda"):
            self.device = torch.device(device if ":" in device else "cuda:0")
            torch.cuda.set_device(self.device)
        elif device == "cpu":
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"Worker device must be 'cpu' or 'cuda[:i]', got {device!r}.")
        backend = dist_backend(self.device)  # nccl on CUDA, gloo on CPU (rlkit.hardware)
        self._store_socket: socket.socket | None = None
        timeout = timedelta(seconds=timeout_s)
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process; one Worker per process."
            )
        if _is_loopback(master_addr):
            # Keep every socket on loopback: gloo's own (it otherwise binds the host's address) and the
            # rendezvous store's (torch's TCPStore server listens on all interfaces unless handed a socket).
            lo = loopback_ifname()
            if lo:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
            store = self._loopback_store(master_addr, master_port, timeout)
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        else:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )

    def _loopback_store(self, addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
        """The rendezvous store; rank 0 serves it from a socket bound to ``addr`` only."""
        if self.rank != 0:
            return dist.TCPStore(addr, port, self.world_size, is_master=False, timeout=timeout)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen()
        self._store_socket = sock  # keep the descriptor open as long as the store serves it
        return dist.TCPStore(
            addr,
            port,
            self.world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )

    # ----- helpers the group uses -------------------------------------------------------------
    def ping(self) -> tuple[int, int, int]:
        """``(rank, world_size, pid)``; proves the actor is alive and constructed."""
        return self.rank, self.world_size, os.getpid()

    def started_with(self, name: str) -> bool:
        """Whether this process started with the environment variable ``name``: its initial environment
        (``/proc/self/environ``, what the C library read at start; False where unreadable), not
        ``os.environ``, which Python may have changed since (``rlkit.hardware.allocator``)."""
        try:
            start = Path("/proc/self/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return any(entry.startswith(name.encode() + b"=") for entry in start)

    def where(self) -> dict[str, object]:
        """Liveness probe, answered beside a busy method (``WorkerGroup`` runs it in its own concurrency
        group): the pid, and the method this rank is running with its innermost frame, if any."""
        methods = {
            name for name in dir(type(self)) if not name.startswith("_") and name not in ("where", "ping")
        }
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack = traceback.extract_stack(frame)
            running = [f for f in stack if f.name in methods]
            if running:
                inner = stack[-1]
                return {
                    "pid": os.getpid(),
                    "method": running[0].name,
                    "at": f"{inner.filename}:{inner.lineno} in {inner.name}",
                }
        return {"pid": os.getpid(), "method": None, "at": None}

    def destroy(self) -> None:
        """Leave the process group (idempotent). Subclasses free their models, then call this."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store_socket is not None:
            self._store_socket.close()
            self._store_socket = None
