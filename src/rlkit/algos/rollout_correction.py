"""Rollout correction: importance weights and masks for rollouts that are not exactly on-policy.

The rollout engine samples from ``pi_rollout`` (another engine's numerics, or older weights in an
async pipeline); the trainer recomputes ``old_log_prob`` under its own ``pi_old``. Every function here
compares the two, per token ``rho_t = pi_old / pi_rollout = exp(old_log_prob - rollout_log_probs)``
(log ratio clamped to [-20, 20] before ``exp``), and returns either

- **weights** [B, T] (``token_tis``, ``seq_tis``, ``icepop``, ``decoupled``): multiply the policy
  loss's per-token loss by them before ``agg_loss`` (they carry no gradient), or
- a **mask** [B, T] of 0/1 (``token_mis``, ``seq_mis``): use it as the new ``response_mask``, so the
  dropped tokens leave the loss and its token/sequence counts (veRL's rejection sampling).

Signature: ``fn(old_log_prob, rollout_log_probs, response_mask, *, scalars) -> (tensor [B, T], metrics)``.
Padding positions are 0 in every output. Metrics are python floats under veRL's ``rollout_corr``
names without the prefix (the caller adds ``rollout_corr/``): ``rollout_is_mean/max/min`` (the raw
ratio at the function's level, before truncation), ``rollout_is_ratio_fraction_high/low`` (share
above / below the bounds: truncated or dropped), ``rollout_rs_masked_fraction`` and
``rollout_rs_seq_masked_fraction`` (share of valid tokens / non-empty sequences zeroed), and the
mismatch ``kl = mean(rollout_log_probs - old_log_prob)`` (k1 estimate of KL(pi_rollout || pi_old))
and ``k3_kl = mean(rho - log rho - 1)``. Every output row depends on its own row only, so the result
is the same whichever way the batch is split.

``decoupled_ppo_clip`` puts the pieces together the decoupled-PPO way: the behaviour policy
(``pi_rollout``) is the importance-sampling anchor, the proximal policy (``pi_old``) the clip anchor.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens; every tensor argument is [B, T].
"""

from __future__ import annotations

import math

import torch

from rlkit.algos._util import AlgoError, check_bt, masked_mean
from rlkit.algos.policy_losses import ppo_clip

__all__ = [
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "icepop",
    "decoupled",
    "decoupled_ppo_clip",
    "mismatch_metrics",
    "OUTPUT_KINDS",
    "MISMATCH_STATS",
    "mismatch_stats",
    "mismatch_from_stats",
]

Tensor = torch.Tensor
SAFETY_BOUND = 20.0  # |log ratio| clamp before exp (veRL's): exp(20) ~ 4.9e8
# what each correction returns: "weights" multiply the per-token loss, a "mask" replaces response_mask
OUTPUT_KINDS = {
    "token_tis": "weights",
    "seq_tis": "weights",
    "token_mis": "mask",
    "seq_mis": "mask",
    "icepop": "weights",
    "decoupled": "weights",
}


def _log_ratio(old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """``log(pi_old / pi_rollout)`` [B, T], detached, 0 on padding."""
    check_bt("rollout_log_probs", rollout_log_probs, old_log_prob)
    check_bt("response_mask", response_mask, old_log_prob)
    diff = (old_log_prob - rollout_log_probs).detach()
    return torch.where(response_mask > 0, diff, torch.zeros_like(diff))


def _check_bounds(name: str, lower: float, upper: float) -> None:
    if not 0 <= lower < upper:
        raise AlgoError(f"{name}: need 0 <= lower < upper, got lower={lower}, upper={upper}.")


def mismatch_metrics(
    old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """``kl`` = mean(rollout - old) and ``k3_kl`` = mean(rho - log rho - 1) over valid tokens (veRL's)."""
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    k3 = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - log_ratio - 1
    return {
        "kl": float(masked_mean(-log_ratio, response_mask)),
        "k3_kl": float(masked_mean(k3, response_mask)),
    }


# sufficient statistics of the rollout/trainer mismatch over valid tokens (sums add over micro-batches
# and ranks; "max" takes the max): p = exp(rollout_log_probs), q = exp(old_log_prob), d = |p - q|
MISMATCH_STATS = ("n", "d", "d2", "p", "q", "p2", "q2", "pq", "k1", "k3", "max")


def mismatch_stats(old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """The ``MISMATCH_STATS`` of a batch, float64 [11]: counts and sums over valid tokens, then max ``d``.

    Add the vectors of two pieces (max for the last entry) to get the whole batch's: the metrics of
    ``mismatch_from_stats`` do not depend on how the batch was split.
    """
    valid = response_mask > 0
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask).double()[valid]  # [N]
    p = torch.exp(rollout_log_probs.detach().double()[valid])
    q = torch.exp(old_log_prob.detach().double()[valid])
    d = (p - q).abs()
    k3 = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - log_ratio - 1
    sums = [
        float(valid.sum()),
        d.sum(),
        (d * d).sum(),
        p.sum(),
        q.sum(),
        (p * p).sum(),
        (q * q).sum(),
        (p * q).sum(),
        (-log_ratio).sum(),
        k3.sum(),
        d.max() if d.numel() else 0.0,
    ]
    return torch.tensor([float(x) for x in sums], dtype=torch.float64)


def mismatch_from_stats(stats: Tensor) -> dict[str, float]:
    """veRL's mismatch metrics from ``mismatch_stats`` (summed over pieces, max-reduced last entry).

    ``training/rollout_probs_diff_mean/max/std``: |pi_rollout - pi_old| per token (probabilities; std
    with n - 1); ``training/rollout_actor_probs_pearson_corr``: Pearson correlation of the two token
    probabilities; ``rollout_corr/kl`` = mean(log pi_rollout - log pi_old) (k1 estimate of
    KL(pi_rollout || pi_old)) and ``rollout_corr/k3_kl`` = mean(rho - log rho - 1), rho = pi_old / pi_rollout.
    """
    n, d, d2, p, q, p2, q2, pq, k1, k3, dmax = (float(x) for x in stats)
    if n == 0:
        return {"training/rollout_probs_diff_valid": 0.0}
    var = max(d2 - d * d / n, 0.0) / (n - 1) if n > 1 else 0.0
    cov, var_p, var_q = pq - p * q / n, p2 - p * p / n, q2 - q * q / n
    corr = cov / math.sqrt(var_p * var_q) if var_p > 0 and var_q > 0 else 1.0
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_mean": d / n,
        "training/rollout_probs_diff_max": dmax,
        "training/rollout_probs_diff_std": math.sqrt(var),
        "training/rollout_actor_probs_pearson_corr": corr,
        "rollout_corr/kl": k1 / n,
        "rollout_corr/k3_kl": k3 / n,
    }


def _seq_log_ratio(log_ratio: Tensor, response_mask: Tensor, geometric: bool = False) -> Tensor:
    """Sum (product of ratios) or mean (geometric mean) of the log ratio over valid tokens, [B]."""
    total = (log_ratio * response_mask.to(log_ratio.dtype)).sum(dim=-1)
    return total / response_mask.to(log_ratio.dtype).sum(dim=-1).clamp(min=1) if geometric else total


def _ratio_metrics(
    ratio: Tensor, response_mask: Tensor, lower: float, upper: float, seq_ratio: Tensor | None = None
) -> dict[str, float]:
    """IS-ratio statistics; ``seq_ratio`` [B] given: max/min/fractions over non-empty sequences."""
    valid = response_mask > 0
    if not bool(valid.any()):
        return {
            "rollout_is_mean": 0.0,
            "rollout_is_max": 0.0,
            "rollout_is_min": 0.0,
            "rollout_is_ratio_fraction_high": 0.0,
            "rollout_is_ratio_fraction_low": 0.0,
        }
    picked = ratio[valid] if seq_ratio is None else seq_ratio[valid.any(dim=-1)]
    return {
        "rollout_is_mean": float(masked_mean(ratio, response_mask)),
        "rollout_is_max": float(picked.max()),
        "rollout_is_min": float(picked.min()),
        "rollout_is_ratio_fraction_high": float((picked > upper).to(ratio.dtype).mean()),
        "rollout_is_ratio_fraction_low": float((picked < lower).to(ratio.dtype).mean()),
    }


def _masked_metrics(kept: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Share of valid tokens zeroed and of non-empty sequences with at least one zeroed token."""
    valid = response_mask > 0
    dropped = valid & (kept == 0)
    nonempty = valid.any(dim=-1)
    seq_frac = float(dropped.any(dim=-1)[nonempty].to(kept.dtype).mean()) if bool(nonempty.any()) else 0.0
    return {
        "rollout_rs_masked_fraction": float(masked_mean(dropped.to(kept.dtype), response_mask)),
        "rollout_rs_seq_masked_fraction": seq_frac,
    }


def token_tis(
    old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, *, threshold: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """Token-level truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): weight ``min(rho_t, C)``, ``C = threshold``.

    Returns (weights [B, T], metrics); ``rollout_is_ratio_fraction_high`` is the share truncated
    (``_low`` counts ratios below ``1 / C``, as veRL).
    """
    if threshold <= 0:
        raise AlgoError(f"token_tis: threshold (the cap C) must be > 0, got {threshold}.")
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * response_mask  # [B, T]
    weights = ratio.clamp(max=threshold)
    metrics = _ratio_metrics(ratio, response_mask, 1.0 / threshold, threshold)
    return weights, metrics | mismatch_metrics(old_log_prob, rollout_log_probs, response_mask)


def seq_tis(
    old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, *, threshold: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """Sequence-level truncated IS: ``min(prod_t rho_t, C)`` on every valid token of the sequence
    (the product's log clamped to [-20, 20]). Unbiased up to the cap, high variance on long sequences.

    Returns (weights [B, T], metrics); ratio max/min/fractions are over non-empty sequences.
    """
    if threshold <= 0:
        raise AlgoError(f"seq_tis: threshold (the cap C) must be > 0, got {threshold}.")
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    seq_ratio = torch.exp(_seq_log_ratio(log_ratio, response_mask).clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [B]
    ratio = seq_ratio.unsqueeze(-1) * response_mask  # [B, T]
    weights = ratio.clamp(max=threshold)
    metrics = _ratio_metrics(ratio, response_mask, 1.0 / threshold, threshold, seq_ratio)
    return weights, metrics | mismatch_metrics(old_log_prob, rollout_log_probs, response_mask)


def token_mis(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    lower: float = 0.5,
    upper: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level masked IS / rejection (Liu et al. 2025, "When speed kills stability"): keep a token
    only if ``lower <= rho_t <= upper``.

    Returns (mask [B, T] of 0/1 to use as the new response_mask, metrics).
    """
    _check_bounds("token_mis", lower, upper)
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * response_mask
    keep = ((ratio >= lower) & (ratio <= upper) & (response_mask > 0)).to(old_log_prob.dtype)
    metrics = _ratio_metrics(ratio, response_mask, lower, upper) | _masked_metrics(keep, response_mask)
    return keep, metrics | mismatch_metrics(old_log_prob, rollout_log_probs, response_mask)


def seq_mis(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    lower: float = 0.5,
    upper: float = 2.0,
    geometric: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Sequence-level masked IS / rejection: drop a whole sequence unless its ratio is in
    ``[lower, upper]``; the ratio is ``prod_t rho_t`` or, with ``geometric``, ``exp(mean_t log rho_t)``
    (length-normalised, veRL's Geo-RS; use tight bounds such as 0.999 / 1.001 there).

    Returns (mask [B, T] of 0/1 to use as the new response_mask, metrics).
    """
    _check_bounds("seq_mis", lower, upper)
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    seq_ratio = torch.exp(
        _seq_log_ratio(log_ratio, response_mask, geometric).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    )
    ratio = seq_ratio.unsqueeze(-1) * response_mask  # [B, T]
    seq_keep = (seq_ratio >= lower) & (seq_ratio <= upper)  # [B]
    keep = (seq_keep.unsqueeze(-1) & (response_mask > 0)).to(old_log_prob.dtype)
    metrics = _ratio_metrics(ratio, response_mask, lower, upper, seq_ratio) | _masked_metrics(
        keep, response_mask
    )
    return keep, metrics | mismatch_metrics(old_log_prob, rollout_log_probs, response_mask)


def icepop(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    lower: float = 0.5,
    upper: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """IcePop (Ling Team 2025, Ring-1T, arXiv:2510.18855): token-level double-sided masking,
    weight ``rho_t`` where ``lower <= rho_t <= upper`` and 0 elsewhere (the token's gradient is dropped,
    not truncated). The paper's bounds are 0.5 and 5.

    Returns (weights [B, T], metrics).
    """
    _check_bounds("icepop", lower, upper)
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * response_mask
    weights = torch.where((ratio >= lower) & (ratio <= upper), ratio, torch.zeros_like(ratio))
    metrics = _ratio_metrics(ratio, response_mask, lower, upper) | _masked_metrics(weights, response_mask)
    return weights, metrics | mismatch_metrics(old_log_prob, rollout_log_probs, response_mask)


def decoupled(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    cap: float | None = None,
    bypass: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO's behaviour weight (Hilton et al. 2021, arXiv:2110.00641; AReaL, Fu et al. 2025,
    arXiv:2505.24298): ``pi_prox / pi_behav = rho_t``, with ``old_log_prob`` the proximal policy and
    ``rollout_log_probs`` the behaviour policy. With ``cap``, a token whose weight exceeds it gets 0
    (AReaL's ``behav_imp_weight_cap``); None keeps every weight. Pair it with a policy loss whose ratio
    is ``pi_theta / pi_prox`` (the clip anchor) and multiply: see ``decoupled_ppo_clip``.

    ``bypass`` (veRL's bypass mode): the proximal policy is the behaviour policy, ``old_log_prob`` is not
    used, and every valid token's weight is exactly 1 (the policy loss's ratio is then pi_theta / pi_behav:
    plain PPO on the behaviour policy). The trainer knows this result, so in bypass mode it neither runs
    the old-log-prob pass nor calls this function (``rlkit.step.correction``). A cap has nothing to act on
    there.

    Returns (weights [B, T], metrics).
    """
    if cap is not None and cap <= 0:
        raise AlgoError(f"decoupled: cap must be > 0 or None, got {cap}.")
    if bypass:
        if cap is not None:
            raise AlgoError(
                f"decoupled: cap ({cap}) has no effect with bypass (every weight is 1); give one or the "
                "other."
            )
        old_log_prob = rollout_log_probs  # pi_prox := pi_behav
    log_ratio = _log_ratio(old_log_prob, rollout_log_probs, response_mask)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * response_mask
    upper = math.inf if cap is None else cap
    weights = torch.where(ratio <= upper, ratio, torch.zeros_like(ratio))
    metrics = _ratio_metrics(ratio, response_mask, 0.0, upper) | _masked_metrics(weights, response_mask)
    return weights, metrics | mismatch_metrics(old_log_prob, rollout_log_probs, response_mask)


def decoupled_ppo_clip(
    log_prob: Tensor,
    proximal_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO per-token loss: ``w_t * ppo_clip(pi_theta / pi_prox)``, ``w_t = pi_prox / pi_behav``
    (``decoupled``'s weight, no gradient). The clip keeps ``pi_theta`` near the proximal policy, the
    weight corrects for having sampled from the behaviour policy.

    Returns (per-token loss [B, T] for ``agg_loss``, ppo_clip's metrics | decoupled's metrics).
    """
    per_token, metrics = ppo_clip(
        log_prob,
        proximal_log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    weights, corr_metrics = decoupled(proximal_log_prob, behaviour_log_prob, response_mask, cap=cap)
    return per_token * weights, metrics | corr_metrics
