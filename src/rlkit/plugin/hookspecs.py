"""The plugin contract: one ``rlkit_register_<kind>s()`` hook per registry.

Each hook takes no arguments and returns a list of specs (``rlkit.plugin.specs``). Built-ins implement
these hooks with the same ``@rlkit.hookimpl`` marker a third-party package uses. docs/plugins.md
documents every hook (a test checks that).
"""

from __future__ import annotations

import pluggy

from rlkit.plugin.specs import (
    AgentLoopSpec,
    ComputeScoreSpec,
    EnvironmentSpec,
    EstimatorSpec,
    PolicyLossSpec,
    RewardManagerSpec,
    RoleSpec,
    RolloutBackendSpec,
    RolloutCorrectionSpec,
    ToolSpec,
    TrackerSpec,
)

__all__ = ["PROJECT", "hookspec", "hookimpl", "REGISTRY_KINDS"]

PROJECT = "rlkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rlkit_register_estimators() -> list[EstimatorSpec]:
    """Advantage estimators (``algorithm.estimator``): ppo, grpo, dapo, rloo, ..."""


@hookspec
def rlkit_register_policy_losses() -> list[PolicyLossSpec]:
    """Policy losses (``actor.policy_loss``): ppo_clip, gspo, cispo, gpg, sapo."""


@hookspec
def rlkit_register_reward_managers() -> list[RewardManagerSpec]:
    """Reward managers (``reward.manager``): naive, batch, parallel."""


@hookspec
def rlkit_register_compute_scores() -> list[ComputeScoreSpec]:
    """Rule-based scoring functions, keyed by the ``data_source`` they score."""


@hookspec
def rlkit_register_rollout_backends() -> list[RolloutBackendSpec]:
    """Rollout engines (``rollout.backend``): hf, sglang (plugin package); capabilities declared on the
    spec."""


@hookspec
def rlkit_register_roles() -> list[RoleSpec]:
    """Worker roles, each filling a step slot: actor_rollout_ref, rollout, ref, critic, reward_model."""


@hookspec
def rlkit_register_trackers() -> list[TrackerSpec]:
    """Experiment trackers (``tracking.backends``): console, mlflow, jsonl."""


@hookspec
def rlkit_register_tools() -> list[ToolSpec]:
    """Tools a multi-turn rollout may call: calculator, python."""


@hookspec
def rlkit_register_agent_loops() -> list[AgentLoopSpec]:
    """Multi-turn agent loops (``rollout.agent``, a data row's ``agent_name``): single_turn, tool."""


@hookspec
def rlkit_register_rollout_corrections() -> list[RolloutCorrectionSpec]:
    """Rollout corrections (``algorithm.rollout_correction``): token_tis, seq_tis, token_mis, seq_mis, icepop,
    decoupled."""


@hookspec
def rlkit_register_environments() -> list[EnvironmentSpec]:
    """Environments (``data.environment``): rows, their score, and for multi-turn ones the replies."""


# registry kind -> (hook name, spec type). The single source of truth for the registries.
REGISTRY_KINDS: dict[str, tuple[str, type]] = {
    "estimators": ("rlkit_register_estimators", EstimatorSpec),
    "policy_losses": ("rlkit_register_policy_losses", PolicyLossSpec),
    "reward_managers": ("rlkit_register_reward_managers", RewardManagerSpec),
    "compute_scores": ("rlkit_register_compute_scores", ComputeScoreSpec),
    "rollout_backends": ("rlkit_register_rollout_backends", RolloutBackendSpec),
    "roles": ("rlkit_register_roles", RoleSpec),
    "trackers": ("rlkit_register_trackers", TrackerSpec),
    "tools": ("rlkit_register_tools", ToolSpec),
    "agent_loops": ("rlkit_register_agent_loops", AgentLoopSpec),
    "rollout_corrections": ("rlkit_register_rollout_corrections", RolloutCorrectionSpec),
    "environments": ("rlkit_register_environments", EnvironmentSpec),
}
