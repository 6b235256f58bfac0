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
