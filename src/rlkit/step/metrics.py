"""Step metrics with veRL's names (docs/metrics.md explains each).

Pure functions over a finished step's Batch and timings; the trainer merges their dicts.
Shapes: B = samples (prompts × rollout.n), P = prompt tokens, T = response tokens.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlkit.batch import Batch

__all__ = ["Timer", "data_metrics", "timing_metrics", "throughput_metrics", "validation_metrics", "stats"]


class Timer:
    """Accumulates wall time per phase: ``with timer("gen"): ...`` → ``timer.times["gen"]``.

    ``on_enter(name)`` runs as each phase starts (the trainer's fault-injection point and watchdog),
    ``on_exit(name, seconds)`` as it ends.
    """

    def __init__(
        self,
        on_enter: Callable[[str], None] | None = None,
        on_exit: Callable[[str, float], None] | None = None,
    ) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.on_enter = on_enter
        self.on_exit = on_exit

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.times[name] += seconds
            if self.on_exit is not None:
                self.on_exit(name, seconds)


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``{prefix/mean, prefix/max, prefix/min}`` of a 1-D tensor (empty → no keys)."""
    values = values.detach().float().flatten()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask.bool()]


def data_metrics(batch: Batch, *, max_prompt_length: int, max_response_length: int) -> dict[str, float]:
    """critic/{score,rewards,advantages,returns,values}, response_length/*, prompt_length/*."""
    response_mask = batch["response_mask"]  # [B, T]
    prompt_mask = batch["attention_mask"][:, : -response_mask.shape[1]]  # [B, P]
    response_length = response_mask.sum(-1).float()  # [B]
    prompt_length = prompt_mask.sum(-1).float()  # [B]
    metrics: dict[str, float] = {}
    metrics |= stats("critic/score", batch["token_level_scores"].sum(-1))
    metrics |= stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    for key in ("advantages", "returns", "values"):
        if key in batch:
            metrics |= stats(f"critic/{key}", _masked(batch[key], response_mask))
    if "values" in batch and "returns" in batch:
        returns = _masked(batch["returns"], response_mask)
        values = _masked(batch["values"], response_mask)
        var = returns.var(unbiased=False)
        metrics["critic/vf_explained_var"] = (
            1.0 - (returns - values).var(unbiased=False) / (var + 1e-5)
        ).item()
    metrics |= stats("response_length", response_length)
    metrics["response_length/clip_ratio"] = (response_length >= max_response_length).float().mean().item()
    metrics |= stats("prompt_length", prompt_length)
    metrics["prompt_length/clip_ratio"] = (prompt_length >= max_prompt_length).float().mean().item()
    return metrics


def timing_metrics(times: dict[str, float], batch: Batch) -> dict[str, float]:
    """timing_s/<phase> and timing_per_token_ms/<phase> (gen per response token, others per token)."""
    response_tokens = max(int(batch["response_mask"].sum()), 1)
    all_tokens = max(int(batch["attention_mask"].sum()), 1)
    metrics = {f"timing_s/{name}": seconds for name, seconds in times.items()}
    for name, seconds in times.items():
        if name == "step":
            continue
        tokens = response_tokens if name == "gen" else all_tokens
        metrics[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / tokens
    return metrics


def throughput_metrics(batch: Batch, step_time: float, num_ranks: int) -> dict[str, float]:
    """perf/{total_num_tokens, time_per_step, throughput (tokens/s per rank), cpu_memory_used_gb}."""
    total = int(batch["attention_mask"].sum())
    metrics = {
        "perf/total_num_tokens": float(total),
        "perf/time_per_step": step_time,
        "perf/throughput": total / max(step_time, 1e-9) / max(num_ranks, 1),
    }
    try:
        import psutil

        metrics["perf/cpu_memory_used_gb"] = psutil.Process().memory_info().rss / 2**30
    except ImportError:  # psutil comes with ray[default]; stay quiet if it is missing
        pass
    return metrics


def validation_metrics(
    data_sources: np.ndarray,
    uids: np.ndarray,
    scores: list[float],
    n: int,
    extra: dict[str, list[Any]] | None = None,
) -> dict[str, float]:
    """val-core/<data_source>/<var>/mean@n and best@n (best over each prompt's n samples): the shared lines of
    ``rlkit.eval.metrics.core_metrics`` (what ``rlkit eval`` reports too).

    ``var`` is ``score`` plus every numeric extra metric the score function returned (``acc`` ...).
    """
    from rlkit.eval.metrics import Samples, core_metrics

    samples = Samples([str(s) for s in data_sources], [str(u) for u in uids], list(scores), dict(extra or {}))
    return core_metrics(samples, n)
