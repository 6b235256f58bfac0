"""The estimators behind ``algorithm.estimator``, all with the one registry signature.

``fn(inputs: EstimatorInputs, **params) -> (advantages [B, T], returns [B, T])``. The advantage phase
(``rlkit.step.advantage``) fills ``inputs`` with exactly what the estimator's spec declares it needs
(``values`` with ``needs_critic``, ``reward_baselines`` with ``needs_greedy_baseline``,
``old_log_prob``/``sum_pi_squared``/ ``rollout_is_weights`` with ``needs_sum_pi_squared``); ``params`` are the
estimator's validated parameters (its spec's params model: ``gamma``, ``lam``, ``norm_adv_by_std``,
``epsilon``, ...). Each function below maps the inputs onto the pure function of ``rlkit.algos.advantages`` /
``token_baseline`` that computes it, and takes exactly the keywords it uses, so a wrong key fails loudly
instead of being ignored. The specs are declared in ``rlkit.builtin.algorithms``.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens; ``group_id`` [B] LongTensor of group ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkit.algos import advantages as adv
from rlkit.algos import token_baseline as otb
from rlkit.algos._util import AlgoError

__all__ = [
    "EstimatorInputs",
    "ppo",
    "grpo",
    "rloo",
    "opo",
    "gpg",
    "grpo_passk",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]

Tensor = torch.Tensor


@dataclass(frozen=True)
class EstimatorInputs:
    """Everything an estimator may read; the fields its spec does not declare are None."""

    token_level_rewards: Tensor  # [B, T] scores (minus the KL penalty with algorithm.use_kl_in_reward)
    response_mask: Tensor  # [B, T] float, 1 on response tokens
    group_id: Tensor  # [B] long: the group (prompt) of each sample
    values: Tensor | None = None  # [B, T] the critic's (needs_critic)
    reward_baselines: Tensor | None = None  # [B] the greedy response's score (needs_greedy_baseline)
    old_log_prob: Tensor | None = None  # [B, T] (needs_sum_pi_squared)
    sum_pi_squared: Tensor | None = None  # [B, T] sum over the vocabulary of pi^2 (needs_sum_pi_squared)
    rollout_is_weights: Tensor | None = None  # [B, T] a weighting rollout correction's, else None

    def need(self, estimator: str, *names: str, why: str) -> tuple[Tensor, ...]:
        """The named inputs, or an ``AlgoError`` naming the estimator, the missing input and where it comes
        from."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise AlgoError(
                f"estimator {estimator!r} needs {', '.join(missing)} ({why}); its spec must declare it "
                "so the advantage phase passes it."
            )
        return tuple(getattr(self, name) for name in names)


def ppo(x: EstimatorInputs, *, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE with the critic's ``values`` [B, T] (needs_critic)."""
    (values,) = x.need("ppo", "values", why="the critic's values: add a critic role to the recipe")
    return adv.compute_gae(x.token_level_rewards, values, x.response_mask, gamma, lam)


def grpo(x: EstimatorInputs, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GRPO group-normalised outcome advantage (also DAPO's, and Dr.GRPO's with norm_adv_by_std=False)."""
    return adv.compute_grpo_advantage(
        x.token_level_rewards, x.response_mask, x.group_id, norm_adv_by_std, epsilon
    )


def grpo_passk(
    x: EstimatorInputs, *, norm_adv_by_std: bool = True, epsilon: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Pass@k: only each group's best sample gets ``max - second max``."""
    return adv.compute_grpo_passk_advantage(
        x.token_level_rewards, x.response_mask, x.group_id, norm_adv_by_std, epsilon
    )


def rloo(x: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline."""
    return adv.compute_rloo_advantage(x.token_level_rewards, x.response_mask, x.group_id)


def opo(x: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Length-weighted group baseline."""
    return adv.compute_opo_advantage(x.token_level_rewards, x.response_mask, x.group_id)


def gpg(x: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Group mean baseline scaled by B / #non-zero scores."""
    return adv.compute_gpg_advantage(x.token_level_rewards, x.response_mask, x.group_id)


def reinforce_plus_plus(x: EstimatorInputs, *, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """Discounted returns whitened over the batch (no groups)."""
    return adv.compute_reinforce_plus_plus_advantage(x.token_level_rewards, x.response_mask, gamma)


def reinforce_plus_plus_baseline(x: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Group-mean baseline, then batch whitening."""
    return adv.compute_reinforce_plus_plus_baseline_advantage(
        x.token_level_rewards, x.response_mask, x.group_id
    )


def remax(x: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Return-to-go minus the greedy rollout's score (needs_greedy_baseline)."""
    (baselines,) = x.need("remax", "reward_baselines", why="the greedy rollout's scores, [B]")
    return adv.compute_remax_advantage(x.token_level_rewards, x.response_mask, baselines)


_OTB_WHY = (
    "sum over the vocabulary of squared probabilities, "
    "rlkit.algos.token_baseline.sum_pi_squared_from_logits, from the actor's log-prob pass"
)


def optimal_token_baseline(
    x: EstimatorInputs, *, handle_zero_tail: bool = False, epsilon: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """Per-position baseline weighted by cumulative path variance (needs old_log_prob, sum_pi_squared)."""
    old, spp = x.need("optimal_token_baseline", "old_log_prob", "sum_pi_squared", why=_OTB_WHY)
    return otb.compute_optimal_token_baseline_advantage(
        x.token_level_rewards,
        x.response_mask,
        x.group_id,
        old,
        spp,
        x.rollout_is_weights,
        handle_zero_tail,
        epsilon,
    )


def tir_optimal_token_baseline(
    x: EstimatorInputs, *, handle_zero_tail: bool = True, epsilon: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """OTB aligned by valid-token index, for multi-turn (tool) responses with masked spans."""
    old, spp = x.need("tir_optimal_token_baseline", "old_log_prob", "sum_pi_squared", why=_OTB_WHY)
    return otb.compute_tir_optimal_token_baseline_advantage(
        x.token_level_rewards,
        x.response_mask,
        x.group_id,
        old,
        spp,
        x.rollout_is_weights,
        handle_zero_tail,
        epsilon,
    )
