"""Policy losses behind ``actor.policy_loss``; all share the registry signature.

``fn(log_prob, old_log_prob, advantages, response_mask, **params) -> (per_token_loss [B, T], metrics)``.
``params`` are the ``actor.*`` recipe keys the loss's spec names. The loss is per token; the worker
aggregates it with ``rlkit.algos.agg_loss`` (so the global token count can be used). Metrics are
python floats under un-prefixed veRL names (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``); the
worker adds the ``actor/`` prefix. Metrics are means over this piece's valid tokens.

Clip-Cov and KL-Cov, with their mini-batch selections, are in ``rlkit.algos.cov_losses``.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens; every tensor argument is [B, T].
"""

from __future__ import annotations

import math

import torch

from rlkit.algos._util import AlgoError, clamped_log_ratio, k1_kl, masked_mean

__all__ = [
    "ppo_clip",
    "gspo",
    "cispo",
    "gpg",
    "sapo",
    "geo_mean",
    "luspo",
    "vespo",
]

Tensor = torch.Tensor


def ppo_clip(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric range (DAPO's clip-higher) and
    dual clip (Ye et al. 2020) for negative advantages.

    ``r = exp(log_prob - old_log_prob)``; ``L1 = -A r``; ``L2 = -A clip(r, 1 - low, 1 + high)``;
    ``L = max(L1, L2)``, and where ``A < 0``: ``L = min(L, -A c)``.
    Metrics: pg_clipfrac (share of tokens where L2 > L1), pg_clipfrac_lower (share where the dual
    clip bound binds, A < 0), ppo_kl.
    """
    if clip_ratio_c <= 1.0:
        raise AlgoError(f"actor.clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}.")
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
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
        "ppo_kl": k1_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def _seq_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO-token: the clipped geometric-mean sequence ratio, with a per-token gradient (gspo and luspo)."""
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
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
        "ppo_kl": k1_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def gspo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), the GSPO-token form used by veRL.

    Sequence ratio ``s_i = exp(mean_t (log_prob - old_log_prob))`` (geometric mean over valid tokens);
    per token ``s_it = sg[s_i] * pi / sg[pi]`` (value s_i, gradient through each token's log_prob),
    clamped at exp(10); ``L = max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``. The paper (and veRL)
    aggregates with ``seq-mean-token-mean`` and uses tiny ranges (3e-4 / 4e-4): set
    ``actor.loss_agg_mode`` and the clip ratios accordingly.
    """
    return _seq_clip_loss(log_prob, old_log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high)


def cispo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    ``L = -sg[clip(r, 1 - low, 1 + high)] * A * log_prob``: every token keeps a gradient
    ``-w A grad log_prob``. The paper leaves the lower bound open (a large ``clip_ratio_low``, e.g. 1.0)
    and tunes only the upper one. Metrics: pg_clipfrac (share of tokens whose weight was clipped), ppo_kl.
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    per_token = -weight * advantages * log_prob
    metrics = {
        "pg_clipfrac": float(masked_mean((ratio.detach() != weight).to(log_prob.dtype), response_mask)),
        "ppo_kl": k1_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def gpg(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """GPG (arXiv:2504.02546): plain policy gradient ``L = -A * log_prob`` (no ratio, no clip)."""
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    return -advantages * log_prob, {"ppo_kl": k1_kl(log_ratio, response_mask)}


def sapo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft, temperature-controlled gate instead of a clip.

    ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``;
    ``L = -f(r) A``. At ``r = 1`` the gradient equals plain policy gradient (``f'(1) = 1``) and it decays
    smoothly as ``r`` leaves 1. The paper (and veRL) aggregates with ``seq-mean-token-mean``.
    Metrics: ppo_kl, sapo_gate_mean (mean of f'(r) = 4 sigma (1 - sigma), 1 when on-policy).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise AlgoError(f"actor.tau_pos and actor.tau_neg must be > 0, got {tau_pos} and {tau_neg}.")
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    taus = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate_prob = torch.sigmoid(taus * (ratio - 1.0))
    per_token = -(gate_prob * (4.0 / taus)) * advantages
    slope = (4.0 * gate_prob * (1 - gate_prob)).detach()
    metrics = {
        "ppo_kl": k1_kl(log_ratio, response_mask),
        "sapo_gate_mean": float(masked_mean(slope, response_mask)),
    }
    return per_token, metrics


def geo_mean(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
) -> tuple[Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673).

    Each token's log ratio is clipped in **log space** to ``[-low, high]`` pessimistically,
    ``c_t = sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -low, high))``; the sequence ratio is the
    geometric mean ``rho_i = exp(mean_t c_t)`` and the sequence loss ``L_i = -mean_t(A) rho_i``.
    Written per token (value ``L_i`` on every valid token, gradient ``-mean_t(A) rho_i grad c_t``, the
    GSPO-token trick), so ``seq-mean-token-mean`` gives exactly ``mean_i L_i`` in value and gradient
    (the paper's objective; any other mode weights sequences by length). The paper uses 0.4 / 0.4.
    Metrics: pg_clipfrac / pg_clipfrac_lower (share of tokens outside the log range with A > 0 / A < 0),
    ppo_kl.
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    sign = torch.sign(advantages)
    log_ratio_clipped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clipped)  # [B, T]
    mask = response_mask.to(log_prob.dtype)
    lengths = mask.sum(dim=-1).clamp(min=1)  # [B]
    seq_ratio = torch.exp((pessimistic * mask).sum(dim=-1) / lengths)  # [B]
    seq_adv = (advantages * mask).sum(dim=-1) / lengths  # [B]
    token_ratio = seq_ratio.detach().unsqueeze(-1) * torch.exp(pessimistic - pessimistic.detach())  # [B, T]
    per_token = -seq_adv.unsqueeze(-1) * token_ratio
    outside = (log_ratio != log_ratio_clipped).to(log_prob.dtype)
    metrics = {
        "pg_clipfrac": float(masked_mean(outside * (advantages > 0), response_mask)),
        "pg_clipfrac_lower": float(masked_mean(outside * (advantages < 0), response_mask)),
        "ppo_kl": k1_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def luspo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 2e-3,
    clip_ratio_high: float = 2.5e-3,
) -> tuple[Tensor, dict[str, float]]:
    """LUSPO (Length-Unbiased Sequence Policy Optimization, arXiv:2602.05261), TRL's ``loss_type="luspo"``.

    GSPO's clipped sequence ratio ``L_i = max(-A s_i, -A clip(s_i, 1 - low, 1 + high))``,
    ``s_i = exp(mean_t log r)``, with each sequence's loss scaled by its length ``n_i``. Per token this is
    GSPO-token (value ``L_i`` on each of the ``n_i`` valid tokens); aggregate with
    ``seq-mean-token-sum`` to get TRL's ``mean_i(n_i L_i)`` exactly (``token-mean`` keeps the
    length-proportional weights, scaled by S/N). Defaults are the paper's (section 5.1).
    Metrics: pg_clipfrac, ppo_kl.
    """
    return _seq_clip_loss(log_prob, old_log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high)


def vespo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """VESPO (Variational Sequence-Level Soft Policy Optimization, arXiv:2602.10693), as TRL.

    Sequence weight ``w_i = prod_t r_t`` (log clamped to ``[log 1e-8, 20]``), reshaped by a Gamma kernel
    ``phi(w) = w^k exp(lambda (1 - w))`` (``phi(1) = 1``), with ``(k, lambda)`` = ``(k_pos, lambda_pos)``
    where ``A >= 0`` else ``(k_neg, lambda_neg)``; ``L = -sg[phi] A log_prob`` (REINFORCE scaled by
    phi, as CISPO). On-policy it is plain policy gradient. TRL aggregates with token-mean.
    Metrics: vespo_phi_mean (token mean of phi), ppo_kl.
    """
    if min(lambda_pos, lambda_neg) <= 0 or min(k_pos, k_neg) < 0:
        raise AlgoError(
            f"vespo needs lambda_pos, lambda_neg > 0 and k_pos, k_neg >= 0, got "
            f"{lambda_pos}, {lambda_neg}, {k_pos}, {k_neg}."
        )
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    mask = response_mask.to(log_prob.dtype)
    # [B, 1]
    log_w = ((log_ratio * mask).sum(dim=-1).clamp(min=math.log(1e-8), max=20.0)).detach().unsqueeze(-1)
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(log_prob, k_pos), torch.full_like(log_prob, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_prob, lambda_pos), torch.full_like(log_prob, lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    phi = phi.detach()  # [B, T]
    per_token = -phi * advantages * log_prob
    metrics = {
        "vespo_phi_mean": float(masked_mean(phi, response_mask)),
        "ppo_kl": k1_kl(log_ratio, response_mask),
    }
    return per_token, metrics
