"""Start a local Ray cluster bound to loopback, or join one; stop only what was started.

    with RayCluster(recipe.resources) as cluster:
        ...  # ray.* calls work here; cluster.started says whether rlkit owns the cluster

Local cluster (``resources.ray_address`` is None): every socket stays on 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray use the loopback address as the node address), no
dashboard, no usage stats, an object store of ``resources.object_store_memory_mb``, and at least as many
logical CPUs as the pools reserve (bundles may oversubscribe the cores: a logical CPU is a reservation
here, not a core; each worker runs ``threads_per_worker`` torch threads). ``address="local"`` makes Ray
start a new cluster even when another user's cluster runs on the machine.

Joined cluster (``resources.ray_address`` set, e.g. ``"10.0.0.1:6379"`` from ``ray start --head``):
rlkit connects and, on exit, only disconnects. Ray 2.60 turns token authentication on by default: the
driver needs the cluster's token (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_MODE=token``
with the token file). A loopback address (``127.0.0.1:port``) makes this driver use loopback too. If Ray is
already initialised in this process (a test session's cluster), it is used as is and left running.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from types import TracebackType
from typing import Any

from rlkit.errors import WorkerError
from rlkit.recipe.schema import ResourcesConfig
from rlkit.workers.pools import pool_cpu_demand

__all__ = ["RayCluster", "LOCAL_CLUSTER_ENV", "local_node"]

# Environment a local cluster needs; set in the driver before Ray starts, inherited by Ray's processes.
LOCAL_CLUSTER_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node address = 127.0.0.1, so sockets bind loopback only
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage-stats reporting
    # a call's argument or result up to 1 MiB travels inside the call (Ray's default: 100 KiB, larger ones
    # through the shared-memory object store): a CPU step's batches are 0.1-1 MB, and a role call echoing
    # the tiny harness step's (155 kB) took 4.3 ms instead of 5.5 (docs/benchmarks.md, "Ray calls inline a
    # step's batch")
    "RAY_max_direct_call_object_size": str(1 << 20),
}


def _local_cpus(resources: ResourcesConfig, num_cpus: int | None = None) -> int:
    """Logical CPUs a local cluster registers: the machine's cores (or ``num_cpus``), at least what the
    pools reserve."""
    return max(num_cpus or (os.cpu_count() or 1), math.ceil(pool_cpu_demand(resources)))


def local_node(resources: ResourcesConfig, num_cpus: int | None = None) -> dict[str, float]:
    """The one node ``RayCluster`` would start for ``resources`` (no ``ray_address``), without starting
    it: ``{CPU: logical CPUs, GPU: GPUs torch sees}`` — Ray detects the same GPUs. For
    ``check_placement(pools, nodes={"local": local_node(resources)})`` before Ray starts."""
    import torch

    return {"CPU": float(_local_cpus(resources, num_cpus)), "GPU": float(torch.cuda.device_count())}


class RayCluster:
    """Context manager around ``ray.init`` / ``ray.shutdown`` that owns only what it started."""

    def __init__(
        self,
        resources: ResourcesConfig | None = None,
        *,
        num_cpus: int | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        self.resources = resources or ResourcesConfig()
        self.num_cpus = num_cpus
        self.extra_env = dict(extra_env or {})
        self.started = False  # True: this object started the cluster and will stop it
        self.connected = False  # True: this object called ray.init (start or join)
        self.start_s: float | None = None  # seconds ray.init took
        self._saved_env: dict[str, str | None] = {}
        self._saved_cluster_flag: bool | None = None
        self.reaper = None  # rlkit.workers.reaper.Reaper of a cluster this object started

    # ----- life cycle -------------------------------------------------------------------------
    def start(self) -> RayCluster:
        import ray

        if ray.is_initialized():
            return self  # someone else's cluster (a test session): use it, leave it running
        t0 = time.perf_counter()
        if self.resources.ray_address:
            self._init_joined(ray)
        else:
            self._init_local(ray)
        self.connected = True
        self.start_s = time.perf_counter() - t0
        return self

    def _local_cpus(self) -> int:
        return _local_cpus(self.resources, self.num_cpus)

    def _use_loopback(self) -> None:
        """Make this driver (and the Ray processes it starts) use 127.0.0.1 as the node address."""
        self._set_env({**LOCAL_CLUSTER_ENV, **self.extra_env})
        # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is first imported; if it was imported
        # before the variable was set, its cached flag must follow the variable too.
        from ray._private import ray_constants

        self._saved_cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"

    def _init_local(self, ray: Any) -> None:
        self._use_loopback()
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(
                address="local",
                num_cpus=self._local_cpus(),
                object_store_memory=self.resources.object_store_memory_mb * 1024 * 1024,
                include_dashboard=False,
                log_to_driver=True,
                logging_level="warning",
                configure_logging=False,
            )
        except Exception as exc:
            self._restore_env()
            raise WorkerError(f"could not start a local Ray cluster: {exc}") from exc
        self.started = True
        _keep_sigterm_handler(sigterm)
        from rlkit.workers.reaper import Reaper

        self.reaper = Reaper()  # kills what this cluster started if the driver dies without stop()
        self.watch_owned()

    def watch_owned(self) -> None:
        """Hand the processes this cluster owns now (agents and workers appear after start) to the reaper."""
        if self.reaper is not None:
            self.reaper.watch(self.owned_processes())

    def _init_joined(self, ray: Any) -> None:
        address = self.resources.ray_address
        host = address.split("://")[-1].rsplit(":", 1)[0]
        if host in ("localhost", "::1", "[::1]") or host.startswith("127."):
            self._use_loopback()  # a loopback cluster on this machine: this driver must use 127.0.0.1 too
        else:
            self._set_env(self.extra_env)
        try:
            sigterm = signal.getsignal(signal.SIGTERM)
            ray.init(address=address, logging_level="warning", configure_logging=False)
            _keep_sigterm_handler(sigterm)
        except Exception as exc:
            self._restore_env()
            raise WorkerError(
                f"could not join the Ray cluster at resources.ray_address={address!r}: {exc}. "
                f"Check that `ray start --head` runs there, or unset ray_address to start a local one."
            ) from exc

    def stop(self, grace_s: float = 2.0) -> None:
        """Disconnect; stop the cluster's processes if this object started them.

        ``ray.shutdown`` stops what ``ray.init`` started (gcs_server, raylet, ...); the agents the raylet
        started (dashboard agent, runtime-env agent) and its workers can outlive it (docs/reliability.md), so
        whatever of ``owned_processes()`` is still running afterwards gets SIGTERM, then SIGKILL after
        ``grace_s``.
        """
        import ray

        from rlkit.workers.reaper import kill_processes

        if self.connected:
            owned = self.owned_processes()
            ray.shutdown()  # for a cluster started by ray.init this also stops gcs_server and raylet
            kill_processes(owned, grace_s=grace_s)
            if self.reaper is not None:
                self.reaper.close()
                self.reaper = None
            self.connected = False
            self.started = False
            self._restore_env()

    def owned_processes(self) -> list[Any]:
        """``psutil.Process`` of every process of a cluster this object started: Ray's own processes and,
        now, every descendant of its raylet (agents, workers). Empty for a joined cluster."""
        import psutil

        procs = []
        for pids in self.describe()["pids"].values() if self.started else ():
            for pid in pids:
                try:
                    proc = psutil.Process(pid)
                except psutil.Error:
                    continue
                procs.append(proc)
                if proc.name().startswith("raylet"):
                    try:
                        procs += proc.children(recursive=True)
                    except psutil.Error:
                        pass
        return procs

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # ----- environment ------------------------------------------------------------------------
    def _set_env(self, env: dict[str, str]) -> None:
        for key, value in env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        if self._saved_cluster_flag is not None:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._saved_cluster_flag
            self._saved_cluster_flag = None

    # ----- facts ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Where this cluster lives: session folder, driver pid and, for a cluster this object started,
        the pid of each Ray process (gcs_server, raylet, ...). Written to ``<output_dir>/ray_session.json``
        so a supervisor (or a test) can check that nothing of a killed run survives."""
        import ray

        info: dict[str, Any] = {
            "started": self.started,
            "driver_pid": os.getpid(),
            "session_dir": None,
            "pids": {},
        }
        # private API
        node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
        if node is not None:
            info["session_dir"] = node.get_session_dir_path()
            if self.started:
                info["pids"] = {
                    name: [p.process.pid for p in procs if p.process is not None]
                    for name, procs in node.all_processes.items()
                }
                info["pids"] |= _raylet_agents(info["pids"].get("raylet", []))
        return info

    @staticmethod
    def node_ip() -> str:
        """The driver node's address as Ray knows it (127.0.0.1 for a local cluster)."""
        import ray

        return ray.util.get_node_ip_address()


def _raylet_agents(raylet_pids: list[int]) -> dict[str, list[int]]:
    """The agents a raylet starts (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), by name."""
    try:
        import psutil
    except ImportError:
        return {}
    agents: dict[str, list[int]] = {}
    for pid in raylet_pids:
        try:
            children = psutil.Process(pid).children()
        except psutil.Error:
            continue
        for child in children:
            try:
                title = (child.cmdline() or [""])[0]
            except psutil.Error:
                continue
            if title.startswith("ray::") and title.endswith("Agent"):
                name = re.sub(r"(?<!^)(?=[A-Z])", "_", title[5:]).lower()  # DashboardAgent -> dashboard_agent
                agents.setdefault(name, []).append(child.pid)
    return agents


def _keep_sigterm_handler(before: Any) -> None:
    """``ray.init`` replaces the driver's SIGTERM handler with one that prints a stack trace and ends the
    process with no clean-up; put back a Python handler that was there before (``rlkit.runtime.stop``)."""
    if callable(before) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, before)
