"""KL estimators and controllers: as a reward penalty (``algorithm.use_kl_in_reward``) or a loss
term (``actor.use_kl_loss``).

Estimators of KL(pi || pi_ref) per token from samples of pi (Schulman, "Approximating KL
divergence", 2020), with ``d = log_prob - ref_log_prob``:

- ``k1``: ``d`` (unbiased value, high variance, can be negative). Alias ``kl``.
- ``k2``: ``d^2 / 2`` (its gradient is the unbiased KL gradient). Alias ``mse``.
- ``k3`` / ``low_var_kl``: ``exp(-d) + d - 1`` (unbiased, low variance, >= 0), with ``-d`` clamped to
  [-20, 20] and the result clamped to [-10, 10] as veRL does.
- ``abs``: ``|d|``.
- ``k1+`` / ``k3+``: straight-through: the *value* of k1 / k3 with the *gradient* of k2
  (Tang & Munos 2025, arXiv:2505.17508, as veRL's ``+`` suffix).

Shapes: ``B`` = prompts x group size, ``T`` = response tokens.
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError, check_bt, masked_mean

__all__ = [
    "KL_KINDS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty",
]

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "kl", "mse")


def _forward(d: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        neg = torch.clamp(-d, min=-20.0, max=20.0)  # log(pi_ref / pi)
        return torch.clamp(torch.exp(neg) - neg - 1, min=-10.0, max=10.0)
    raise AlgoError(
        f"unknown KL estimator '{kind}'. Valid: {', '.join(KL_KINDS)} "
        "(recipe keys algorithm.kl_penalty / actor.kl_loss_type)."
    )


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] of ``kind`` (see the module docstring)."""
    check_bt("ref_log_prob", ref_log_prob, log_prob)
    d = log_prob - ref_log_prob
    if not kind.endswith("+"):
        return _forward(d, kind)
    if kind not in ("k1+", "k3+"):
        raise AlgoError(f"straight-through KL is defined for 'k1+' and 'k3+', got '{kind}'.")
    value = _forward(d, kind[:-1]).detach()
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_ctrl.type: fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv:1909.08593), veRL's rule:
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``coef *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if horizon <= 0 or target_kl <= 0:
            raise AlgoError(
                f"adaptive KL control needs algorithm.kl_ctrl.horizon > 0 and target_kl > 0, "
                f"got horizon={horizon}, target_kl={target_kl}."
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` ("fixed" or "adaptive")."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise AlgoError("algorithm.kl_ctrl.type 'adaptive' needs kl_ctrl.target_kl and kl_ctrl.horizon.")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise AlgoError(f"unknown algorithm.kl_ctrl.type '{type}'. Valid: fixed, adaptive.")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (veRL's ``apply_kl_penalty``): ``rewards = scores - beta * kl * mask``.

    ``beta`` is the controller's value *before* this call; the controller is then updated with the
    batch KL (mean over sequences of each sequence's token-mean KL) and ``n_steps = B``.
    Returns (token_level_rewards [B, T], metrics with veRL's full names
    ``actor/reward_kl_penalty`` and ``actor/reward_kl_penalty_coeff``).
    """
    check_bt("token_level_scores", token_level_scores, old_log_prob)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask.to(old_log_prob.dtype)  # [B, T]
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
