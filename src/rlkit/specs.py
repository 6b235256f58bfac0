"""What a plugin hands to a registry: one small frozen dataclass per registry kind.

A hook implementation returns a list of these::

    @rlkit.hookimpl
    def rlkit_register_estimators():
        return [EstimatorSpec(name="my_adv", fn=my_advantage, needs_groups=True)]

Call contracts (the trainer and workers call every entry the same way):

- ``EstimatorSpec.fn(token_level_rewards, response_mask, index, *, values, reward_baselines,
  **params) -> (advantages, returns)``, shapes ``[B, T], [B, T], [B]`` in and ``[B, T], [B, T]``
  out; ``params`` are the ``algorithm`` recipe keys named in ``EstimatorSpec.params``.
- ``PolicyLossSpec.fn(log_prob, old_log_prob, advantages, response_mask, **params)
  -> (per_token_loss [B, T], metrics dict)``; ``params`` are the ``actor`` recipe keys named in
  ``PolicyLossSpec.params``. Aggregation over tokens happens outside the loss
  (``rlkit.algos.agg_loss``) so it can use the global token count.
- ``ComputeScoreSpec.fn(data_source, solution_str, ground_truth, extra_info=None)
  -> float | dict`` (veRL's contract; a dict has a ``score`` key plus extra metrics).
- ``RewardManagerSpec.cls``, ``RolloutBackendSpec.cls``, ``RoleSpec.cls``, ``TrackerSpec.cls``,
  ``ToolSpec.cls``: classes; their constructor contracts live beside their base classes
  (``rlkit.rewards``, ``rlkit.rollout``, ``rlkit.workers``, ``rlkit.tracking``, ``rlkit.rollout.tools``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Spec",
    "EstimatorSpec",
    "PolicyLossSpec",
    "RewardManagerSpec",
    "ComputeScoreSpec",
    "RolloutBackendSpec",
    "RoleSpec",
    "TrackerSpec",
    "ToolSpec",
]


@dataclass(frozen=True)
class Spec:
    """Fields every registry entry has."""

    name: str  # the name a recipe uses
    aliases: tuple[str, ...] = ()  # other names that resolve to this entry
    description: str = ""  # one line, shown by `rlkit plugins`


@dataclass(frozen=True)
class EstimatorSpec(Spec):
    """An advantage estimator: what a recipe names as its algorithm (``algorithm.estimator``)."""

    fn: Callable[..., Any] | None = None
    params: tuple[str, ...] = ()  # `algorithm.*` keys passed to fn as keywords
    needs_critic: bool = False  # PPO/GAE: a critic role must exist and `values` is passed
    needs_groups: bool = False  # group-relative: rollout.n must be > 1 (singleton groups degrade)
    needs_greedy_baseline: bool = False  # ReMax: a greedy rollout's score is passed as reward_baselines
    # Defaults the estimator sets on other parts of the recipe, as dotted keys
    # ("actor.clip_ratio_high": 0.28). A key the user set explicitly always wins.
    recipe_defaults: Mapping[str, Any] = field(default_factory=dict)
    paper: str = ""  # citation or URL, shown in docs


@dataclass(frozen=True)
class PolicyLossSpec(Spec):
    fn: Callable[..., Any] | None = None
    params: tuple[str, ...] = ()  # `actor.*` keys passed to fn as keywords
    paper: str = ""


@dataclass(frozen=True)
class RewardManagerSpec(Spec):
    cls: type | None = None


@dataclass(frozen=True)
class ComputeScoreSpec(Spec):
    """A scoring function; ``name`` is the ``data_source`` it scores (aliases: more sources)."""

    fn: Callable[..., Any] | None = None


@dataclass(frozen=True)
class RolloutBackendSpec(Spec):
    cls: type | None = None


@dataclass(frozen=True)
class RoleSpec(Spec):
    cls: type | None = None
    needs_model: bool = True


@dataclass(frozen=True)
class TrackerSpec(Spec):
    cls: type | None = None


@dataclass(frozen=True)
class ToolSpec(Spec):
    cls: type | None = None
