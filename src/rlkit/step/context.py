"""What every phase of a step reads besides the batch: the recipe, the run's built components, the step
number.

A phase is a function ``batch, metrics = phase(batch, ctx)`` (docs/concepts.md, "One step"); it reads ``ctx``
and never calls another phase. The trainer (``rlkit.step.trainer``) makes one context per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.recipe import Recipe
    from rlkit.runtime.build import Runtime

__all__ = ["StepContext"]


@dataclass(frozen=True)
class StepContext:
    recipe: Recipe
    rt: Runtime  # the worker groups, reward step, estimator, trackers (``rlkit.runtime.build``)
    global_step: int

    @property
    def balance(self) -> bool:
        """``trainer.balance_batch``: split batches over ranks by token count (veRL's ``balance_batch``)."""
        return self.recipe.trainer.balance_batch
