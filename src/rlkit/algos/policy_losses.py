"""Policy losses behind ``actor.policy_loss``; all share the registry signature.

``fn(log_prob, old_log_prob, advantages, response_mask, **params) -> (per_token_loss [B, T], metrics)``.
``params`` are the ``actor.*`` recipe keys the loss's spec names. The loss is per token; the worker
aggregates it with ``rlkit.algos.agg_loss`` (so the global token count can be used). Metrics are
python floats under un-prefixed veRL names (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``); the
worker adds the ``actor/`` prefix. Metrics are means over this piece's valid tokens.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens; every tensor argument is [B, T].
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError, check_bt, masked_mean

__all__ = ["ppo_clip", "gspo", "cispo", "gpg", "sapo"]

Tensor = torch.Tensor

def _log_ratio(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    check_bt("old_log_prob", old_log_prob, log_prob)
    check_bt("advantages", advantages, log_prob)
    check_bt("response_mask", response_mask, log_prob)
    return (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)  # veRL's stability clamp


def _ppo_kl(log_ratio: Tensor, response_mask: Tensor) -> float:
    """k1 estimate of KL(old || new) over valid tokens."""
    return float(masked_mean(-log_ratio.detach(), response_mask))


def ppo_clip(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
             clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
             clip_ratio_c: float = 3.0) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric range (DAPO's clip-higher) and
    dual clip (Ye et al. 2020) for negative advantages.

    ``r = exp(log_prob - old_log_prob)``; ``L1 = -A r``; ``L2 = -A clip(r, 1 - low, 1 + high)``;
    ``L = max(L1, L2)``, and where ``A < 0``: ``L = min(L, -A c)``.
    Metrics: pg_clipfrac (share of tokens where L2 > L1), pg_clipfrac_lower (share where the dual
    clip bound binds, A < 0), ppo_kl.
    """
    if clip_ratio_c <= 1.0:
        raise AlgoError(f"actor.clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}.")
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_losses2 = torch.minimum(pg_losses3, clip_losses1)
    negative = advantages < 0
    per_token = torch.where(negative, clip_losses2, clip_losses1)
    metrics = {
        "pg_clipfrac": float(masked_mean((pg_losses2 > pg_losses1).to(log_prob.dtype), response_mask)),
        "pg_clipfrac_lower": float(
            masked_mean(((clip_losses1 > pg_losses3) & negative).to(log_prob.dtype), response_mask)
        ),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def gspo(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
         clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), the GSPO-token form used by veRL.

    Sequence ratio ``s_i = exp(mean_t (log_prob - old_log_prob))`` (geometric mean over valid tokens);
    per token ``s_it = sg[s_i] * pi / sg[pi]`` (value s_i, gradient through each token's log_prob),
    clamped at exp(10); ``L = max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``. The paper (and veRL)
    aggregates with ``seq-mean-token-mean`` and uses tiny ranges (3e-4 / 4e-4): set
    ``actor.loss_agg_mode`` and the clip ratios accordingly.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    mask = response_mask.to(log_prob.dtype)
    lengths = mask.sum(dim=-1).clamp(min=1)  # [B]
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / lengths  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, T]
    seq_ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(pg_losses1, pg_losses2)
    metrics = {
        "pg_clipfrac": float(masked_mean((pg_losses2 > pg_losses1).to(log_prob.dtype), response_mask)),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def cispo(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
          clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    ``L = -sg[clip(r, 1 - low, 1 + high)] * A * log_prob``: every token keeps a gradient
    ``-w A grad log_prob``. The paper leaves the lower bound open (a large ``clip_ratio_low``, e.g. 1.0)
    and tunes only the upper one. Metrics: pg_clipfrac (share of tokens whose weight was clipped), ppo_kl.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    per_token = -weight * advantages * log_prob
    metrics = {
        "pg_clipfrac": float(masked_mean((ratio.detach() != weight).to(log_prob.dtype), response_mask)),
        "ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def gpg(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
        response_mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """GPG (arXiv:2504.02546): plain policy gradient ``L = -A * log_prob`` (no ratio, no clip)."""
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    return -advantages * log_prob, {"ppo_kl": _ppo_kl(log_ratio, response_mask)}


def sapo(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
         tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft, temperature-controlled gate instead of a clip.

    ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``;
    ``L = -f(r) A``. At ``r = 1`` the gradient equals plain policy gradient (``f'(1) = 1``) and it decays
    smoothly as ``r`` leaves 1. The paper (and veRL) aggregates with ``seq-mean-token-mean``.
    Metrics: ppo_kl, sapo_gate_mean (mean of f'(r) = 4 sigma (1 - sigma), 1 when on-policy).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise AlgoError(f"actor.tau_pos and actor.tau_neg must be > 0, got {tau_pos} and {tau_neg}.")
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate_prob = torch.sigmoid(taus * (ratio - 1.0))
    per_token = -(gate_prob * (4.0 / taus)) * advantages
    slope = (4.0 * gate_prob * (1 - gate_prob)).detach()
    metrics = {"ppo_kl": _ppo_kl(log_ratio, response_mask), "sapo_gate_mean": float(masked_mean(slope, response_mask))}
    return per_token, metrics
