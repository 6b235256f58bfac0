"""Registers the ``reasoning_gym`` environment (lazy: reasoning-gym is imported only when a run uses it)."""

from __future__ import annotations

from rlkit import hookimpl
from rlkit.plugin.specs import ComputeScoreSpec, EnvironmentSpec


@hookimpl
def rlkit_register_environments() -> list[EnvironmentSpec]:
    return [
        EnvironmentSpec(
            name="reasoning_gym",
            cls="rlkit_reasoning_gym.env:ReasoningGymEnv",
            params="rlkit_reasoning_gym.env:ReasoningGymParams",
            description="a reasoning-gym task (or a weighted mix), scored by its own score_answer",
        ),
    ]


@hookimpl
def rlkit_register_compute_scores() -> list[ComputeScoreSpec]:
    # rows written by `rlkit data reasoning-gym` carry their parameters: this scores them without
    # data.environment
    return [
        ComputeScoreSpec(
            name="reasoning_gym",
            fn="rlkit_reasoning_gym.env:compute_score",
            description="reasoning-gym rows from parquet (their extra_info.params)",
        )
    ]
