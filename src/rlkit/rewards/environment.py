"""Scores of an environment's rows: the reward manager dispatches by ``data_source`` = the environment's name.

``EnvironmentScore(resolved)`` is the ``compute_score`` the run registers for that data_source. It builds
the environment lazily, in the scoring child process, and keeps it there. A single-turn row is scored by
``env.score(solution_str, ground_truth, extra_info)``; a multi-turn episode was scored by the environment
when it ended (``Episode.reward``, in the rollout's process), and arrives as ``extra_info["env_reward"]``
(``rlkit.rollout.environment``), which is returned as is. An episode that failed carries
``{"error": message}`` there: it raises, so the manager counts it in ``reward/errors`` and gives
``reward.default_score``.
"""

from __future__ import annotations

from typing import Any

from rlkit.data.environment import build_environment
from rlkit.errors import RlkitError

__all__ = ["EnvironmentScore", "ENV_REWARD_KEY"]

ENV_REWARD_KEY = (
    "env_reward"  # a multi-turn episode's reward, per sample (non-tensor field and extra_info key)
)


class EnvironmentScore:
    """``compute_score(data_source, solution_str, ground_truth, extra_info)`` for one environment."""

    def __init__(self, resolved: Any):
        self.resolved = resolved
        self._env: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"resolved": self.resolved, "_env": None}  # the environment is rebuilt where it is used

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> Any:
        extra = extra_info or {}
        if ENV_REWARD_KEY in extra:
            reward = extra[ENV_REWARD_KEY]
            if isinstance(reward, dict) and "error" in reward:
                raise RlkitError(f"environment '{self.resolved.name}': the episode failed: {reward['error']}")
            return reward
        if self.resolved.spec.multi_turn:
            raise RlkitError(
                f"environment '{self.resolved.name}' is multi-turn but this sample has no episode "
                "reward: run its rows with the `environment` agent loop (rollout.agent)."
            )
        if self._env is None:
            self._env = build_environment(self.resolved)
        return self._env.score(solution_str, ground_truth, extra_info)
