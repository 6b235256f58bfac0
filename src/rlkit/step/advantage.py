"""The advantage phase: KL-in-reward (optional), then the recipe's registered estimator.

    batch, metrics = advantage(batch, ctx)   # adds token_level_rewards, advantages, returns [B, T]

The estimator gets one ``EstimatorInputs`` (``rlkit.algos.estimators``) filled with exactly what its spec
declares:
rewards, mask and the group ids the generation phase made (``group_id`` [B]) always; the critic's ``values``
with ``needs_critic``; the greedy ``reward_baselines`` with ``needs_greedy_baseline``; ``old_log_prob``,
``sum_pi_squared`` and a weighting correction's ``rollout_is_weights`` with ``needs_sum_pi_squared`` (OTB).
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit.algos import apply_kl_penalty
from rlkit.algos.estimators import EstimatorInputs
from rlkit.batch import Batch
from rlkit.step.context import StepContext

__all__ = ["advantage", "estimator_inputs"]


def advantage(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    algo = ctx.recipe.algorithm
    scores = batch["token_level_scores"]  # [B, T]
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        old = batch["old_log_prob"] if "old_log_prob" in batch else batch["rollout_log_probs"]
        rewards, metrics = apply_kl_penalty(
            scores, old, batch["ref_log_prob"], batch["response_mask"], ctx.rt.kl_ctrl, algo.kl_penalty
        )
    else:
        rewards = scores
    batch["token_level_rewards"] = rewards
    est = ctx.rt.estimator
    advantages, returns = est.fn(estimator_inputs(batch, rewards, est.spec), **est.kwargs)
    batch["advantages"] = advantages
    batch["returns"] = returns
    return batch, metrics


def estimator_inputs(batch: Batch, rewards: torch.Tensor, spec: Any) -> EstimatorInputs:
    """``EstimatorInputs`` with the fields ``spec`` (an ``EstimatorSpec``) declares, the others None."""
    otb = spec.needs_sum_pi_squared
    return EstimatorInputs(
        token_level_rewards=rewards,
        response_mask=batch["response_mask"].to(rewards.dtype),
        group_id=batch["group_id"],
        values=batch["values"] if spec.needs_critic else None,
        reward_baselines=batch["reward_baselines"] if spec.needs_greedy_baseline else None,
        old_log_prob=batch["old_log_prob"] if otb else None,
        sum_pi_squared=batch["sum_pi_squared"] if otb else None,
        rollout_is_weights=batch["rollout_is_weights"] if otb and "rollout_is_weights" in batch else None,
    )
