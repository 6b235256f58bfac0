"""Token entropy and log-probabilities from logits, one chunk of rows at a time.

A [N, V] softmax over a 150k vocabulary is large; these functions never hold more than one
``chunk_size x V`` block of float32 softmax/upcast at a time. When gradients are needed each chunk is
recomputed in backward (activation checkpointing), so the saved state is the logits themselves.

Shapes: ``...`` = any leading dims (e.g. [B, T]), ``V`` = vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rlkit.algos._util import AlgoError

__all__ = ["entropy_from_logits", "log_probs_from_logits"]


def _entropy_rows(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.float()  # [n, V]
    lse = torch.logsumexp(rows, dim=-1)  # [n]
    probs = torch.softmax(rows, dim=-1)
    return lse - (probs * rows).sum(dim=-1)  # H = logsumexp(z) - sum_v p_v z_v


def _log_prob_rows(rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    rows = rows.float()
    picked = rows.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [n]
    return picked - torch.logsumexp(rows, dim=-1)


def _chunked(fn, logits: torch.Tensor, *extra: torch.Tensor, chunk_size: int) -> torch.Tensor:
    if chunk_size <= 0:
        raise AlgoError(f"chunk_size must be > 0, got {chunk_size}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [N, V]
    flat_extra = [e.reshape(-1) for e in extra]
    grad = torch.is_grad_enabled() and logits.requires_grad
    outs = []
    for start in range(0, flat.shape[0], chunk_size):
        args = (flat[start : start + chunk_size], *(e[start : start + chunk_size] for e in flat_extra))
        outs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    out = torch.cat(outs) if outs else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Categorical entropy of ``softmax(logits)``: [..., V] -> [...] (float32), differentiable."""
    return _chunked(_entropy_rows, logits, chunk_size=chunk_size)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """``log softmax(logits)[labels]``: logits [..., V], labels [...] (long) -> [...] (float32)."""
    if labels.shape != logits.shape[:-1]:
        raise AlgoError(f"labels must have shape {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    return _chunked(_log_prob_rows, logits, labels, chunk_size=chunk_size)
