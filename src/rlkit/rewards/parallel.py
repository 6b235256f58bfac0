"""The ``parallel`` reward manager: ``naive`` scored by ``reward.num_workers`` child processes at once.

Every manager already scores in a child process with a per-sample timeout (``RewardManager``, via
``rlkit.rewards.pool.ScorePool``); ``parallel`` only uses more children, so slow scorers overlap. A
child whose sample runs past ``reward.timeout_s`` is killed and replaced and the sample gets
``default_score`` (counted in ``reward/timeouts``); a child that dies is replaced too (counted in
``reward/errors``). A batch with one hanging sample returns after about ``timeout_s``; in the worst
case (every sample hangs) after ``ceil(B / num_workers) * timeout_s``.

Params: ``num_workers`` (``reward.num_workers``, default 2), ``mp_context`` (``fork`` on Linux, else
``spawn``, where the score function must be picklable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlkit.rewards.managers import NaiveRewardManager
from rlkit.rewards.pool import ScorePool

__all__ = ["ParallelRewardManager", "ScorePool"]


class ParallelRewardManager(NaiveRewardManager):
    """``naive``'s contract, scored by ``num_workers`` processes."""

    accepted_params = ("num_workers", "mp_context")

    def __init__(self, tokenizer: Any, score_fn: Callable[..., Any] | None, **kwargs: Any):
        super().__init__(tokenizer, score_fn, **kwargs)
        self.score_workers = int(self.params.get("num_workers", 2))
        self.mp_context = self.params.get("mp_context")
