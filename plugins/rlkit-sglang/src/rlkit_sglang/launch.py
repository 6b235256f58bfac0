"""Start SGLang servers: one ``python -m sglang.launch_server`` subprocess per rollout replica, on this node.

The server may run under another Python than the worker's (``launch.python``: SGLang in its own
venv, e.g. the CPU build of ``scripts/sglang-cpu.sh``). Each server is its own process group (a
session), started under ``_guard.py``, which ends the group when the process that launched it dies
(a killed Ray worker leaves no orphan server holding its memory). ``stop()`` ends the group: SIGTERM, then
SIGKILL after ``grace_s``.

CPU (``device: cpu``; verified with SGLang 0.5.15.post1, docs/sglang.md): ``--device cpu
--attention-backend torch_native --disable-overlap-schedule --sleep-on-idle`` (without it the idle
scheduler spins a core), float32, a bounded KV pool, ``SGLANG_USE_CPU_ENGINE=1`` and
``OMP_NUM_THREADS``; never ``--enable-memory-saver`` (CUDA-only). CUDA: ``--tp-size``,
``--mem-fraction-static``, ``--enable-memory-saver`` unless turned off (unverified here: no GPU).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rlkit_sglang.client import SglangClient, SglangServerError
from rlkit_sglang.params import SglangLaunchParams

__all__ = [
    "server_command",
    "LocalServer",
    "PortTakenError",
    "start_on_a_free_port",
    "launch_servers",
    "CPU_DEFAULTS",
]

logger = logging.getLogger(__name__)

GUARD = str(Path(__file__).with_name("_guard.py"))
CPU_DEFAULTS = {"context_length": 1024, "max_total_tokens": 8192, "max_running_requests": 64}


# SGLang opens more ports derived from --port (its gRPC port is --port + 10000, which it refuses above 65535).
_DERIVED_PORT_OFFSETS = (0, 10000)
_PORT_FLOOR = 10000
_FALLBACK_RANGE = (20000, 55536)
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


class PortTakenError(SglangServerError):
    """The server could not bind its port: another socket took it between the draw and the bind."""


def _ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' local ports (inclusive), or None where unreadable."""
    try:
        low, high = (int(v) for v in Path(_EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _port_ranges() -> list[tuple[int, int]]:
    """Half-open ranges to draw a server's ``--port`` from: the port and its derived ports lie outside the
    kernel's ephemeral range. A port inside it can be taken by any outgoing connection (Ray, gloo, zmq make
    many) during the minute a server loads before it binds; a connected socket's local port refuses the bind
    even with SO_REUSEADDR (CI lost a run to it). Where no such room exists, the old fixed range."""
    top = 65536 - max(_DERIVED_PORT_OFFSETS)
    ephemeral = _ephemeral_range()
    if ephemeral is None:
        return [_FALLBACK_RANGE]
    low, high = ephemeral
    ranges = []
    span = max(_DERIVED_PORT_OFFSETS)
    below = (_PORT_FLOOR, min(top, low - span))  # port + span < low
    above = (max(_PORT_FLOOR, high + 1), top)  # port > high
    for start, stop in (below, above):
        if stop - start >= 100:
            ranges.append((start, stop))
    return ranges or [_FALLBACK_RANGE]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_port(attempts: int = 200) -> int:
    """A port for a server's ``--port`` (see ``_port_ranges``) whose SGLang-derived ports
    (``_DERIVED_PORT_OFFSETS``) are free as well."""
    import random

    rng = random.Random()
    ranges = _port_ranges()
    for _ in range(attempts):
        start, stop = rng.choice(ranges)
        port = rng.randrange(start, stop)
        if all(_bindable(port + offset) for offset in _DERIVED_PORT_OFFSETS):
            return port
    where = ", ".join(f"{a}-{b - 1}" for a, b in ranges)
    raise SglangServerError(
        f"no free port in {where} with port + 10000 free too (SGLang's gRPC port) after {attempts} tries; "
        "free some ports or pass urls of running servers"
    )


def server_command(
    params: SglangLaunchParams,
    model_path: str,
    device: str,
    port: int,
    lora: tuple[int, list[str]] | None = None,
) -> tuple[list[str], dict]:
    """``(argv, extra environment)`` of one server on ``device`` ("cpu" | "cuda"); ``lora``: ``(rank, target
    modules)`` of the adapters it will be sent (``--enable-lora``)."""
    python = params.python or sys.executable
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        params.host,
        "--port",
        str(port),
    ]
    env: dict[str, str] = {}
    if device == "cpu":
        cmd += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-overlap-schedule",
            "--sleep-on-idle",
            "--dtype",
            params.dtype or "float32",
        ]
        env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(params.threads)}
        limits = {k: getattr(params, k) or v for k, v in CPU_DEFAULTS.items()}
    else:
        cmd += [
            "--tp-size",
            str(params.tp_size),
            "--mem-fraction-static",
            str(params.mem_fraction_static),
            "--dtype",
            params.dtype or "bfloat16",
        ]
        if params.enable_memory_saver is not False:
            cmd.append("--enable-memory-saver")
        limits = {k: getattr(params, k) for k in CPU_DEFAULTS}
    for key, value in limits.items():
        if value is not None:
            cmd += ["--" + key.replace("_", "-"), str(value)]
    if lora is not None:  # CUDA only: on CPU SGLang's LoRA layers fail at start (the backend merges instead)
        rank, modules = lora
        cmd += [
            "--enable-lora",
            "--max-lora-rank",
            str(rank),
            "--lora-target-modules",
            *modules,
            "--max-loras-per-batch",
            "1",
        ]
    return cmd + list(params.extra_args), env


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalServer:
    """One SGLang server process group on this node; healthy when the constructor returns."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        *,
        host: str,
        port: int,
        log_path: str,
        startup_timeout_s: float = 600.0,
        separate_python: bool = False,
        remove: tuple[str, ...] = (),
    ):
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self._log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        full_env = {**os.environ, **env}
        if separate_python:  # our source paths must not shadow the SGLang venv's packages
            full_env.pop("PYTHONPATH", None)
        with open(log_path, "ab") as log:
            # folders the guard deletes if this process dies
            cleanup = [arg for path in remove for arg in ("--remove", path)]
            self.proc = subprocess.Popen(
                [cmd[0], GUARD, str(os.getpid()), *cleanup, *cmd],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        client = SglangClient(self.url, retries=0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            problem = self.problem()
            if problem:
                raise SglangServerError(
                    f"{problem} while starting. Last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self._port_taken():  # SGLang lingers ~120 s after a failed bind before it ends itself
                raise PortTakenError(
                    f"SGLang server {self.url} could not bind its port (address already in use; log "
                    f"{self.log_path})"
                )
            if client.health(timeout_s=2.0):
                return
            time.sleep(0.5)
        raise SglangServerError(
            f"SGLang server {self.url} was not healthy (GET /health) within {timeout_s:.0f} s "
            f"(launch.startup_timeout_s). Last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    def _port_taken(self) -> bool:
        """Whether this launch's part of the log reports a failed bind (uvicorn: ``[Errno 98] error while
        attempting to bind on address (...): address already in use``)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return b"address already in use" in f.read().lower()
        except OSError:
            return False

    def problem(self) -> str | None:
        """None while the server process lives; else what happened (the client's liveness watch)."""
        code = self.proc.poll()
        if code is None:
            return None
        return (
            f"SGLang server {self.url} exited (code {code}; log {self.log_path}, last line: "
            f"{_tail(self.log_path, 1)!r})"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's process group: SIGTERM, then SIGKILL after ``grace_s``."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            try:  # the group may outlive its leader for a moment (scheduler subprocesses)
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)


def start_on_a_free_port(
    command_for: Callable[[int], tuple[list[str], dict]],
    *,
    host: str,
    log_dir: Path,
    startup_timeout_s: float,
    separate_python: bool,
    remove: tuple[str, ...] = (),
    attempts: int = 3,
) -> LocalServer:
    """One healthy server of ``command_for(port)`` (``(argv, extra environment)``) on a port drawn by
    ``_free_port``; drawn again, up to ``attempts`` times, when another socket took the port before the
    server bound it (``PortTakenError``). Logs go to ``log_dir/sglang-PORT.log``."""
    for attempt in range(1, attempts + 1):
        port = _free_port()
        cmd, env = command_for(port)
        try:
            return LocalServer(
                cmd,
                env,
                host=host,
                port=port,
                log_path=str(log_dir / f"sglang-{port}.log"),
                startup_timeout_s=startup_timeout_s,
                separate_python=separate_python,
                remove=remove,
            )
        except PortTakenError as err:
            if attempt == attempts:
                raise PortTakenError(
                    f"{err}; {attempts} ports tried, each taken before the server bound it"
                ) from err
            logger.warning("%s; starting it again on another port", err)
    raise AssertionError("unreachable")


def launch_servers(
    params: SglangLaunchParams,
    model_path: str,
    device: str,
    lora: tuple[int, list[str]] | None = None,
    remove: tuple[str, ...] = (),
) -> list[LocalServer]:
    """Start ``params.num_replicas`` servers of ``model_path`` on ``device`` (one after another: each
    loads the model; on CPU two at once only compete for the cores). Stops the started ones on failure.
    ``lora``: see ``server_command``; ``remove``: folders the servers' guards delete if this process dies."""
    servers: list[LocalServer] = []
    log_dir = Path(params.log_dir or os.getcwd())
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for _ in range(params.num_replicas):
            servers.append(
                start_on_a_free_port(
                    lambda port: server_command(params, model_path, device, port, lora),
                    host=params.host,
                    log_dir=log_dir,
                    startup_timeout_s=params.startup_timeout_s,
                    separate_python=params.python is not None,
                    remove=remove,
                )
            )
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
