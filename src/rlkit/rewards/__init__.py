"""rlkit.rewards: built-in score functions, the ``compute_score`` dispatcher and reward managers.

Reward-manager contract (``RewardManagerSpec.cls``)::

    manager = cls(tokenizer, score_fn, *, num_examine=0, default_score=0.0, timeout_s=10.0[, params=...])
    result = manager(batch)  # RewardResult(token_level_scores [B, T], extra, metrics)

``params`` (the manager's params model) is passed only when its spec declares one. Reward-model
scores and overlong shaping are applied after any manager by ``rlkit.rewards.steps.RewardStep``.
See ``rlkit.rewards.managers`` for the details. Names are imported lazily so that registering the
built-ins (``rlkit.builtin.rewards``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "RewardManager",
    "RewardResult",
    "NaiveRewardManager",
    "BatchRewardManager",
    "ParallelRewardManager",
    "compute_score",
    "get_score_fn",
    "load_custom_score",
    "ScoreDispatcher",
    "UnknownDataSourceError",
    "ScoreLoadError",
]

_WHERE = {
    "RewardManager": "managers",
    "RewardResult": "managers",
    "NaiveRewardManager": "managers",
    "BatchRewardManager": "managers",
    "ParallelRewardManager": "parallel",
    "compute_score": "dispatch",
    "get_score_fn": "dispatch",
    "load_custom_score": "dispatch",
    "ScoreDispatcher": "dispatch",
    "UnknownDataSourceError": "dispatch",
    "ScoreLoadError": "dispatch",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"rlkit.rewards.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rlkit.rewards' has no attribute '{name}'")
