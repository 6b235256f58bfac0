"""Registers rlkit's built-in rollout backends through the public hooks."""

from __future__ import annotations

from rlkit.hookspecs import hookimpl
from rlkit.specs import RolloutBackendSpec


@hookimpl
def rlkit_register_rollout_backends() -> list[RolloutBackendSpec]:
    return [
        RolloutBackendSpec(
            name="hf",
            cls="rlkit.rollout.hf:HFRollout",
            description="transformers model in the actor's process: KV-cache sampling, stop strings, greedy",
        ),
    ]
