"""The dynamic-sampling phase (DAPO): keep the groups whose filter metric varies, refill from new prompts
until the batch holds ``data.train_batch_size`` groups.

    batch, metrics = dynamic_sampling(batch, ctx, accumulator, refill)

``refill(gen_batch)`` is the trainer's: it generates (and scores) a new generation batch of the same step, so
this phase never calls the generation or reward phases itself. Each generation batch is padded to its own
longest prompt; the kept pieces are re-padded to one layout (``concat_rollouts``), then trimmed to the first
``train_batch_size`` whole groups, and get their ``group_id`` again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit.algos import DynamicSamplingAccumulator, DynamicSamplingError, first_groups_mask
from rlkit.batch import Batch
from rlkit.rollout.base import concat_rollouts
from rlkit.step.context import StepContext
from rlkit.step.generate import group_ids

__all__ = ["dynamic_sampling", "score_metric_names"]


def dynamic_sampling(
    batch: Batch, ctx: StepContext, acc: DynamicSamplingAccumulator, refill: Callable[[int], Batch]
) -> tuple[Batch, dict[str, float]]:
    acc.reset()
    kept: list[Batch] = []
    name = ctx.recipe.algorithm.filter_groups.metric
    while True:
        try:
            keep = acc.add(batch["group_id"], filter_metric(batch, name, ctx.recipe.reward.manager))
        except DynamicSamplingError as exc:
            raise DynamicSamplingError(
                f"{exc} Metrics the scores carry: {score_metric_names(batch)}."
            ) from None
        kept.append(batch[keep])
        if acc.full:
            break
        batch = refill(acc.num_gen_batches)
    full = concat_rollouts(kept, ctx.rt.tokenizer.pad_token_id)
    full["group_id"] = group_ids(full)  # the pieces' ids restart at 0 in every generation batch
    full = full[first_groups_mask(full["group_id"], acc.target_groups)]
    full["group_id"] = group_ids(full)
    return full, acc.metrics()


def score_metric_names(batch: Batch) -> list[str]:
    """Per-sample metrics a group filter can read: ``score`` plus the reward's extra values."""
    return ["score"] + sorted(k.split("/", 1)[1] for k in batch.keys() if k.startswith("reward_extra/"))


def filter_metric(batch: Batch, name: str, manager: str) -> torch.Tensor:
    """[B] values of ``algorithm.filter_groups.metric``."""
    if name in ("score", "seq_final_reward"):
        return batch["token_level_scores"].sum(-1)
    if f"reward_extra/{name}" in batch:
        return torch.tensor([float(v) for v in batch[f"reward_extra/{name}"]])
    raise DynamicSamplingError(
        f"algorithm.filter_groups.metric={name!r}: the reward manager '{manager}' gives no such per-sample "
        f"metric; valid here: {score_metric_names(batch)}."
    )
