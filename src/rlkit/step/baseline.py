"""The greedy-baseline phase (ReMax, Li et al. 2023): each prompt's greedy response, scored, is the baseline
of its group's sampled responses.

    batch, metrics = greedy_baseline(batch, ctx, prompts)   # adds reward_baselines [B]

Runs right after generation when the estimator's spec declares ``needs_greedy_baseline``; ``prompts`` [B/n]
are the step's prompts (the batch's rows are those prompts repeated ``rollout.n`` times, interleaved).
"""

from __future__ import annotations

from rlkit.batch import Batch
from rlkit.rollout.base import rollout_inputs
from rlkit.step.context import StepContext
from rlkit.step.reward import reward_of

__all__ = ["greedy_baseline"]


def greedy_baseline(batch: Batch, ctx: StepContext, prompts: Batch) -> tuple[Batch, dict[str, float]]:
    greedy = ctx.rt.actor.call(
        "generate_sequences", rollout_inputs(prompts), balance=False, n=1, do_sample=False
    )
    greedy_batch = prompts.select(list(prompts.non_tensors)).union(Batch(greedy.tensors, {}, {}))
    baseline = reward_of(greedy_batch, ctx).token_level_scores.sum(-1)  # [B/n]
    batch["reward_baselines"] = baseline.repeat_interleave(ctx.recipe.rollout.n)  # [B]
    return batch, {"critic/reward_baseline/mean": float(baseline.mean())}
