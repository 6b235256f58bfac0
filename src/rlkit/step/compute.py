"""Phases that are one call to a role's workers (the worker groups split the batch over their ranks).

batch, metrics = old_log_prob(batch, ctx, with_sum_pi_squared)   # actor: old_log_prob [B, T] (+ Σπ²)
batch, metrics = ref_log_prob(batch, ctx)                        # ref: ref_log_prob [B, T]
batch, metrics = values(batch, ctx)                              # critic: values [B, T]
batch, metrics = update_critic(batch, ctx)                       # critic/* metrics
batch, metrics = update_actor(batch, ctx)                        # actor/* metrics (a mask correction applied)
batch, metrics = sync_weights(batch, ctx)                        # hybrid engine: the rollout gets the update
"""

from __future__ import annotations

from rlkit.batch import Batch
from rlkit.step.context import StepContext
from rlkit.step.correction import loss_batch

__all__ = ["old_log_prob", "ref_log_prob", "sync_weights", "update_actor", "update_critic", "values"]


def old_log_prob(batch: Batch, ctx: StepContext, with_sum_pi_squared: bool) -> tuple[Batch, dict[str, float]]:
    spp = {"with_sum_pi_squared": True} if with_sum_pi_squared else {}  # OTB's sum_pi_squared
    return batch.union(ctx.rt.actor.call("compute_log_prob", batch, balance=ctx.balance, **spp)), {}


def ref_log_prob(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    return batch.union(ctx.rt.ref_call("compute_ref_log_prob", batch)), {}


def values(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    return batch.union(ctx.rt.critic.call("compute_values", batch, balance=ctx.balance)), {}


def update_critic(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    return batch, ctx.rt.critic.call("update_critic", batch, balance=ctx.balance)[0]


def update_actor(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    actor = ctx.rt.actor
    metrics = actor.call("update_actor", loss_batch(batch), balance=ctx.balance)[0]  # the same on every rank
    return batch, metrics | actor.last_metrics  # global_seqlen/*: tokens per rank before and after balancing


def sync_weights(batch: Batch, ctx: StepContext) -> tuple[Batch, dict[str, float]]:
    ctx.rt.actor.call("sync_weights", dispatch="all")
    return batch, {}
