"""Start SGLang servers: one ``python -m sglang.launch_server`` per rollout replica.

UNVERIFIED: SGLang needs CUDA, which the machine this was written on does not have. This code path
has never started a real SGLang server; only the client and the backend were tested, against
``rlkit serve`` (docs/sglang.md). The command line follows SGLang 0.5's ``server_args``.

Inside Ray (the trainer's case) each replica is a Ray actor holding ``tp_size`` GPUs — placed on
the role's resource pool when the caller passes ``placements`` (``ResourcePool.location(rank)``
pairs) — that starts the server on its node and reports the URL. Without Ray, servers start as
local subprocesses.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from rlkit_sglang.client import SglangClient, SglangServerError

__all__ = ["LaunchConfig", "server_command", "LocalServer", "launch_servers"]


@dataclass
class LaunchConfig:
    model_path: str
    num_replicas: int = 1  # rollout engines (data parallel)
    tp_size: int = 1  # GPUs per engine (tensor parallel)
    mem_fraction_static: float = 0.6  # GPU memory for weights + KV cache (leave room for training)
    dtype: str = "bfloat16"
    enable_memory_saver: bool = True  # needed by /release_memory_occupation (hybrid engine)
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)  # passed through to sglang.launch_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def server_command(cfg: LaunchConfig, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(port), "--tp-size", str(cfg.tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static),
           "--dtype", cfg.dtype]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    return cmd + list(cfg.extra_args)


class LocalServer:
    """One SGLang server process on this node."""

    def __init__(self, cfg: LaunchConfig, log_path: str | None = None):
        self.port = _free_port()
        self.url = f"http://{cfg.host}:{self.port}"
        self.log_path = log_path or os.path.join(os.getcwd(), f"sglang-{self.port}.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(server_command(cfg, self.port), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            SglangClient(self.url).wait_healthy(cfg.startup_timeout_s)
        except SglangServerError as exc:
            self.stop()
            raise SglangServerError(f"{exc} Server log: {self.log_path} (exit code {self.proc.poll()}).") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _ServerActor:
    """Ray actor body: owns one LocalServer on its node."""

    def __init__(self, cfg: LaunchConfig):
        import ray

        cfg.host = ray.util.get_node_ip_address()
        self.server = LocalServer(cfg)

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def launch_servers(cfg: LaunchConfig, placements: list[tuple[Any, int]] | None = None) -> tuple[list[str], list[Any]]:
    """Start ``cfg.num_replicas`` servers; returns ``(urls, handles)`` (``handle.stop()`` / Ray actors)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - rlkit depends on ray
        ray = None
    if ray is None or not ray.is_initialized():
        servers = [LocalServer(cfg) for _ in range(cfg.num_replicas)]
        return [s.url for s in servers], servers
    actor_cls = ray.remote(num_gpus=cfg.tp_size)(_ServerActor)
    actors = []
    for rank in range(cfg.num_replicas):
        options: dict[str, Any] = {}
        if placements:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg, bundle = placements[rank % len(placements)]
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle)
        actors.append(actor_cls.options(**options).remote(cfg))
    urls = ray.get([a.url.remote() for a in actors])
    return urls, actors
