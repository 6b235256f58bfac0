"""Shared fixtures for real components. Keep this file small."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """ONE local Ray cluster (loopback, no dashboard) for the whole test session, stopped at the end.

    It registers 8 logical CPUs on any machine so several 1-CPU worker groups fit at once (logical CPUs
    are reservations, not cores; each worker runs one torch thread).
    """
    from rlkit.recipe.schema import ResourcesConfig
    from rlkit.workers.cluster import RayCluster

    cluster = RayCluster(ResourcesConfig(object_store_memory_mb=256), num_cpus=8).start()
    try:
        yield cluster
    finally:
        cluster.stop()
