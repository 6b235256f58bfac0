"""Loss aggregation: per-token losses [B, T] -> one scalar, exact under any micro-batch or rank split.

Why the counts are arguments: a mini-batch is cut into micro-batches (gradient accumulation) and
across data-parallel ranks. If each piece divided by its *own* token count, the pieces would be
weighted by 1/(their size) and the summed gradient would differ from the full batch's (veRL shipped
this for a long time: PRs #906, #5641, #5877). Here every piece divides by the count over the
**whole mini-batch** (all micro-batches, all ranks), so

    sum over pieces of agg_loss(piece, global counts) == agg_loss(whole mini-batch)

exactly in value and in gradient (tests/unit/algos/test_aggregation.py proves it).

**Convention for workers (read this).** ``agg_loss`` returns a piece's *share* of the global loss.
Call ``backward()`` on every micro-batch's share (gradients accumulate by sum) and reduce gradients
across ranks with **SUM**. FSDP and DDP *average* gradients across ranks by default (divide by the
world size); a worker that keeps their default must multiply each share by ``world_size`` before
``backward()`` (or set the divide factor to 1, e.g. FSDP2's ``set_gradient_divide_factor(1.0)``).
For logging, sum the shares of a mini-batch over micro-batches and ranks to get its loss.

Shapes: ``B`` = sequences in this piece, ``T`` = response tokens (padded width of this piece).
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError, check_bt, masked_sum

__all__ = ["LOSS_AGG_MODES", "agg_loss", "global_counts"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_counts(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, sequences with at least one valid token) of ``loss_mask`` [B, T], as 0-d tensors.

    A worker computes these over its whole local mini-batch, all-reduces them with SUM across ranks,
    and passes them to every micro-batch's ``agg_loss`` call.
    """
    tokens = loss_mask.sum()
    seqs = (loss_mask.sum(dim=-1) > 0).sum()
    return tokens, seqs


def _denominator(value, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    count = local if value is None else torch.as_tensor(value, device=like.device)
    return count.to(like.dtype).clamp(min=1)  # an empty piece contributes 0, never NaN


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_tokens: int | torch.Tensor | None = None,
    global_seqs: int | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] under ``loss_mask`` [B, T] into a scalar.

    Modes (``m`` = mask, ``L`` = loss, ``N`` = global_tokens, ``S`` = global_seqs, ``n_i`` = tokens of
    sequence i, ``T_max`` = max_response_len):

    - ``token-mean``: ``sum_{i,t} m L / N`` (DAPO; every token weighs the same).
    - ``seq-mean-token-sum``: ``sum_i (sum_t m L) / S``.
    - ``seq-mean-token-mean``: ``sum_i (sum_t m L / n_i) / S`` (original GRPO; GSPO, SAPO).
    - ``seq-mean-token-sum-norm``: ``sum_{i,t} m L / (S * T_max)`` (Dr.GRPO: a constant normaliser).

    ``global_tokens`` / ``global_seqs``: counts over the whole mini-batch across micro-batches and
    ranks (see ``global_counts``); None means this piece is the whole batch (local counts). Only
    sequences with at least one valid token count in ``S``. ``max_response_len`` must be the same
    constant for every piece (pass the rollout's maximum response length); None uses this piece's
    padded width ``T``, which is only right when the piece is the whole batch.
    Returns a 0-d tensor; see the module docstring for how workers must reduce it.
    """
    check_bt("loss_mask", loss_mask, loss_mat)
    mask = loss_mask.to(loss_mat.dtype)
    local_tokens, local_seqs = global_counts(mask)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, mask) / _denominator(global_tokens, local_tokens, loss_mat)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # [B]
    seqs = _denominator(global_seqs, local_seqs, loss_mat)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(dim=-1).clamp(min=1)).sum() / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = loss_mat.shape[-1] if max_response_len is None else max_response_len
        if norm <= 0:
            raise AlgoError(f"max_response_len must be > 0, got {norm}")
        return seq_sums.sum() / (seqs * norm)
    raise AlgoError(
        f"unknown loss_agg_mode '{loss_agg_mode}'. Valid: {', '.join(LOSS_AGG_MODES)} "
        "(recipe keys actor.loss_agg_mode / critic.loss_agg_mode)."
    )
