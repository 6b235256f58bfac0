"""The reward phase: the reward model (when there is one) scores the batch, then the reward step
(``rlkit.rewards.steps.RewardStep``: the manager's rule scores, reward-model mixing, overlong shaping).

    batch, metrics = score(batch, ctx)   # adds token_level_scores [B, T] and reward_extra/<key> per row
"""

from __future__ import annotations

from typing import Any

from rlkit.batch import Batch
from rlkit.step.context import StepContext

__all__ = ["reward_of", "score"]


def reward_of(batch: Batch, ctx: StepContext) -> Any:
    """The reward step's ``RewardResult`` for ``batch`` (no change to the batch)."""
    if ctx.rt.reward_model is not None:
        batch = batch.union(ctx.rt.reward_model.call("compute_rm_score", batch, balance=ctx.balance))
    return ctx.rt.reward(batch)


def score(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    result = reward_of(batch, ctx)
    batch["token_level_scores"] = result.token_level_scores
    metrics = dict(result.metrics)
    for key, values in result.extra.items():
        batch[f"reward_extra/{key}"] = list(values)
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers:  # a rubric's parts (environments): their batch means
            metrics[f"reward_extra/{key}/mean"] = sum(numbers) / len(numbers)
    return batch, metrics
