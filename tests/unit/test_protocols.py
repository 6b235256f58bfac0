"""rlkit.plugin.protocols: every built-in class satisfies the contract of its registry kind, declared
capabilities match the protocols, and the role keywords the runtime passes are the ones the protocols
document."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest

from rlkit.plugin import protocols as P
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries, load_object
from rlkit.plugin.specs import RolloutBackendSpec
from rlkit.recipe.compose import SLOTS, PlacedRole, compose
from rlkit.recipe.schema import Recipe


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager())  # built-ins and the installed plugin packages


def classes(registries, kind):
    return [(e.spec, load_object(e.spec.cls)) for e in registries[kind]]


def test_reward_managers(registries):
    for spec, cls in classes(registries, "reward_managers"):
        assert issubclass(cls, P.RewardManager), spec.name
        extra = {"params": None} if spec.params is not None else {}
        inspect.signature(cls.__init__).bind(
            None, "tokenizer", "score_fn", num_examine=0, default_score=0.0, timeout_s=1.0, **extra
        )
    assert issubclass(load_object("rlkit.rewards.parallel:ParallelRewardManager"), P.SupportsClose)


def test_rollout_backends_and_their_declared_capabilities(registries):
    # every method capability has its protocol; rollout_log_probs is a data one (check_rollout_backend checks
    # it), lora and truncated_sampling are limits recipe validation reads
    # (tests/reliability/test_bad_input.py)
    flags = {f.name for f in fields(RolloutBackendSpec) if f.type in (bool, "bool")}
    assert set(P.CAPABILITIES) == flags - {"rollout_log_probs", "lora", "truncated_sampling"}
    found = classes(registries, "rollout_backends")
    assert {"hf"} <= {spec.name for spec, _ in found}
    for spec, cls in found:
        assert issubclass(cls, P.RolloutBackend), spec.name
        extra = {"params": None} if spec.params is not None else {}
        inspect.signature(cls.__init__).bind(
            None,
            module=None,
            tokenizer=None,
            rollout_config=None,
            max_response_length=8,
            device="cpu",
            seed=0,
            **extra,
        )
        for flag, protocol in P.CAPABILITIES.items():
            if getattr(spec, flag):  # declared on the spec → the class must have it
                assert issubclass(cls, protocol), f"{spec.name} declares {flag}"
    hf = load_object(registries.rollout_backends.get("hf").cls)
    assert not issubclass(hf, P.GeneratesIds) and not registries.rollout_backends.get("hf").generate_ids


def test_sglang_declares_what_it_implements(registries):
    pytest.importorskip("rlkit_sglang", reason="pip install -e plugins/rlkit-sglang")
    spec = registries.rollout_backends.get("sglang")
    cls = load_object(spec.cls)
    assert spec.generate_ids and spec.memory_release
    assert issubclass(cls, P.GeneratesIds) and issubclass(cls, P.ReleasesMemory)
    assert inspect.iscoroutinefunction(cls.generate_ids)


def test_roles_fill_slots_with_the_slot_protocol(registries):
    assert set(P.SLOT_PROTOCOLS) == set(SLOTS) == set(P.ROLE_KWARGS)
    filled = set()
    for spec, cls in classes(registries, "roles"):
        assert issubclass(cls, P.SLOT_PROTOCOLS[spec.fills]), spec.name
        filled.add(spec.fills)
    assert filled == set(SLOTS)
    from rlkit.workers.roles import RefWorker

    assert not issubclass(RefWorker, P.CriticRole)  # the check can fail


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_role_kwargs_are_what_the_runtime_passes(registries, estimator):
    """``ROLE_KWARGS[slot]`` documents exactly the keywords ``Runtime._role_kwargs`` builds."""
    from rlkit.runtime.build import Runtime

    recipe = Recipe(
        model={"path": "tiny"},
        data={"train_files": ["train.parquet"]},
        algorithm={"estimator": estimator},
        rollout={"n": 2},
        reward={"reward_model": {"enable": True, "path": "rm"}},
    )
    pipeline = compose(recipe, registries)
    from rlkit.hardware import plan_run

    hardware = plan_run(
        recipe, device="cpu", placed={s: r.pool for s, r in pipeline.roles.items()}, decode_dtype="auto"
    )
    runtime = SimpleNamespace(recipe=recipe, pipeline=pipeline, total_steps=3, hardware=hardware)
    for slot in SLOTS:
        kwargs = Runtime._role_kwargs(runtime, PlacedRole(slot, None, "global"))
        assert set(kwargs) == P.ROLE_KWARGS[slot], slot
        role = registries.roles.get(slot)
        inspect.signature(load_object(role.cls).__init__).bind(None, *[0] * len(P.ROLE_ARGS), **kwargs)


def test_trackers_agent_loops_and_tools(registries, tmp_path):
    from rlkit.runtime.tracking import TrackerConfig

    config = TrackerConfig(project="p", experiment="e", output_dir=tmp_path / "p" / "e", total_steps=1)
    for spec, cls in classes(registries, "trackers"):
        members = [
            m
            for m in ("log_params", "log", "log_artifact", "log_text", "finish")
            if callable(getattr(cls, m, None))
        ]
        assert len(members) == 5 and isinstance(getattr(cls, "name", None), str), spec.name
    jsonl = load_object(registries.trackers.get("jsonl").cls)(config)
    assert isinstance(jsonl, P.Tracker)
    for spec, cls in classes(registries, "agent_loops"):
        assert inspect.iscoroutinefunction(cls.run) and callable(cls.prompt_ids), spec.name
    for spec, cls in classes(registries, "tools"):
        assert isinstance(cls(), P.Tool) and inspect.iscoroutinefunction(cls.execute), spec.name


def test_every_protocol_is_documented_and_the_module_imports_no_torch():
    for name in P.__all__:
        obj = getattr(P, name)
        if isinstance(obj, type):
            assert inspect.getdoc(obj), f"rlkit.plugin.protocols.{name} has no docstring"
    code = "import sys, rlkit.plugin.protocols, rlkit.plugin.specs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
