"""Clip-Cov and KL-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617):
PPO-style policy losses behind ``actor.policy_loss`` that stop (Clip-Cov) or KL-penalise (KL-Cov) a few
tokens of high covariance between advantage and log-prob, and their mini-batch selections (the tokens chosen
once per mini-batch, so every micro-batch of it agrees). The losses have the registry signature that
``rlkit.algos.policy_losses`` describes, metrics included.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens; every tensor argument is [B, T].
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError, check_bt, clamped_log_ratio, k1_kl, masked_mean

__all__ = [
    "clip_cov",
    "kl_cov",
    "clip_cov_selection",
    "kl_cov_selection",
    "clip_cov_mini_batch_selection",
    "kl_cov_mini_batch_selection",
]

Tensor = torch.Tensor


def _covariance(log_prob: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token centred product ``(A - mean A)(log_prob - mean log_prob)`` [B, T], means over valid tokens.

    The statistic Clip-Cov / KL-Cov rank tokens by (Cui et al. 2025, eq. 7); no gradient.
    """
    logp = log_prob.detach()
    adv = advantages.detach()
    return (adv - masked_mean(adv, response_mask)) * (logp - masked_mean(logp, response_mask))


def clip_cov_selection(
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    exclude: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Clip-Cov's tokens [B, T] (bool): ``max(1, floor(clip_cov_ratio * N))`` drawn at random among the
    valid tokens (not in ``exclude``) whose covariance lies strictly inside ``(clip_cov_lb, clip_cov_ub)``.

    ``N`` and the covariance's means are over every valid token given: call it on the whole mini-batch
    (then slice the result with the rows) for a selection that does not depend on the micro-batch split.
    """
    if clip_cov_ratio <= 0 or clip_cov_lb >= clip_cov_ub:
        raise AlgoError(
            f"clip_cov needs clip_cov_ratio > 0 and clip_cov_lb < clip_cov_ub, got {clip_cov_ratio}, "
            f"{clip_cov_lb}, {clip_cov_ub}."
        )
    check_bt("advantages", advantages, log_prob)
    check_bt("response_mask", response_mask, log_prob)
    valid = response_mask > 0
    cov = _covariance(log_prob, advantages, response_mask)
    candidates = valid & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    if exclude is not None:
        candidates = candidates & ~exclude
    flat = torch.nonzero(candidates.reshape(-1)).squeeze(-1)  # [K] flat indices of the candidates
    clip_num = max(int(clip_cov_ratio * int(valid.sum())), 1)
    order = torch.randperm(flat.numel(), generator=generator).to(flat.device)
    selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=log_prob.device)
    selected[flat[order[:clip_num]]] = True
    return selected.reshape(candidates.shape)


def kl_cov_selection(
    log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *, kl_cov_ratio: float = 0.0002
) -> Tensor:
    """KL-Cov's tokens [B, T] (bool): the ``max(1, floor(kl_cov_ratio * N))`` valid tokens with the largest
    covariance (ties: the earlier token in row-major order). Whole mini-batch: see ``clip_cov_selection``.
    """
    if kl_cov_ratio <= 0:
        raise AlgoError(f"kl_cov needs kl_cov_ratio > 0, got {kl_cov_ratio}.")
    check_bt("advantages", advantages, log_prob)
    check_bt("response_mask", response_mask, log_prob)
    valid = (response_mask > 0).reshape(-1)
    flat_valid = torch.nonzero(valid).squeeze(-1)  # [N]
    cov = _covariance(log_prob, advantages, response_mask).reshape(-1)[flat_valid]
    k = max(1, int(flat_valid.numel() * kl_cov_ratio)) if flat_valid.numel() else 0
    top = torch.sort(cov, descending=True, stable=True).indices[:k]
    selected = torch.zeros_like(valid)
    selected[flat_valid[top]] = True
    return selected.reshape(log_prob.shape)


def clip_cov_mini_batch_selection(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    generator: torch.Generator | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> Tensor:
    """Clip-Cov's selection over a whole mini-batch [B, T] (bool), in the registry's selection signature:
    the draw excludes the tokens whose ratio clip binds (as veRL), so ``clip_cov(..., selected=...)`` cuts
    exactly ``max(1, floor(clip_cov_ratio * N))`` tokens when enough candidates exist."""
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask).detach()
    ratio = torch.exp(log_ratio)
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high) > -advantages * ratio
    return clip_cov_selection(
        log_prob,
        advantages,
        response_mask,
        clip_cov_ratio=clip_cov_ratio,
        clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub,
        exclude=clipped,
        generator=generator,
    )


def kl_cov_mini_batch_selection(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    generator: torch.Generator | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
) -> Tensor:
    """KL-Cov's selection over a whole mini-batch [B, T] (bool), in the registry's selection signature
    (``generator`` and ``ppo_kl_coef`` are unused: the top-k is deterministic)."""
    check_bt("old_log_prob", old_log_prob, log_prob)
    return kl_cov_selection(log_prob, advantages, response_mask, kl_cov_ratio=kl_cov_ratio)


def clip_cov(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    selected: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617).

    PPO's clipped surrogate ``L = max(-A r, -A clip(r, 1 - low, 1 + high))``, except that
    ``max(1, floor(clip_cov_ratio * N))`` tokens, drawn at random among the valid tokens the ratio clip
    left alone whose covariance ``(A - mean A)(log_prob - mean log_prob)`` lies strictly inside
    ``(clip_cov_lb, clip_cov_ub)``, get loss 0 (their gradient is cut): high-covariance tokens drive
    the entropy collapse. ``selected`` None: drawn from this call's tokens (``N``, means; ``generator``
    draws, None = torch's global one), as veRL does per micro-batch; the loss then depends on the
    micro-batch split. ``selected`` given (``clip_cov_selection`` over the whole mini-batch, sliced):
    those tokens are cut where the ratio clip does not bind, and the loss is split-invariant.
    Metrics (veRL's names mean veRL's quantities): pg_clipfrac (share of valid tokens cut by the
    covariance rule, veRL's ``actor/pg_clipfrac`` for clip_cov), ppo_kl (k1, ``mean(-log r)``), and
    ratio_clipfrac (rlkit's own: share where the PPO ratio clip binds, what pg_clipfrac means for ppo_clip).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    valid = response_mask > 0
    clipped = (pg_losses2 > pg_losses1) & valid
    if selected is None:
        cut = clip_cov_selection(
            log_prob,
            advantages,
            response_mask,
            clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb,
            clip_cov_ub=clip_cov_ub,
            exclude=clipped,
            generator=generator,
        )
    else:
        check_bt("selected", selected, log_prob)
        cut = selected.bool() & valid & ~clipped
    per_token = torch.maximum(pg_losses1, pg_losses2) * (~cut).to(log_prob.dtype)
    dtype = log_prob.dtype
    metrics = {
        "pg_clipfrac": float(masked_mean(cut.to(dtype), response_mask)),
        "ratio_clipfrac": float(masked_mean(clipped.to(dtype), response_mask)),
        "ppo_kl": k1_kl(log_ratio, response_mask),
    }
    return per_token, metrics


def kl_cov(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    selected: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): no clip; a KL penalty on the top-covariance tokens.

    ``L = -A r`` for every token, plus ``ppo_kl_coef * |log r|`` on the ``max(1, floor(kl_cov_ratio * N))``
    valid tokens with the largest covariance ``(A - mean A)(log_prob - mean log_prob)`` (ties: the
    earlier token in row-major order). ``selected`` None: ranked within this call, as veRL (depends on
    the micro-batch split); given (``kl_cov_selection`` over the whole mini-batch, sliced): split-invariant.
    Metrics (veRL's names mean veRL's quantities): ppo_kl (``mean |log r|`` over valid tokens, veRL's
    ``actor/ppo_kl`` for kl_cov, not the k1 of the other losses), ppo_kl_k1 (rlkit's own: ``mean(-log r)``,
    what ppo_kl means for every other loss), kl_cov_frac (share of valid tokens penalised).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_kl = pg_losses + ppo_kl_coef * log_ratio.abs()
    if selected is None:
        selected = kl_cov_selection(log_prob, advantages, response_mask, kl_cov_ratio=kl_cov_ratio)
    else:
        check_bt("selected", selected, log_prob)
    selected = selected.bool() & (response_mask > 0)
    per_token = torch.where(selected, pg_losses_kl, pg_losses)
    dtype = log_prob.dtype
    metrics = {
        "ppo_kl": float(masked_mean(log_ratio.detach().abs(), response_mask)),
        "ppo_kl_k1": k1_kl(log_ratio, response_mask),
        "kl_cov_frac": float(masked_mean(selected.to(dtype), response_mask)),
    }
    return per_token, metrics
