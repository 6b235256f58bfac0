"""The hybrid worker holds an engine's memory only from the weight sync through generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlkit.batch import Batch
from rlkit.plugin.specs import RolloutBackendSpec
from rlkit.workers.roles import ActorRolloutRefWorker


class RecordingEngine:
    """An engine with SGLang's memory calls; records the order of everything done to it."""

    def __init__(self):
        self.calls = []

    def resume_memory(self):
        self.calls.append("resume")

    def release_memory(self):
        self.calls.append("release")

    def update_weights(self, weights):
        self.calls.append("update")

    def generate(self, prompts, **sampling):
        self.calls.append("generate")
        return Batch({}, {"x": [1]})


@pytest.mark.parametrize("memory_release", [True, False])
def test_wake_update_generate_sleep_order(memory_release):
    """The memory calls follow the capability the backend's spec declares, not what the engine has."""
    engine = RecordingEngine()
    spec = RolloutBackendSpec(name="recording", cls=RecordingEngine, memory_release=memory_release)
    worker = SimpleNamespace(rollout=engine, actor=SimpleNamespace(module=object()), backend_spec=spec)
    for name in ("_engine", "_wake_engine", "_sleep_engine", "_need", "generate_sequences", "sync_weights"):
        setattr(worker, name, getattr(ActorRolloutRefWorker, name).__get__(worker))
    worker.generate_sequences(Batch({}, {"x": [1]}))  # step 1: the server starts awake
    worker.sync_weights()  # after the update
    worker.generate_sequences(Batch({}, {"x": [1]}))  # step 2
    if memory_release:
        assert engine.calls == ["generate", "release", "resume", "update", "generate", "release"]
    else:  # the engine has the methods, but its spec does not declare the capability: never called
        assert engine.calls == ["generate", "update", "generate"]
