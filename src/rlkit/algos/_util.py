"""Masked reductions and group bookkeeping shared by the algorithms (torch only).

Shapes: ``B`` = prompts x group size (samples), ``T`` = response tokens, ``G`` = distinct groups.
"""

from __future__ import annotations

import torch

from rlkit.errors import RlkitError

__all__ = [
    "AlgoError",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "group_ids",
    "group_sizes",
    "check_bt",
    "clamped_log_ratio",
    "k1_kl",
]


class AlgoError(RlkitError, ValueError):
    """An algorithm was called with inputs it cannot use (wrong shape, unknown mode, missing tensor)."""


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1. Masked positions are zeroed first, so NaN/inf there never
    leak."""
    mask = mask.to(values.dtype)
    picked = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the masked-in entries; 0 where the mask is empty (veRL adds 1e-8 instead: same value)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance over every masked-in entry, as veRL's ``masked_var``."""
    count = mask.to(values.dtype).sum()
    if count < 2:
        raise AlgoError(
            f"whitening needs at least 2 valid tokens in the batch, got {int(count)}; "
            "check response_mask (is every response empty?)"
        )
    centred = values - masked_mean(values, mask)
    return masked_mean(centred.square(), mask) * count / (count - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over all masked-in entries of the batch (veRL's masked_whiten)."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def group_ids(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids ``index`` [B] to dense ids 0..G-1 [B]; returns (dense ids, G)."""
    if index.dim() != 1:
        raise AlgoError(f"index must be a 1-D tensor of group ids [B], got shape {tuple(index.shape)}")
    uniq, dense = torch.unique(index, return_inverse=True)
    return dense, int(uniq.numel())


def group_sizes(dense: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Number of samples in each group [G]."""
    return torch.zeros(num_groups, dtype=dtype, device=dense.device).index_add_(
        0, dense, torch.ones_like(dense, dtype=dtype)
    )


def check_bt(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    """Raise unless ``tensor`` has the [B, T] shape of ``like``."""
    if tensor.shape != like.shape:
        raise AlgoError(f"{name} must have shape {tuple(like.shape)} ([B, T]), got {tuple(tensor.shape)}")


def clamped_log_ratio(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``log_prob - old_log_prob`` [B, T] clamped to [-20, 20] (veRL's stability clamp), after checking
    that every argument has ``log_prob`` 's shape; the ratio every PPO-style loss starts from."""
    check_bt("old_log_prob", old_log_prob, log_prob)
    check_bt("advantages", advantages, log_prob)
    check_bt("response_mask", response_mask, log_prob)
    return (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)


def k1_kl(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> float:
    """k1 estimate of KL(old || new) over valid tokens."""
    return float(masked_mean(-log_ratio.detach(), response_mask))
