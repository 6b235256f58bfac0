"""Registers rlkit's built-in score functions and reward managers through the public hooks.

Score functions import only the standard library, so they are referenced directly; reward managers
(which import torch) are referenced as ``"module:attr"`` strings, resolved by
``rlkit.plugin.registry.load_object`` when a run builds one.
"""

from __future__ import annotations

from rlkit.builtin.params import ParallelManagerParams
from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import ComputeScoreSpec, RewardManagerSpec
from rlkit.rewards.scores import gsm8k, math, synthetic


@hookimpl
def rlkit_register_compute_scores() -> list[ComputeScoreSpec]:
    return [
        ComputeScoreSpec(
            name="openai/gsm8k",
            aliases=("gsm8k",),
            fn=gsm8k.compute_score,
            description="GSM8K: number after '####' (strict) or last number (extra_info method=flexible)",
        ),
        ComputeScoreSpec(
            name="HuggingFaceH4/MATH-500",
            aliases=("math500", "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"),
            fn=math.compute_score,
            description="MATH: last \\boxed{} answer, normalised (math-verify when installed)",
        ),
        ComputeScoreSpec(
            name="rlkit/arithmetic",
            aliases=("arithmetic",),
            fn=synthetic.compute_score,
            description="synthetic arithmetic: the response's final integer",
        ),
    ]


@hookimpl
def rlkit_register_reward_managers() -> list[RewardManagerSpec]:
    return [
        RewardManagerSpec(
            name="naive",
            cls="rlkit.rewards.managers:NaiveRewardManager",
            description="one score call per sample, in the driver",
        ),
        RewardManagerSpec(
            name="batch",
            cls="rlkit.rewards.managers:BatchRewardManager",
            batched_scores=True,
            description="one batched score call for the whole batch",
        ),
        RewardManagerSpec(
            name="parallel",
            cls="rlkit.rewards.parallel:ParallelRewardManager",
            params=ParallelManagerParams,
            description="process pool with a per-sample timeout (hanging scorers are killed)",
        ),
    ]
