"""Reward managers: turn a batch of responses into token-level scores.

Contract (every manager, built-in or plugin; ``rlkit.plugin.protocols.RewardManager``)::

    manager = cls(tokenizer, score_fn, num_examine=0, default_score=0.0, timeout_s=10.0[, params=...])
    result = manager(batch)        # -> RewardResult

``params`` (the manager's own parameters, a pydantic model) is passed only when the manager's spec
declares a params model (``RewardManagerSpec.params``). Shaping that composes with any manager —
the reward model's score, DAPO's overlong penalty — is applied after the manager by
``rlkit.rewards.steps.RewardStep``.

The batch needs ``responses [B, T]`` (token ids), ``response_mask [B, T]`` and the per-sample fields
``data_source``, ``reward_model`` (a mapping with ``ground_truth``) and ``extra_info``. The sequence
score goes on the last valid response token (the last 1 of ``response_mask``); every other
position is 0. A response with no valid token gets its score at position 0 (masked out later).

A score function that raises, returns None / NaN / ±inf / a string / a dict without ``score``, or
runs past ``timeout_s``, gives ``default_score`` for that sample; the count goes to ``reward/errors``
or ``reward/timeouts``, the first message of the batch is logged, and each failed sample is listed in
``RewardResult.failures``. When more than ``reward.max_error_fraction`` of a batch failed, the reward step
(``rlkit.rewards.steps.RewardStep``) stops the run with ``RewardFailureError``.

Timeout (every manager, also a plugin's): the base class never calls ``score_all`` in the driver. It
runs it in a child process (``rlkit.rewards.pool.ScorePool``, kept between batches) and kills and
replaces a child that runs past ``timeout_s`` (``reward.timeout_s``, default 10 s). How much one
timeout covers is the manager's ``timeout_scope``: ``"sample"`` (``naive``, ``parallel``:
``score_all`` is element-wise, so each sample is scored, and timed, on its own) or ``"batch"`` (the
default, and ``batch``: one ``score_all(items)`` call for the whole batch; if it times out every
sample gets ``default_score``). A score function therefore runs in a forked copy of the driver:
state it keeps between calls lives in that child (and restarts after a timeout).

Glossary: ``B`` = prompts x group size, ``T`` = response tokens.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.rewards.pool import ScorePool

__all__ = [
    "RewardFailureError",
    "RewardResult",
    "ScoreOutcome",
    "RewardManager",
    "NaiveRewardManager",
    "BatchRewardManager",
    "normalize_score",
]

log = logging.getLogger("rlkit.rewards")


class RewardFailureError(RlkitError):
    """More than ``reward.max_error_fraction`` of a batch's scores failed: the run would train on defaults."""


@dataclass
class RewardResult:
    token_level_scores: torch.Tensor  # [B, T] float32, the score on each response's last valid token
    extra: dict[str, list[Any]] = field(default_factory=dict)  # per-sample extras from dict scores, length B
    # reward/errors, reward/timeouts, reward/score/mean ...
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[tuple[int, str, str]] = field(default_factory=list)  # (row, data_source, message) each


@dataclass
class ScoreOutcome:
    """One sample's score after checking: ``error`` / ``timeout`` mean ``default_score`` was used."""

    score: float
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    timeout: bool = False


def normalize_score(raw: Any, default_score: float) -> ScoreOutcome:
    """Check a score function's return value: a finite number, or a dict with a finite ``score``."""
    extra: dict[str, Any] = {}
    value = raw
    if isinstance(raw, dict):
        extra = {k: v for k, v in raw.items() if k != "score"}
        if "score" not in raw:
            return ScoreOutcome(
                default_score, extra, error=f"returned a dict without a 'score' key (keys: {sorted(raw)})"
            )
        value = raw["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
        shown = repr(value)[:60]
        return ScoreOutcome(
            default_score, extra, error=f"returned {type(value).__name__} {shown}, not a number"
        )
    value = float(value)
    if not math.isfinite(value):
        return ScoreOutcome(default_score, extra, error=f"returned {value}, not a finite number")
    return ScoreOutcome(value, extra)


class RewardManager:
    """Base class: decoding, score placement, metrics and logging. Subclasses implement ``score_all``."""

    #: what one ``timeout_s`` covers: each sample (``score_all`` is element-wise) or the whole batch.
    timeout_scope: Literal["sample", "batch"] = "batch"
    #: child processes that score; ``parallel`` sets it from its ``num_workers`` parameter.
    score_workers: int = 1
    #: multiprocessing start method of the scoring children (None: fork on Linux, else spawn).
    mp_context: str | None = None

    def __init__(
        self,
        tokenizer: Any,
        score_fn: Callable[..., Any] | None,
        *,
        num_examine: int = 0,
        default_score: float = 0.0,
        timeout_s: float = 10.0,
        params: Any = None,
    ):
        if not timeout_s > 0:
            raise RlkitError(f"reward.timeout_s must be > 0 seconds, got {timeout_s}.")
        self.tokenizer = tokenizer
        self.score_fn = score_fn
        self.num_examine = num_examine
        self.default_score = float(default_score)
        self.timeout_s = float(timeout_s)
        self.params = params
        self._pool: ScorePool | None = None

    # ----- what subclasses provide ------------------------------------------------------------
    def score_all(self, items: list[tuple[str, str, Any, dict | None]]) -> list[ScoreOutcome]:
        """Score ``(data_source, solution_str, ground_truth, extra_info)`` items, one outcome each."""
        raise NotImplementedError

    # ----- the shared path --------------------------------------------------------------------
    def __call__(self, batch: Batch) -> RewardResult:
        responses, response_mask = batch["responses"], batch["response_mask"]  # [B, T], [B, T]
        last = self.last_valid_index(response_mask)  # [B]
        texts = [self._decode(responses[i, : int(last[i]) + 1], response_mask[i]) for i in range(len(batch))]
        items = [
            (str(batch["data_source"][i]), texts[i], self._ground_truth(batch, i), self._extra_info(batch, i))
            for i in range(len(batch))
        ]
        if self.score_fn is not None:
            outcomes = self._score_with_timeout(items)
        else:
            outcomes = [ScoreOutcome(0.0) for _ in items]
        scores = torch.tensor([o.score for o in outcomes], dtype=torch.float32)  # [B]
        metrics = self._metrics(outcomes, scores)
        token_level_scores = torch.zeros(response_mask.shape, dtype=torch.float32)  # [B, T]
        token_level_scores[torch.arange(len(batch)), last] = scores
        extra = self._collect_extra(outcomes)
        self._log_problems(items, outcomes)
        self._examine(items, outcomes, scores)
        failures = [
            (i, item[0], o.error) for i, (item, o) in enumerate(zip(items, outcomes)) if o.error is not None
        ]
        return RewardResult(token_level_scores, extra, metrics, failures)

    # ----- the timeout: every manager's score_all runs in a child process ---------------------
    def _score_with_timeout(self, items: list[tuple[str, str, Any, dict | None]]) -> list[ScoreOutcome]:
        """``score_all(items)`` in the scoring children, with ``timeout_s`` per sample or per batch."""
        if self._pool is None:
            self._pool = ScorePool(self._score_in_child, self.score_workers, self.mp_context)
        if self.timeout_scope == "sample":
            results = self._pool.run([([item],) for item in items], self.timeout_s)
        else:
            (result,) = self._pool.run([(items,)], self.timeout_s)
            results = [result] * len(items)
        outcomes = []
        for i, (status, value) in enumerate(results):
            if status == "ok":
                value = value[0] if self.timeout_scope == "sample" else value[i]
                outcomes.append(value)
            else:
                where = "the batch's score call" if self.timeout_scope == "batch" else "the score call"
                outcomes.append(
                    ScoreOutcome(self.default_score, error=f"{where} {value}", timeout=status == "timeout")
                )
        return outcomes

    def _score_in_child(self, items: list[tuple[str, str, Any, dict | None]]) -> list[ScoreOutcome]:
        outcomes = list(self.score_all(items))
        if len(outcomes) != len(items) or not all(isinstance(o, ScoreOutcome) for o in outcomes):
            raise RlkitError(
                f"{type(self).__name__}.score_all returned {len(outcomes)} outcomes for {len(items)} "
                f"items; it must return one ScoreOutcome per item."
            )
        return outcomes

    def close(self) -> None:
        """Stop the scoring children (a hung one is killed)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @staticmethod
    def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # [T]
        return (response_mask.bool() * (positions + 1)).amax(dim=1).clamp(min=1) - 1  # [B]

    def _decode(self, ids: torch.Tensor, mask_row: torch.Tensor) -> str:
        if not bool(mask_row.any()):
            return ""
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    @staticmethod
    def _ground_truth(batch: Batch, i: int) -> Any:
        if "reward_model" not in batch:
            return None
        reward_model = batch["reward_model"][i]
        return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None

    @staticmethod
    def _extra_info(batch: Batch, i: int) -> dict | None:
        """The row's ``extra_info``; with a multi-turn environment's ``env_reward`` (the episode's reward,
        ``rlkit.rewards.environment``) added to it."""
        extra = batch["extra_info"][i] if "extra_info" in batch else None
        if "env_reward" in batch and batch["env_reward"][i] is not None:
            extra = {**(extra or {}), "env_reward": batch["env_reward"][i]}
        return extra

    def _metrics(self, outcomes: Sequence[ScoreOutcome], scores: torch.Tensor) -> dict[str, float]:
        return {
            "reward/errors": float(sum(o.error is not None and not o.timeout for o in outcomes)),
            "reward/timeouts": float(sum(o.timeout for o in outcomes)),
            "reward/score/mean": float(scores.mean()) if len(scores) else 0.0,
        }

    @staticmethod
    def _collect_extra(outcomes: Sequence[ScoreOutcome]) -> dict[str, list[Any]]:
        keys = sorted({k for o in outcomes for k in o.extra})
        return {k: [o.extra.get(k) for o in outcomes] for k in keys}

    def _log_problems(self, items: Sequence[tuple], outcomes: Sequence[ScoreOutcome]) -> None:
        bad = [(item, o) for item, o in zip(items, outcomes) if o.error is not None]
        if not bad:
            return
        (data_source, *_), first = bad[0]
        timeouts = sum(o.timeout for _, o in bad)
        log.warning(
            "%s: %d of %d samples got the default score %s (%d errors, %d timeouts); first, data_source "
                "'%s': %s",
            type(self).__name__, len(bad), len(outcomes), self.default_score,
            len(bad) - timeouts, timeouts, data_source, first.error,
        )  # fmt: skip

    def _examine(
        self, items: Sequence[tuple], outcomes: Sequence[ScoreOutcome], scores: torch.Tensor
    ) -> None:
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = defaultdict(int)
        for i, ((data_source, text, truth, _), outcome) in enumerate(zip(items, outcomes)):
            if shown[data_source] >= self.num_examine:
                continue
            shown[data_source] += 1
            note = f" ({outcome.error})" if outcome.error else ""
            print(
                f"[{data_source}] response: {text!r}\n[{data_source}] ground_truth: {truth!r} score: "
                f"{float(scores[i]):.4g}{note}"
            )


class NaiveRewardManager(RewardManager):
    """Calls ``score_fn(data_source, solution_str, ground_truth, extra_info)`` per sample, one at a time,
    in one scoring child process (``reward.timeout_s`` per sample); ``parallel`` uses several.
    """

    timeout_scope = "sample"

    def score_all(self, items: list[tuple[str, str, Any, dict | None]]) -> list[ScoreOutcome]:
        outcomes = []
        for item in items:
            try:
                raw = self.score_fn(*item)
            except Exception as exc:  # noqa: BLE001 - counted; RewardStep stops past max_error_fraction
                outcomes.append(ScoreOutcome(self.default_score, error=f"raised {type(exc).__name__}: {exc}"))
                continue
            outcomes.append(normalize_score(raw, self.default_score))
        return outcomes


class BatchRewardManager(RewardManager):
    """One call for the whole batch: ``score_fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)``
    returns a list of B scores (numbers or dicts). ``rlkit.rewards.dispatch.batched`` adapts a
    per-sample function. If the call raises, returns the wrong length or runs past ``reward.timeout_s``
    (one timeout for the whole call), every sample gets the default.
    """

    timeout_scope = "batch"

    def score_all(self, items: list[tuple[str, str, Any, dict | None]]) -> list[ScoreOutcome]:
        data_sources, solution_strs, ground_truths, extra_infos = (list(col) for col in zip(*items))
        try:
            raws = self.score_fn(
                data_sources=data_sources,
                solution_strs=solution_strs,
                ground_truths=ground_truths,
                extra_infos=extra_infos,
            )
            raws = list(raws)
            if len(raws) != len(items):
                raise ValueError(f"returned {len(raws)} scores for a batch of {len(items)}")
        except Exception as exc:  # noqa: BLE001
            error = f"batched score raised {type(exc).__name__}: {exc}"
            return [ScoreOutcome(self.default_score, error=error) for _ in items]
        return [normalize_score(raw, self.default_score) for raw in raws]
