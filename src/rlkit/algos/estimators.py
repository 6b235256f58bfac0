"""The estimators behind ``algorithm.estimator``, all with the one registry signature.

``fn(token_level_rewards, response_mask, index, *, values, reward_baselines, **params)
-> (advantages [B, T], returns [B, T])``; ``params`` are the ``algorithm.*`` recipe keys an
estimator's spec names (``gamma``, ``lam``, ``norm_adv_by_std``, ``epsilon``). Each wrapper takes
exactly the keywords it uses, so a wrong key fails loudly instead of being ignored.
The specs (and their ``params``) are declared in ``rlkit.builtin.algorithms``.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens; ``index`` [B] LongTensor of group ids.
"""

from __future__ import annotations

import torch

from rlkit.algos import advantages as adv
from rlkit.algos import token_baseline as otb
from rlkit.algos._util import AlgoError

__all__ = [
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

def ppo(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE with the critic's ``values`` [B, T] (needs_critic)."""
    if values is None:
        raise AlgoError("estimator 'ppo' needs the critic's values; add a critic role to the recipe.")
    return adv.compute_gae(token_level_rewards, values, response_mask, gamma, lam)


def grpo(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None = None,
         reward_baselines: Tensor | None = None, norm_adv_by_std: bool = True,
         epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GRPO group-normalised outcome advantage (also DAPO's, and Dr.GRPO's with norm_adv_by_std=False)."""
    return adv.compute_grpo_advantage(token_level_rewards, response_mask, index, norm_adv_by_std, epsilon)


def grpo_passk(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None = None,
               reward_baselines: Tensor | None = None, norm_adv_by_std: bool = True,
               epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Pass@k: only each group's best sample gets ``max - second max``."""
    return adv.compute_grpo_passk_advantage(token_level_rewards, response_mask, index, norm_adv_by_std, epsilon)


def rloo(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None = None,
         reward_baselines: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline."""
    return adv.compute_rloo_advantage(token_level_rewards, response_mask, index)


def opo(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None = None,
        reward_baselines: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Length-weighted group baseline."""
    return adv.compute_opo_advantage(token_level_rewards, response_mask, index)


def gpg(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None = None,
        reward_baselines: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Group mean baseline scaled by B / #non-zero scores."""
    return adv.compute_gpg_advantage(token_level_rewards, response_mask, index)


def reinforce_plus_plus(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *,
                        values: Tensor | None = None, reward_baselines: Tensor | None = None,
                        gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """Discounted returns whitened over the batch (``index`` unused)."""
    return adv.compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma)


def reinforce_plus_plus_baseline(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *,
                                 values: Tensor | None = None,
                                 reward_baselines: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Group-mean baseline, then batch whitening."""
    return adv.compute_reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, index)


def remax(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *, values: Tensor | None = None,
          reward_baselines: Tensor | None) -> tuple[Tensor, Tensor]:
    """Return-to-go minus the greedy rollout's score (needs_greedy_baseline)."""
    if reward_baselines is None:
        raise AlgoError("estimator 'remax' needs reward_baselines (the greedy rollout's scores, [B]).")
    return adv.compute_remax_advantage(token_level_rewards, response_mask, reward_baselines)


def _otb_tensors(name: str, old_log_prob: Tensor | None, sum_pi_squared: Tensor | None) -> None:
    if old_log_prob is None or sum_pi_squared is None:
        raise AlgoError(
            f"estimator '{name}' needs old_log_prob and sum_pi_squared [B, T] (sum over the vocabulary of "
            "squared probabilities, rlkit.algos.token_baseline.sum_pi_squared_from_logits) from the actor's "
            "log-prob pass; the trainer must compute and pass both."
        )


def optimal_token_baseline(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *,
                           values: Tensor | None = None, reward_baselines: Tensor | None = None,
                           old_log_prob: Tensor | None = None, sum_pi_squared: Tensor | None = None,
                           rollout_is_weights: Tensor | None = None, handle_zero_tail: bool = False,
                           epsilon: float = 1e-8) -> tuple[Tensor, Tensor]:
    """Per-position baseline weighted by cumulative path variance (needs old_log_prob, sum_pi_squared)."""
    _otb_tensors("optimal_token_baseline", old_log_prob, sum_pi_squared)
    return otb.compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_prob,
                                                        sum_pi_squared, rollout_is_weights, handle_zero_tail,
                                                        epsilon)


def tir_optimal_token_baseline(token_level_rewards: Tensor, response_mask: Tensor, index: Tensor, *,
                               values: Tensor | None = None, reward_baselines: Tensor | None = None,
                               old_log_prob: Tensor | None = None, sum_pi_squared: Tensor | None = None,
                               rollout_is_weights: Tensor | None = None, handle_zero_tail: bool = True,
                               epsilon: float = 1e-8) -> tuple[Tensor, Tensor]:
    """OTB aligned by valid-token index, for multi-turn (tool) responses with masked spans."""
    _otb_tensors("tir_optimal_token_baseline", old_log_prob, sum_pi_squared)
    return otb.compute_tir_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_prob,
                                                            sum_pi_squared, rollout_is_weights, handle_zero_tail,
                                                            epsilon)
