"""resources.allocator: what the workers' C allocator becomes (rlkit.hardware.allocator), the validation of an
explicit keep_freed, and the worker's check that its process started with the variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlkit.errors import RecipeError
from rlkit.hardware.allocator import (
    KEEP_FREED_TUNABLES,
    check_workers,
    keep_freed_unavailable,
    plan_allocator,
)
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.recipe import validate_recipe

GLIBC = dict(libc="glibc", environ={})


@pytest.mark.parametrize(
    ("setting", "device", "local", "kw", "name", "why"),
    [
        ("auto", "cpu", True, GLIBC, "keep_freed", "auto: CPU workers on glibc"),
        ("auto", "cuda", True, GLIBC, "system", "cuda workers"),
        ("auto", "cpu", False, GLIBC, "system", "remote Ray cluster"),
        ("auto", "cpu", True, dict(libc="", environ={}), "system", "not glibc"),
        ("auto", "cpu", True, dict(libc="glibc", environ={"GLIBC_TUNABLES": "x"}), "system", "inherit"),
        ("keep_freed", "cuda", False, dict(libc="", environ={"GLIBC_TUNABLES": "x"}), "keep_freed", "GLIBC"),
        ("system", "cpu", True, GLIBC, "system", "set in the recipe"),
    ],
)
def test_the_plan_for_each_setting_and_machine(setting, device, local, kw, name, why):
    plan = plan_allocator(setting, device, local=local, **kw)
    assert plan.name == name and why in plan.reason
    assert plan.env == ({"GLIBC_TUNABLES": KEEP_FREED_TUNABLES} if name == "keep_freed" else {})


def test_the_tunables_keep_freed_memory():
    """One arena (a worker's update runs on a thread Ray starts, whose own arena would mmap large blocks), no
    mmap'd blocks, no heap trim: the three settings benchmarks/worker_malloc.py measured."""
    assert set(KEEP_FREED_TUNABLES.split(":")) == {
        "glibc.malloc.arena_max=1",
        "glibc.malloc.mmap_max=0",
        "glibc.malloc.trim_threshold=2147483647",
    }


def test_an_explicit_keep_freed_without_glibc_is_refused_at_validation(monkeypatch):
    assert keep_freed_unavailable(True, libc="glibc") is None
    assert keep_freed_unavailable(False, libc="") is None  # a remote cluster's workers may have it
    monkeypatch.setattr("platform.libc_ver", lambda *a, **k: ("", ""))
    raw = {
        "model": {"path": "m"},
        "data": {"train_files": ["t.parquet"], "train_batch_size": 4},
        "rollout": {"n": 2},
    }
    registries = build_registries(make_plugin_manager())
    with pytest.raises(RecipeError) as info:
        validate_recipe(raw, ["resources.allocator=keep_freed"], registries=registries, check_files=False)
    problem = dict(info.value.problems)["resources.allocator"]
    assert "not glibc" in problem and "resources.allocator=system" in problem
    validate_recipe(raw, [], registries=registries, check_files=False)  # auto stays valid: it plans system


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
def test_a_worker_knows_whether_its_process_started_with_the_variable():
    """Started with it: True; set later in Python (which the C library never read): False."""
    code = (
        "import json, os\n"
        "from rlkit.workers.base import Worker\n"
        "before = Worker.started_with(None, 'RLKIT_TEST_START_VAR')\n"
        "os.environ['RLKIT_TEST_LATE_VAR'] = '1'\n"
        "print(json.dumps([before, Worker.started_with(None, 'RLKIT_TEST_LATE_VAR')]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLKIT_TEST_")}
    with_var = subprocess.run(
        [sys.executable, "-c", code], env=env | {"RLKIT_TEST_START_VAR": "1"}, capture_output=True, text=True
    )
    without = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert json.loads(with_var.stdout) == [True, False], with_var.stderr
    assert json.loads(without.stdout) == [False, False], without.stderr


class _Ranks:
    """A started group as ``check_workers`` sees it: its role, and each rank's answer to ``started_with``."""

    def __init__(self, role: str, answers: list[bool]):
        self.role, self.answers = role, answers

    def call(self, method: str, name: str, *, dispatch: str) -> list[bool]:
        assert (method, name, dispatch) == ("started_with", "GLIBC_TUNABLES", "all")
        return self.answers


def test_a_worker_that_started_without_the_tunables_turns_the_plan_to_system(caplog):
    plan = plan_allocator("keep_freed", "cpu", local=True, **GLIBC)
    assert check_workers(plan, [_Ranks("actor_rollout_ref", [True, True])]) == ("yes", plan)
    with caplog.at_level("WARNING"):
        started, took = check_workers(
            plan, [_Ranks("actor_rollout_ref", [True]), _Ranks("critic", [True, False])]
        )
    assert started == "no: critic rank 1" and took.name == "system" and not took.env
    assert "critic rank 1 started without GLIBC_TUNABLES" in caplog.text
