"""Fixtures for unit tests of real model components: a tiny model built once, one in-process gloo group, and
the benchmark scripts' own functions."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def benchmark_module():
    """``benchmark_module("run.py")``: that file of ``benchmarks/`` (not a package) imported as a module, once
    per session, as ``_bench_<name>``."""
    loaded = {}

    def load(filename: str):
        if filename not in loaded:
            name = "_bench_" + filename.removesuffix(".py")
            spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / filename)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while the file runs
            spec.loader.exec_module(module)
            loaded[filename] = module
        return loaded[filename]

    return load


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
