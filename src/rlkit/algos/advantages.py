"""Advantage estimators: pure torch, one natural signature each (see ``estimators`` for the uniform one).

Every outcome estimator reads the sequence score ``s_i = sum_t token_level_rewards[i, t]`` and groups
samples by ``index`` (the prompt uid as ints): samples of one prompt form one group. Semantics follow
veRL's ``core_algos`` (cited per function); docs/algorithms.md has the formulas and the differences.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens, ``G`` = number of groups.
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError, check_bt, group_ids, group_sizes, masked_whiten

__all__ = [
    "group_mean_std",
    "compute_gae",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_rloo_advantage",
    "compute_opo_advantage",
    "compute_gpg_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
]


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    check_bt("response_mask", response_mask, token_level_rewards)
    return token_level_rewards.sum(dim=-1)  # [B]


def group_mean_std(
    scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std and group size, each [B].

    A singleton group gets mean 0 and std 1 (veRL's rule), so its sample keeps its raw score.
    """
    dense, num_groups = group_ids(index)
    size = group_sizes(dense, num_groups, scores.dtype)  # [G]
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, dense, scores)
    mean_g = total / size  # [G]
    sq_dev = (scores - mean_g[dense]).square()  # [B]
    ss = torch.zeros_like(total).index_add_(0, dense, sq_dev)  # [G]
    std_g = (ss / (size - 1).clamp(min=1)).sqrt()  # [G], unbiased like torch.std
    single = size == 1
    mean_g = torch.where(single, torch.zeros_like(mean_g), mean_g)
    std_g = torch.where(single, torch.ones_like(std_g), std_g)
    return mean_g[dense], std_g[dense], size[dense]


@torch.no_grad()
def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016), as veRL's ``compute_gae_advantage_return``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``; ``A_t = delta_t + gamma * lam * A_{t+1}``. Masked-out
    positions are skipped: they neither supply the next value nor carry the running advantage.
    ``returns = A + V`` (before whitening); advantages are then whitened over every valid token; both
    are 0 on masked tokens.

    Shapes: all inputs [B, T]; returns (advantages [B, T], returns [B, T]).
    """
    check_bt("values", values, token_level_rewards)
    check_bt("response_mask", response_mask, token_level_rewards)
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])  # [B]
    running = torch.zeros_like(values[:, 0])  # [B]
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running = candidate * mask[:, t] + (1 - mask[:, t]) * running
        reversed_adv.append(running)
    advantages = torch.stack(reversed_adv[::-1], dim=1)  # [B, T]
    returns = (advantages + values) * mask
    return masked_whiten(advantages, response_mask) * mask, returns  # both 0 on masked tokens (rlkit.testing)


@torch.no_grad()
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): ``A_i = (s_i - mean_g) / (std_g + epsilon)``, or ``s_i - mean_g``
    without std scaling (Dr.GRPO, Liu et al. 2025). std is unbiased; singleton: mean 0, std 1.

    Shapes: in [B, T], [B, T], index [B]; out (advantages [B, T], returns [B, T]) (equal).
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, std, _ = group_mean_std(scores, index)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # [B, T]
    return adv, adv


@torch.no_grad()
def compute_grpo_passk_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al. 2025, arXiv:2503.19595, as veRL): only the best sample of each group gets
    a non-zero advantage, ``max_g - second_max_g`` (divided by ``std_g + epsilon`` when
    ``norm_adv_by_std``). Every group needs at least 2 samples. Ties: the first best sample wins.
    """
    scores = _scores(token_level_rewards, response_mask)
    dense, num_groups = group_ids(index)
    size = group_sizes(dense, num_groups, scores.dtype)
    if bool((size < 2).any()):
        raise AlgoError("grpo_passk needs at least 2 samples per group (set rollout.n >= 2).")
    # sort by (group, score descending, position) to find each group's best and second best
    by_score = torch.sort(-scores, stable=True).indices
    by_group = by_score[torch.sort(dense[by_score], stable=True).indices]  # groups together, best first
    starts = torch.cumsum(size.long(), 0) - size.long()  # [G] first position of each group
    best = by_group[starts]  # [G] sample index of each group's best
    second = by_group[starts + 1]
    gap = scores[best] - scores[second]  # [G]
    if norm_adv_by_std:
        _, std, _ = group_mean_std(scores, index)
        gap = gap / (std[best] + epsilon)
    adv = torch.zeros_like(scores).index_put_((best,), gap)
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


@torch.no_grad()
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): ``A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g)``.
    A singleton group keeps its raw score (veRL).
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, _, size = group_mean_std(scores, index)
    adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), scores)
    adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


@torch.no_grad()
def compute_opo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv:2505.23585): length-weighted baseline
    ``b_g = sum_j |o_j| s_j / sum_j |o_j|``, ``A_i = s_i - b_g``; singleton baseline 0 (veRL).
    """
    scores = _scores(token_level_rewards, response_mask)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)  # [B]
    dense, num_groups = group_ids(index)
    size = group_sizes(dense, num_groups, scores.dtype)
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    weighted = zeros.clone().index_add_(0, dense, lengths * scores)
    total_len = zeros.clone().index_add_(0, dense, lengths)
    baseline = torch.where(size > 1, weighted / total_len.clamp(min=1e-12), zeros)[dense]  # [B]
    adv = (scores - baseline).unsqueeze(-1) * response_mask.to(scores.dtype)
    return adv, adv


@torch.no_grad()
def compute_gpg_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv:2504.02546), as veRL: ``A_i = alpha * (s_i - mean_g)`` with
    ``alpha = B / max(1, #{i : s_i != 0})`` over the whole batch and F_norm = 1; singleton mean 0.
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, _, _ = group_mean_std(scores, index)
    alpha = scores.numel() / max(1, int(torch.count_nonzero(scores)))
    adv = (alpha * (scores - mean)).unsqueeze(-1) * response_mask.to(scores.dtype)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go ``G_t = r_t + gamma * G_{t+1}``
    (reset past the end of each response), whitened over every valid token of the batch.

    Returns (advantages [B, T] masked, returns [B, T] un-whitened).
    """
    check_bt("response_mask", response_mask, token_level_rewards)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns * mask  # 0 on masked tokens (a tool turn's hole included)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``s_i - mean_g`` (singleton mean 0) broadcast to every valid token, then
    whitened over every valid token of the batch (veRL). Returns (advantages, advantages).
    """
    scores = _scores(token_level_rewards, response_mask)
    mean, _, _ = group_mean_std(scores, index)
    mask = response_mask.to(scores.dtype)
    centred = (scores - mean).unsqueeze(-1) * mask  # [B, T]
    adv = masked_whiten(centred, response_mask) * mask
    return adv, adv


@torch.no_grad()
def compute_remax_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): return-to-go minus the greedy rollout's score,
    ``A_t = sum_{t' >= t} r_{t'} - b``, with ``reward_baselines`` [B] (veRL).
    """
    check_bt("response_mask", response_mask, token_level_rewards)
    if reward_baselines is None or reward_baselines.shape != token_level_rewards.shape[:1]:
        got = None if reward_baselines is None else tuple(reward_baselines.shape)
        raise AlgoError(
            f"remax needs reward_baselines of shape [B]={tuple(token_level_rewards.shape[:1])}, got {got}"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask  # [B, T], 0 on masked tokens
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns
