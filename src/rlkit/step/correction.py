"""The rollout-correction phase of the step (driver side): compare the rollout engine's log-probs with
the trainer's recomputed ``old_log_prob`` and apply the recipe's correction.

``correct_rollout(batch, correction)`` runs after ``old_log_prob`` (the trainer forces that pass when a
correction is set). It always logs the mismatch under veRL's names (``training/rollout_probs_diff_*``,
``rollout_corr/kl``, ``rollout_corr/k3_kl``; ``rlkit.algos.rollout_correction.mismatch_from_stats``), and
with a correction (``rlkit.plugin.specs.RolloutCorrectionSpec``) adds

- ``rollout_is_weights [B, T]`` (``output="weights"``): the actor multiplies its per-token policy loss
  by them (no gradient), and OTB estimators scale their path variance by their square;
- ``rollout_rs_mask [B, T]`` (``output="mask"``): 0/1; ``loss_batch`` gives the actor update
  ``response_mask * rollout_rs_mask``, so rejected tokens leave the loss and its token counts (veRL's
  rejection sampling); the rest of the step keeps the rollout's own mask;

and the correction's metrics under ``rollout_corr/`` (with ``rollout_corr/bypass`` = 0). Every correction is
row-local, so computing it over the whole batch here equals computing it per rank or micro-batch.

**Bypass** (veRL's ``bypass_mode``; ``{name: decoupled, bypass: true}``, a correction whose spec declares
``bypass``): the rollout's own log-probs serve as pi_old. The trainer runs no old-log-prob pass; here
``old_log_prob := rollout_log_probs`` and ``meta["old_log_prob_is_rollout"]`` is set, and nothing else: the
behaviour weight pi_old / pi_rollout is exactly 1, so no weights are added and no function is called, and the
actor's PPO ratio is pi_theta / pi_rollout. The mismatch metrics then come from the actor's update (its first
mini-batch's log-probs are the current policy's, before any step: ``rlkit.model.loss_inputs.UpdateMismatch``),
since comparing old_log_prob with itself here would report a mismatch of 0. Metric: ``rollout_corr/bypass`` =
1 (and no ``timing_s/old_log_prob``).

Shapes: ``B`` samples, ``T`` response tokens.
"""

from __future__ import annotations

from typing import Any

from rlkit.batch import Batch
from rlkit.errors import RlkitError

__all__ = ["bypass_on", "correct", "correct_rollout", "loss_batch"]


def bypass_on(correction: Any | None) -> bool:
    """Whether the recipe's correction (a ``Resolved`` or None) runs in bypass mode (pi_old := pi_rollout)."""
    return correction is not None and correction.spec.bypass and bool(correction.params.bypass)


def correct(batch: Batch, ctx: Any) -> tuple[Batch, dict[str, float]]:
    """The correction phase: ``correct_rollout`` with the recipe's correction (``ctx.rt.pipeline``)."""
    return correct_rollout(batch, ctx.rt.pipeline.rollout_correction)


def correct_rollout(batch: Batch, correction: Any | None) -> tuple[Batch, dict[str, float]]:
    """``batch`` (with ``old_log_prob``; ``rollout_log_probs`` unless the backend gives none) → the batch
    with the correction's tensor added, and the mismatch and correction metrics. In bypass mode ``batch``
    has no ``old_log_prob`` yet: it gets ``rollout_log_probs`` [B, T] as its ``old_log_prob``."""
    from rlkit.algos.rollout_correction import mismatch_from_stats, mismatch_stats

    if bypass_on(correction):
        if "rollout_log_probs" not in batch:
            raise RlkitError(
                "rollout correction bypass: the batch has no rollout_log_probs to use as old_log_prob; the "
                "rollout backend must return them (validation checks its spec's rollout_log_probs)"
            )
        batch["old_log_prob"] = batch["rollout_log_probs"]
        batch.meta["old_log_prob_is_rollout"] = True
        return batch, {"rollout_corr/bypass": 1.0}
    if "rollout_log_probs" not in batch or "old_log_prob" not in batch:
        return batch, {}
    old, rollout, mask = batch["old_log_prob"], batch["rollout_log_probs"], batch["response_mask"]
    metrics = mismatch_from_stats(mismatch_stats(old, rollout, mask))
    if correction is None:
        return batch, metrics
    out, corr_metrics = correction.fn(old, rollout, mask, **correction.kwargs)  # [B, T]
    batch["rollout_rs_mask" if correction.spec.output == "mask" else "rollout_is_weights"] = out.float()
    metrics |= {f"rollout_corr/{k}": float(v) for k, v in corr_metrics.items()} | {"rollout_corr/bypass": 0.0}
    return batch, metrics


def loss_batch(batch: Batch) -> Batch:
    """The batch the actor update sees: a mask correction's rejected tokens taken out of ``response_mask``."""
    if "rollout_rs_mask" not in batch:
        return batch
    out = Batch({k: batch.tensors[k] for k in batch.tensors.keys()}, batch.non_tensors, batch.meta)
    out["response_mask"] = batch["response_mask"] * batch["rollout_rs_mask"].to(batch["response_mask"].dtype)
    return out
