"""Shared fixtures for real components. Keep this file small."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """THE tiny test model of the suite: a Qwen2 causal LM (hidden 64, 2 layers) and its local BPE tokenizer,
    built once per session (``rlkit.model.tiny.build_tiny_model`` defaults). Read it; copy it before changing
    it."""
    from rlkit.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=0)


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


# The edit loop (``nox -s edit``, docs/concepts.md): the tests that need no model, no process group, no Ray
# and no subprocess run. Everything else gets the ``heavy`` marker here, by where it lives and which fixtures
# it uses.
HEAVY_DIRS = ("e2e", "reliability", "engines", "plugins")
# subprocess runs of the CLI, MLflow's migrations, a Ray cluster of their own (measured: > 10 s each)
HEAVY_FILES = {
    "test_cli.py",
    "test_mlflow_store.py",
    "test_cluster.py",
    "test_smoke.py",
    "test_pytest_plugin.py",
}
HEAVY_FIXTURES = {
    "ray_cluster",
    "tiny_model_dir",
    "rlkit_tiny_model_dir",
    "rlkit_tiny_model",
    "rlkit_tokenizer",
    "gloo_world1",
    "two_ranks",
    "two_nodes",
    "straight_run",
    "smoke_runs",
    "serve_thread",
    "tok_and_model",
    "tokenizer",
    "tiny_assets",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.relative_to(config.rootpath / "tests").parts
        if (
            parts[0] in HEAVY_DIRS
            or parts[-1] in HEAVY_FILES
            or HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.heavy)
    _skip_cuda_without_a_gpu(items)


def _skip_cuda_without_a_gpu(items):
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
