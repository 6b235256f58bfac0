"""The reward phase of a step: any reward manager, then shaping steps that compose with every manager.

    step = RewardStep(manager, reward_model="fallback", has_rule=dispatcher.has_rule,
                      overlong=OverlongShaping(buffer_len=64, penalty_factor=1.0, max_response_length=512))
    result = step(batch)     # RewardResult: token_level_scores [B, T], extra, metrics

1. The manager scores every sample (rule-based ``compute_score`` functions).
2. Reward model (when the batch carries ``rm_scores [B]`` from the reward-model worker):
   ``fallback`` (veRL's behaviour) uses the model's score for samples whose data_source has no rule
   function and the rule score elsewhere; ``sum`` adds the model's score to every rule score.
3. DAPO's overlong shaping (``reward.overlong_buffer``): responses longer than ``max_response_length -
   buffer_len`` tokens lose up to ``penalty_factor`` (``rlkit.algos.overlong_penalty``).

Each sequence score sits on the response's last valid token, as the managers place it.
Glossary: ``B`` = prompts × group size, ``T`` = response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.rewards.managers import RewardFailureError, RewardManager, RewardResult

__all__ = ["OverlongShaping", "RewardStep", "check_failures"]


@dataclass(frozen=True)
class OverlongShaping:
    buffer_len: int
    penalty_factor: float
    max_response_length: int

    def __post_init__(self) -> None:
        # Checked when the run is built, not at the first step's reward.
        if not 0 < self.buffer_len <= self.max_response_length:
            raise RlkitError(
                f"reward.overlong_buffer.len must be in (0, max response length={self.max_response_length}], "
                f"got {self.buffer_len}: the penalty ramps over the last `len` tokens before "
                "data.max_response_length. Lower reward.overlong_buffer.len or raise "
                "data.max_response_length."
            )

    def __call__(self, response_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` mask → ``[B]`` penalty (0 or negative)."""
        from rlkit.algos import overlong_penalty

        lengths = response_mask.sum(dim=1)  # [B]
        return overlong_penalty(
            lengths, self.max_response_length, self.buffer_len, self.penalty_factor
        ).float()


def check_failures(result: RewardResult, batch_size: int, max_error_fraction: float) -> None:
    """Raise ``RewardFailureError`` when more than ``max_error_fraction`` of the batch's scores failed.

    Failures are ``result.failures`` (row, data_source, message); a manager that lists none (a plugin not
    built on ``RewardManager``) is counted from its ``reward/errors`` and ``reward/timeouts`` metrics."""
    failures = result.failures
    metrics = result.metrics
    count = len(failures) or int(metrics.get("reward/errors", 0) + metrics.get("reward/timeouts", 0))
    if batch_size <= 0 or count / batch_size <= max_error_fraction:
        return
    per_source: dict[str, int] = {}
    for _, source, _ in failures:
        per_source[source] = per_source.get(source, 0) + 1
    sources = ", ".join(f"'{s}' ({n} failed)" for s, n in sorted(per_source.items())) or "unknown"
    first = (
        f"first failure: row {failures[0][0]}, data_source '{failures[0][1]}': {failures[0][2]}"
        if failures
        else "the manager reports no per-sample failures"
    )
    raise RewardFailureError(
        f"reward: {count} of {batch_size} scores of a batch failed ({count / batch_size:.0%}, more than "
        f"reward.max_error_fraction={max_error_fraction:g}), data_source {sources}; {first}. Training on "
        "reward.default_score for those samples would teach nothing: fix the score function (the "
        "compute_score registered for that data_source, or reward.custom_score), or raise "
        "reward.max_error_fraction (1.0 never stops)."
    )


class RewardStep:
    """Manager + reward-model combination + overlong shaping (see the module docstring); stops the run when
    more than ``max_error_fraction`` of a batch's scores failed (``check_failures``)."""

    def __init__(
        self,
        manager: Any,
        *,
        reward_model: Literal["fallback", "sum"] | None = None,
        has_rule: Callable[[str], bool] | None = None,
        overlong: OverlongShaping | None = None,
        max_error_fraction: float = 1.0,
    ):
        self.manager = manager
        self.reward_model = reward_model
        self.has_rule = has_rule or (lambda _source: True)
        self.overlong = overlong
        self.max_error_fraction = max_error_fraction

    def __call__(self, batch: Batch) -> RewardResult:
        result = self.manager(batch)
        check_failures(result, len(batch), self.max_error_fraction)
        mask = batch["response_mask"]  # [B, T]
        last = RewardManager.last_valid_index(mask)  # [B]
        rows = torch.arange(len(batch))
        scores = result.token_level_scores[rows, last].clone()  # [B]
        if self.reward_model is not None and "rm_scores" in batch:
            scores = self._combine(batch, scores, result)
        if self.overlong is not None:
            penalty = self.overlong(mask)  # [B]
            scores = scores + penalty
            result.metrics["reward/overlong_penalty/mean"] = float(penalty.mean()) if len(penalty) else 0.0
            result.metrics["reward/overlong_ratio"] = (
                float((penalty < 0).float().mean()) if len(penalty) else 0.0
            )
            result.extra["overlong_reward"] = penalty.tolist()
            result.extra["overlong"] = (penalty < 0).tolist()
        result.token_level_scores = torch.zeros_like(result.token_level_scores)
        result.token_level_scores[rows, last] = scores
        return result

    def _combine(self, batch: Batch, scores: torch.Tensor, result: RewardResult) -> torch.Tensor:
        rm = batch["rm_scores"].to(torch.float32).reshape(-1)  # [B]
        if self.reward_model == "sum":
            use_rm = torch.ones(len(batch), dtype=torch.bool)
            combined = scores + rm
        else:  # fallback: the model scores what no rule function covers
            use_rm = torch.tensor([not self.has_rule(str(s)) for s in batch["data_source"]], dtype=torch.bool)
            combined = torch.where(use_rm, rm, scores)
        result.metrics["reward/rm_scores/mean"] = float(rm.mean()) if len(rm) else 0.0
        result.metrics["reward/rm_scores/used_fraction"] = float(use_rm.float().mean()) if len(rm) else 0.0
        result.extra["rm_score"] = rm.tolist()
        return combined

    def close(self) -> None:
        close = getattr(self.manager, "close", None)
        if close is not None:
            close()
