"""DAPO's two sampling-side pieces (Yu et al. 2025, arXiv:2503.14476).

- Overlong reward shaping: a linear penalty for responses that run into the last ``buffer_len``
  tokens of the length budget (``reward.overlong_buffer.*``).
- Dynamic sampling: drop prompt groups whose metric does not vary (they carry zero advantage), keep
  generating until the training batch is full, and give up with an error after
  ``algorithm.filter_groups.max_num_gen_batches`` generation batches.

Shapes: ``B`` = prompts x group size; ``index`` [B] group ids (prompt uid as ints).
"""

from __future__ import annotations

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
            f"reward.overlong_buffer.len must be in (0, max response length={max_response_length}], got {buffer_len}."
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
        raise AlgoError(f"metric_values must have shape {tuple(index.shape)} ([B]), got {tuple(metric_values.shape)}")
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

    ``max_num_gen_batches <= 0`` means no limit (veRL).
    """

    def __init__(self, target_groups: int, max_num_gen_batches: int, metric: str = "score"):
        if target_groups <= 0:
            raise AlgoError(f"target_groups (the training batch size in prompts) must be > 0, got {target_groups}.")
        self.target_groups = target_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.metric = metric
        self.reset()

    def reset(self) -> None:
        self.num_gen_batches = 0
        self.num_groups = 0  # kept groups so far
        self.num_groups_seen = 0

    @property
    def full(self) -> bool:
        return self.num_groups >= self.target_groups

    def add(self, index: torch.Tensor, metric_values: torch.Tensor) -> torch.Tensor:
        """Record one generation batch; return its keep mask [B]. Raises when the budget is spent."""
        keep = filter_groups(index, metric_values)
        self.num_gen_batches += 1
        self.num_groups += group_ids(index[keep])[1] if bool(keep.any()) else 0
        self.num_groups_seen += group_ids(index)[1]
        limit = self.max_num_gen_batches
        if not self.full and limit > 0 and self.num_gen_batches >= limit:
            raise DynamicSamplingError(
                f"dynamic sampling (algorithm.filter_groups) generated {self.num_gen_batches} batches, the limit "
                f"algorithm.filter_groups.max_num_gen_batches={limit}, and kept only {self.num_groups} of the "
                f"{self.target_groups} prompt groups the training batch needs ({self.num_groups_seen} seen): in the "
                f"others every response got the same '{self.metric}', so they carry no learning signal. "
                "The data is probably too easy or too hard for the model. Raise max_num_gen_batches (0 = no "
                "limit), raise rollout.n, use easier/harder prompts, or set algorithm.filter_groups.enable=false."
            )
        return keep

    def metrics(self) -> dict[str, float]:
        """veRL's ``train/num_gen_batches`` plus the share of groups kept."""
        kept = self.num_groups / self.num_groups_seen if self.num_groups_seen else 0.0
        return {"train/num_gen_batches": float(self.num_gen_batches), "train/filter_groups_kept_frac": kept}
