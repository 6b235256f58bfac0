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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped, with the reason, where torch sees no CUDA device (never passed)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch {torch.__version__} ({build}) sees none")
    for item in marked:
        item.add_marker(skip)
