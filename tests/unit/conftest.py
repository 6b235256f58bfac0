"""Fixtures for unit tests of real model components: a tiny model built once, one in-process gloo group."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def gloo_world1():
    """A world-size-1 gloo process group in this process (FSDP2 needs one), torn down at the end."""
    import torch
    import torch.distributed as dist

    from rlkit.workers.base import find_free_port

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1
        )
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
