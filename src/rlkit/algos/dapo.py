"""DAPO's two sampling-side pieces (Yu et al. 2025, arXiv:2503.14476).

- Overlong reward shaping: a linear penalty for responses that run into the last ``buffer_len``
  tokens of the length budget (``reward.overlong_buffer.*``).
- Dynamic sampling: drop prompt groups whose metric does not vary (they carry zero advantage), keep
  generating until the training batch is full, and give up with an error after
  ``algorithm.filter_groups.max_num_gen_batches`` generation batches.

Shapes: ``B`` = prompts x group size; ``index`` [B] group ids (prompt uid as ints).
"""

from __future__ import annotations

from collections import Counter

import torch

from rlkit.algos._util import AlgoError, group_ids
from rlkit.errors import RlkitError

__all__ = [
    "overlong_penalty",
    "filter_groups",
    "first_groups_mask",
    "DynamicSamplingAccumulator",
    "DynamicSamplingError",
]


class DynamicSamplingError(RlkitError):
    """Dynamic sampling used its generation budget without filling the training batch."""


def overlong_penalty(
    response_length: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """``min(0, -(L - (L_max - buffer)) / buffer * penalty_factor)`` per response: 0 up to the expected
    length ``L_max - buffer``, falling linearly to ``-penalty_factor`` at ``L_max``. [B] -> [B] float.

    ``response_length`` counts valid response tokens. Added to the sequence score by the reward
    manager (veRL's DAPO reward manager).
    """
    if buffer_len <= 0 or buffer_len > max_response_length:
        raise AlgoError(
            f"reward.overlong_buffer.len must be in (0, max response length={max_response_length}], got "
            f"{buffer_len}."
        )
    expected = max_response_length - buffer_len
    exceed = response_length.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def filter_groups(index: torch.Tensor, metric_values: torch.Tensor) -> torch.Tensor:
    """Keep mask [B]: True for samples whose group's metric varies, and for singleton groups (veRL
    keeps a group when ``std > 0`` or it has one sample). "Varies" is tested exactly
    (``max != min``), not ``std > 0`` on floats, so equal scores are always dropped.
    """
    if metric_values.shape != index.shape:
        raise AlgoError(
            f"metric_values must have shape {tuple(index.shape)} ([B]), got {tuple(metric_values.shape)}"
        )
    dense, num_groups = group_ids(index)
    values = metric_values.to(torch.float64)
    inf = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=values.device)
    g_max = (-inf).scatter_reduce(0, dense, values, reduce="amax")
    g_min = inf.scatter_reduce(0, dense, values, reduce="amin")
    size = torch.bincount(dense, minlength=num_groups)
    keep_group = (g_max != g_min) | (size == 1)
    return keep_group[dense]


def first_groups_mask(index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Mask [B] selecting every sample of the first ``num_groups`` groups in order of first appearance
    (how the trainer trims an over-full accumulated batch to the training batch size)."""
    seen: dict[int, int] = {}
    for gid in index.tolist():
        seen.setdefault(gid, len(seen))
    rank = torch.tensor([seen[g] for g in index.tolist()], dtype=torch.long, device=index.device)
    return rank < num_groups


class DynamicSamplingAccumulator:
    """Counts kept prompt groups across generation batches for one training step.

    Use::

        acc = DynamicSamplingAccumulator(target_groups=train_batch_size, max_num_gen_batches=10)
        while True:
            gen = generate(...)
            keep = acc.add(gen_index, gen_metric)   # raises DynamicSamplingError when out of budget
            kept.append(gen[keep])
            if acc.full:
                break
        batch = concat(kept); batch = batch[first_groups_mask(batch_index, acc.target_groups)]
        acc.reset()

    ``max_num_gen_batches <= 0`` means no limit (veRL). Groups beyond ``target_groups`` are kept by
    ``add`` but trimmed by the caller; ``metrics()`` counts them as kept (they passed the filter).
    """

    def __init__(self, target_groups: int, max_num_gen_batches: int, metric: str = "score"):
        if target_groups <= 0:
            raise AlgoError(
                f"target_groups (the training batch size in prompts) must be > 0, got {target_groups}."
            )
        self.target_groups = target_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.metric = metric
        self.reset()

    def reset(self) -> None:
        self.num_gen_batches = 0
        self.num_groups = 0  # kept groups so far
        self.num_groups_seen = 0
        self.group_values: Counter[tuple[float, ...]] = Counter()  # each group's sorted metric values

    @property
    def full(self) -> bool:
        return self.num_groups >= self.target_groups

    def add(self, index: torch.Tensor, metric_values: torch.Tensor) -> torch.Tensor:
        """Record one generation batch; return its keep mask [B]. Raises when the budget is spent."""
        keep = filter_groups(index, metric_values)
        dense, num_groups = group_ids(index)
        self.num_gen_batches += 1
        self.num_groups += group_ids(index[keep])[1] if bool(keep.any()) else 0
        self.num_groups_seen += num_groups
        values = metric_values.detach().to(torch.float64).cpu().tolist()
        per_group: list[list[float]] = [[] for _ in range(num_groups)]
        for gid, value in zip(dense.tolist(), values):
            per_group[gid].append(round(value, 4))
        self.group_values.update(tuple(sorted(v)) for v in per_group)
        limit = self.max_num_gen_batches
        if not self.full and limit > 0 and self.num_gen_batches >= limit:
            raise DynamicSamplingError(self._exhausted_message())
        return keep

    def summary(self, limit: int = 12) -> str:
        """What every group scored so far, compactly: ``[0 0 0 0] x21, [-1 -1 -1 -1] x8, [0 0 0 1] x1``
        (each group's sorted values, most frequent first; the rest counted after ``limit`` patterns)."""
        common = self.group_values.most_common()

        def fmt(vals: tuple[float, ...]) -> str:
            return "[" + " ".join(f"{v:g}" for v in vals) + "]"

        shown = ", ".join(f"{fmt(vals)} x{count}" for vals, count in common[:limit])
        rest = sum(count for _, count in common[limit:])
        return shown + (f", and {rest} more groups" if rest else "")

    def _exhausted_message(self) -> str:
        return (
            "dynamic sampling (algorithm.filter_groups) used its budget of "
            f"algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches} generation batches and "
            f"kept only {self.num_groups} of the {self.target_groups} prompt groups the training batch needs "
            f"({self.num_groups_seen} groups seen). A group is kept when its responses differ in "
            f"algorithm.filter_groups.metric='{self.metric}'; what every group scored (sorted values per "
            f"group, x how many groups): {self.summary()}. Groups whose values are all equal carry no "
            "learning signal: the data is too easy or too hard for the model, or the metric is too coarse. "
            "Fix: raise algorithm.filter_groups.max_num_gen_batches (0 = no limit), raise rollout.n, use "
            "prompts nearer the model's level, pick another algorithm.filter_groups.metric, or set "
            "algorithm.filter_groups.enable=false."
        )

    def metrics(self) -> dict[str, float]:
        """veRL's ``train/num_gen_batches``; groups kept / dropped by the filter and the share kept."""
        kept = self.num_groups / self.num_groups_seen if self.num_groups_seen else 0.0
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/filter_groups_kept": float(self.num_groups),
            "train/filter_groups_dropped": float(self.num_groups_seen - self.num_groups),
            "train/filter_groups_kept_frac": kept,
        }
