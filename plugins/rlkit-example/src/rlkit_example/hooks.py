"""Hook implementations: registers the ``group_median`` and ``group_quantile`` advantage estimators.

``group_quantile`` shows the parameter door: its params model ``GroupQuantileParams`` declares the
one hyperparameter it takes, and a recipe sets it beside the name::

    algorithm:
      estimator: {name: group_quantile, quantile: 0.9}

rlkit validates the value against the model (unknown keys and out-of-range values are recipe
errors naming this plugin) and calls the function with ``quantile=0.9``.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

import rlkit
from rlkit.algos.estimators import EstimatorInputs
from rlkit.plugin.specs import EstimatorSpec


def group_median_advantage(x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage = sequence score minus the median score of its group, on every response token.

    Shapes: x.token_level_rewards, x.response_mask [B, T]; x.group_id [B]. Returns
    (advantages [B, T], returns [B, T]); here returns equal advantages.
    The median (lower of the two middle values for even groups, as ``torch.median``) is robust to
    one outlier reward in a group, unlike GRPO's mean.
    """
    scores = (x.token_level_rewards * x.response_mask).sum(dim=-1)  # [B]
    baseline = torch.empty_like(scores)
    for group in x.group_id.unique():
        members = x.group_id == group
        baseline[members] = scores[members].median()
    advantages = (scores - baseline).unsqueeze(-1) * x.response_mask  # [B, T]
    return advantages, advantages


class GroupQuantileParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    quantile: float = Field(
        0.5, ge=0, le=1, description="the group's baseline is this quantile of its scores (0.5 = median)"
    )


def group_quantile_advantage(
    x: EstimatorInputs, *, quantile: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantage = sequence score minus the ``quantile`` of its group's scores (linear interpolation,
    as ``torch.quantile``). ``quantile=0`` makes every advantage >= 0, ``quantile=1`` every one <= 0.
    Shapes as ``group_median_advantage``."""
    scores = (x.token_level_rewards * x.response_mask).sum(dim=-1)  # [B]
    baseline = torch.empty_like(scores)
    for group in x.group_id.unique():
        members = x.group_id == group
        baseline[members] = torch.quantile(scores[members], quantile)
    advantages = (scores - baseline).unsqueeze(-1) * x.response_mask  # [B, T]
    return advantages, advantages


@rlkit.hookimpl
def rlkit_register_estimators() -> list[EstimatorSpec]:
    return [
        EstimatorSpec(
            name="group_median",
            fn=group_median_advantage,
            needs_groups=True,
            description="score minus the group's median score (example plugin)",
        ),
        EstimatorSpec(
            name="group_quantile",
            fn=group_quantile_advantage,
            params=GroupQuantileParams,
            needs_groups=True,
            description=(
                "score minus a quantile of the group's scores (example plugin; a parameter of its own)"
            ),
        ),
    ]
