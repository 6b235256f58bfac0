"""The advantage phase: KL-in-reward (optional), then the recipe's registered estimator.

    batch, metrics = advantage(batch, ctx)   # adds token_level_rewards, advantages, returns [B, T]

The estimator gets the group ids the generation phase made (``group_id`` [B]), the critic's ``values`` and the
greedy ``reward_baselines`` where the batch has them, and OTB's inputs (``old_log_prob``, ``sum_pi_squared``,
``rollout_is_weights``) when its spec declares ``needs_sum_pi_squared``.
"""

from __future__ import annotations

import torch

from rlkit.algos import apply_kl_penalty
from rlkit.batch import Batch
from rlkit.step.context import StepContext

__all__ = ["advantage"]


def advantage(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    algo = ctx.recipe.algorithm
    scores = batch["token_level_scores"]  # [B, T]
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        old = batch["old_log_prob"] if "old_log_prob" in batch else batch["rollout_log_probs"]
        rewards, metrics = apply_kl_penalty(scores, old, batch["ref_log_prob"], batch["response_mask"],
                                            ctx.rt.kl_ctrl, algo.kl_penalty)
    else:
        rewards = scores
    batch["token_level_rewards"] = rewards
    est = ctx.rt.estimator
    otb = {"old_log_prob": batch["old_log_prob"], "sum_pi_squared": batch["sum_pi_squared"],
           "rollout_is_weights": _optional(batch, "rollout_is_weights")} if est.spec.needs_sum_pi_squared else {}
    advantages, returns = est.fn(rewards, batch["response_mask"].to(rewards.dtype), batch["group_id"],
                                 values=_optional(batch, "values"),
                                 reward_baselines=_optional(batch, "reward_baselines"), **otb, **est.kwargs)
    batch["advantages"] = advantages
    batch["returns"] = returns
    return batch, metrics


def _optional(batch: Batch, key: str) -> torch.Tensor | None:
    return batch[key] if key in batch else None
