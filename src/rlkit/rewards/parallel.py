"""The ``parallel`` reward manager: ``naive`` scored by ``num_workers`` child processes at once.

Every manager already scores in a child process with a per-sample timeout (``RewardManager``, via
``rlkit.rewards.pool.ScorePool``); ``parallel`` only uses more children, so slow scorers overlap. A
child whose sample runs past ``reward.timeout_s`` is killed and replaced and the sample gets
``default_score`` (counted in ``reward/timeouts``); a child that dies is replaced too (counted in
``reward/errors``). A batch with one hanging sample returns after about ``timeout_s``; in the worst
case (every sample hangs) after ``ceil(B / num_workers) * timeout_s``.

Params (``ParallelManagerParams``, beside the name): ``num_workers`` (default 2). ``mp_context`` (a
constructor argument for tests): ``fork`` on Linux, else ``spawn``, where the score function must be
picklable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlkit.rewards.managers import NaiveRewardManager
from rlkit.rewards.pool import ScorePool

__all__ = ["ParallelRewardManager", "ScorePool"]


class ParallelRewardManager(NaiveRewardManager):
    """``naive``'s contract, scored by ``num_workers`` processes."""

    def __init__(
        self,
        tokenizer: Any,
        score_fn: Callable[..., Any] | None,
        *,
        params: Any = None,
        mp_context: str | None = None,
        **kwargs: Any,
    ):
        """``params``: ``ParallelManagerParams`` (``reward.manager: {name: parallel, num_workers: N}``)."""
        super().__init__(tokenizer, score_fn, params=params, **kwargs)
        self.score_workers = int(params.num_workers if params is not None else 2)
        self.mp_context = mp_context
