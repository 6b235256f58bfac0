"""What the actor update needs beyond its micro-batch: a mini-batch-wide token selection (Clip-Cov, KL-Cov)
and, on the on-policy fast path, the rollout/trainer mismatch from the update's own log-probs.

- ``mini_batch_selection``: a policy loss whose spec declares ``mini_batch_selection`` picks its tokens
  from the whole mini-batch, over all ranks: a no-grad pre-pass gives ``log_prob`` [b, T] of this rank's
  rows (before the mini-batch's optimizer step, so equal to the update's own), ``log_prob``,
  ``old_log_prob``, ``advantages`` and ``response_mask`` are all-gathered into the global mini-batch
  [world * b, T] (rank r's rows at ``r*b:(r+1)*b``), every rank runs the selection with the same
  generator seed, and keeps its own rows. Micro-batches get their rows' slice as ``selected``, so the
  loss and gradient do not depend on the micro-batch size or the number of ranks. Cost: one extra
  forward of the mini-batch (no backward).
- ``UpdateMismatch``: when ``old_log_prob`` was not recomputed (one epoch over one mini-batch), the first
  mini-batch's log-probs are the old policy's exactly; it sums ``mismatch_stats`` of each micro-batch
  against ``rollout_log_probs`` and reduces them over ranks (sums, and max for the max), giving the
  same ``training/rollout_probs_diff_*`` and ``rollout_corr/kl`` metrics a recomputed pass gives.

Shapes: ``b`` samples of this rank's mini-batch, ``T`` response tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit.algos.rollout_correction import mismatch_from_stats, mismatch_stats
from rlkit.batch import Batch
from rlkit.model import fsdp
from rlkit.model.forward import compute_log_probs

__all__ = ["mini_batch_selection", "UpdateMismatch"]


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    """[b, T] on each rank → [world * b, T] in rank order (this rank's tensor alone without a process
    group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def mini_batch_selection(actor: Any, mini: Batch, temperature: float, seed: int) -> torch.Tensor | None:
    """This rank's rows [b, T] (bool) of the policy loss's selection over the global mini-batch, or None when
    the loss declares no ``mini_batch_selection``. ``seed`` must be the same on every rank."""
    from rlkit.plugin.registry import load_object

    select = actor.policy_loss.spec.mini_batch_selection
    if select is None:
        return None
    cfg = actor.cfg
    log_prob = compute_log_probs(
        actor.module,
        mini,
        temperature=temperature,
        micro_batch_size=cfg.ppo_micro_batch_size_per_rank,
        with_entropy=False,
        mixed_precision=cfg.mixed_precision,
        device=actor.device,
        max_token_len=cfg.ppo_max_token_len_per_rank if cfg.use_dynamic_bsz else None,
        plan=actor.forward_plan,
    )["log_prob"]  # [b, T]
    old = mini["old_log_prob"] if "old_log_prob" in mini else log_prob
    mask = mini["response_mask"].to(log_prob.dtype)
    # [world * b, T] each
    whole = [_gather_rows(x.float()) for x in (log_prob, old, mini["advantages"], mask)]
    generator = torch.Generator().manual_seed(seed)
    selected = load_object(select)(*whole, generator=generator, **actor.policy_loss.kwargs)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return selected[rank * len(mini) : (rank + 1) * len(mini)].bool()


class UpdateMismatch:
    """Mismatch statistics summed over the micro-batches of the update's first mini-batch (fast path)."""

    def __init__(self) -> None:
        self.stats = torch.zeros(11, dtype=torch.float64)  # rlkit.algos.rollout_correction.MISMATCH_STATS

    def add(
        self, log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
    ) -> None:
        piece = mismatch_stats(log_prob.detach().cpu(), rollout_log_probs.cpu(), response_mask.cpu())
        self.stats[:-1] += piece[:-1]
        self.stats[-1] = max(self.stats[-1], piece[-1])

    def metrics(self) -> dict[str, float]:
        """Collective: every rank calls it and gets the same metrics."""
        sums = fsdp.all_reduce(self.stats[:-1].clone())
        top = fsdp.all_reduce(self.stats[-1:].clone(), torch.distributed.ReduceOp.MAX)
        return mismatch_from_stats(torch.cat([sums, top]))
