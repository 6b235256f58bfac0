"""Critic loss: clipped value regression (PPO), aggregated like the policy loss.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens.
"""

from __future__ import annotations

import torch

from rlkit.algos._util import check_bt, masked_mean
from rlkit.algos.aggregation import agg_loss

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: int | torch.Tensor | None = None,
    global_seqs: int | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2))`` (veRL / TRL).

    ``vpreds`` [B, T] new predictions (with grad), ``values`` [B, T] the critic's values at rollout
    time, ``returns`` [B, T], ``cliprange_value`` = ``critic.cliprange_value``. The global counts are
    passed to ``agg_loss`` (same convention as the actor). Metrics (un-prefixed; the worker adds
    ``critic/``): vf_clipfrac (share of tokens where the clipped error is larger), vpred_mean.
    """
    check_bt("values", values, vpreds)
    check_bt("returns", returns, vpreds)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpred_clipped - returns).square()
    per_token = torch.maximum(vf_losses1, vf_losses2)
    loss = 0.5 * agg_loss(
        per_token,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        max_response_len=max_response_len,
    )
    metrics = {
        "vf_clipfrac": float(masked_mean((vf_losses2 > vf_losses1).to(vpreds.dtype), response_mask)),
        "vpred_mean": float(masked_mean(vpreds.detach(), response_mask)),
    }
    return loss, metrics
