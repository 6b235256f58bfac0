"""Hook implementations: registers the ``group_median`` advantage estimator."""

from __future__ import annotations

import torch

import rlkit
from rlkit.specs import EstimatorSpec


def group_median_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage = sequence score minus the median score of its group, on every response token.

    Shapes: token_level_rewards, response_mask [B, T]; index [B] (group id). Returns
    (advantages [B, T], returns [B, T]); here returns equal advantages.
    The median (lower of the two middle values for even groups, as ``torch.median``) is robust to
    one outlier reward in a group, unlike GRPO's mean.
    """
    scores = (token_level_rewards * response_mask).sum(dim=-1)  # [B]
    baseline = torch.empty_like(scores)
    for group in index.unique():
        members = index == group
        baseline[members] = scores[members].median()
    advantages = (scores - baseline).unsqueeze(-1) * response_mask  # [B, T]
    return advantages, advantages


@rlkit.hookimpl
def rlkit_register_estimators() -> list[EstimatorSpec]:
    return [
        EstimatorSpec(
            name="group_median",
            fn=group_median_advantage,
            needs_groups=True,
            description="score minus the group's median score (example plugin)",
        )
    ]
