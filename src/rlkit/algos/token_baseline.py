"""Optimal Token Baseline (OTB): a per-token, variance-weighted group baseline (torch only).

OTB (Li et al., "Optimal Token Baseline", https://richardli.xyz/optimal-token-baseline; veRL's
``optimal_token_baseline`` and ``tir_optimal_token_baseline`` estimators) replaces the one group mean
per sequence by one baseline per token position, a mean of the group's returns-to-go weighted by how
much gradient "energy" each trajectory has accumulated so far:

    w_t = 1 - 2 pi_t + sum_v pi_v^2          (||grad log pi||^2 proxy from the logits, >= 0)
    W_t = sum_{j <= t} m_j w_j               (cumulative path variance)
    B_t = sum_i G_t^i W_t^i / (sum_i W_t^i + eps),   A_t = (G_t - B_t) m_t

``pi_t = exp(old_log_prob)`` is the sampled token's probability and ``sum_pi_squared`` the sum over the
vocabulary of squared probabilities (``sum_pi_squared_from_logits``). With rollout importance weights
``rho``, ``w_t`` is scaled by ``rho_t^2``. The TIR (tool-integrated, multi-turn) variant aligns
trajectories by the index of each *valid* token instead of its absolute position, so that masked
tool-output spans do not shift the comparison.

Shapes: ``B`` = prompts x group size, ``T`` = response tokens, ``G`` = groups, ``V`` = vocabulary.
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError, check_bt, group_ids, group_sizes

__all__ = [
    "compute_optimal_token_baseline_advantage",
    "compute_tir_optimal_token_baseline_advantage",
    "sum_pi_squared_from_logits",
]


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """``sum_v softmax(z)_v^2 = exp(logsumexp(2 z) - 2 logsumexp(z))`` per position, in float32.

    Shapes: logits [..., V] -> [...]; computed ``chunk_size`` rows at a time (no [.., V] softmax kept).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()
        out[start : start + chunk_size] = torch.exp(
            torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1)
        )
    return out.reshape(logits.shape[:-1])


def _inputs(token_level_rewards, response_mask, old_log_prob, sum_pi_squared, rollout_is_weights, epsilon):
    """Check shapes; return (mask, returns-to-go, cumulative path variance W), each [B, T]."""
    for name, tensor in (
        ("response_mask", response_mask),
        ("old_log_prob", old_log_prob),
        ("sum_pi_squared", sum_pi_squared),
    ):
        check_bt(name, tensor, token_level_rewards)
    if rollout_is_weights is not None:
        check_bt("rollout_is_weights", rollout_is_weights, token_level_rewards)
    if epsilon <= 0:
        raise AlgoError(f"optimal token baseline: epsilon must be > 0, got {epsilon}.")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, T] reward-to-go
    w = 1 - 2 * torch.exp(old_log_prob.to(mask.dtype)) + sum_pi_squared.to(mask.dtype)  # [B, T]
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(mask.dtype).square()
    return mask, returns, (w * mask).cumsum(-1)


def _zero_tail_start(
    lengths: torch.Tensor, dense: torch.Tensor, num_groups: int, size: torch.Tensor
) -> torch.Tensor:
    """Per sample [B]: where its baseline is zeroed from, or a huge value for "nowhere".

    Only a group's unique longest trajectory gets a start: the second-longest length of its group
    (its positions beyond every other member have no one to compare with). Singletons never do.
    """
    lengths = lengths.to(torch.long)
    gmax = torch.full((num_groups,), -1, dtype=torch.long, device=lengths.device)
    gmax = gmax.scatter_reduce(0, dense, lengths, reduce="amax")  # [G]
    is_max = lengths == gmax[dense]  # [B]
    n_max = torch.zeros(num_groups, dtype=torch.long, device=lengths.device).index_add_(
        0, dense, is_max.long()
    )
    others = torch.where(is_max, torch.full_like(lengths, -1), lengths)
    second = torch.full((num_groups,), -1, dtype=torch.long, device=lengths.device)
    second = second.scatter_reduce(0, dense, others, reduce="amax")  # [G]
    unique_longest = is_max & (n_max[dense] == 1) & (size > 1)
    never = torch.full_like(lengths, torch.iinfo(torch.long).max)
    return torch.where(unique_longest, second[dense].clamp(min=0), never)


@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB by absolute position ``t`` (veRL's ``optimal_token_baseline``); see the module docstring.

    A singleton group gets baseline 0 (advantage = return). Every sample counts in its group's size,
    also an empty response. ``handle_zero_tail``: a group's unique longest trajectory gets baseline 0
    from the second-longest length on (absolute positions).

    Shapes: rewards, mask, old_log_prob, sum_pi_squared, rollout_is_weights [B, T]; index [B];
    out (advantages [B, T], returns [B, T]).
    """
    mask, returns, cum_w = _inputs(
        token_level_rewards, response_mask, old_log_prob, sum_pi_squared, rollout_is_weights, epsilon
    )
    dense, num_groups = group_ids(index)
    size = group_sizes(dense, num_groups, mask.dtype)[dense]  # [B]
    zeros = torch.zeros(num_groups, mask.shape[1], dtype=mask.dtype, device=mask.device)
    num = zeros.clone().index_add_(0, dense, returns * cum_w * mask)  # [G, T]
    den = zeros.clone().index_add_(0, dense, cum_w * mask)  # [G, T]
    baseline = (num / (den + epsilon))[dense]  # [B, T]
    baseline = torch.where((size > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        start = _zero_tail_start(mask.sum(-1), dense, num_groups, size)  # [B]
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)  # [1, T]
        baseline = torch.where(positions >= start.unsqueeze(-1), torch.zeros_like(baseline), baseline)
    return (returns - baseline) * mask, returns * mask


@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB aligned by valid-token index (veRL's ``tir_optimal_token_baseline``), for multi-turn masks.

    The k-th valid token of every trajectory in a group shares the baseline
    ``B_k = sum_i G^i_(k) W^i_(k) / (sum_i W^i_(k) + eps)``, where ``x_(k)`` is ``x`` at that
    trajectory's k-th valid position. Empty responses are left out of their group (size and sums);
    a group with one non-empty trajectory gets baseline 0. ``handle_zero_tail`` (default on) zeroes
    the unique longest trajectory's baseline from the second-longest valid length on.

    Shapes: as ``compute_optimal_token_baseline_advantage``.
    """
    mask, returns, cum_w = _inputs(
        token_level_rewards, response_mask, old_log_prob, sum_pi_squared, rollout_is_weights, epsilon
    )
    batch, width = mask.shape
    lengths = mask.sum(-1)  # [B]
    valid = mask > 0
    rank = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, T] index of each valid token
    rows = torch.arange(batch, device=mask.device).unsqueeze(-1).expand(batch, width)
    compact_ret = torch.zeros_like(mask).index_put_((rows[valid], rank[valid]), returns[valid])  # [B, K]
    compact_w = torch.zeros_like(mask).index_put_((rows[valid], rank[valid]), cum_w[valid])
    dense, num_groups = group_ids(index)
    nonempty = (lengths > 0).to(mask.dtype)
    size = torch.zeros(num_groups, dtype=mask.dtype, device=mask.device).index_add_(0, dense, nonempty)[dense]
    zeros = torch.zeros(num_groups, width, dtype=mask.dtype, device=mask.device)
    num = zeros.clone().index_add_(0, dense, compact_ret * compact_w)  # [G, K]
    den = zeros.clone().index_add_(0, dense, compact_w)
    baseline = (num / (den + epsilon))[dense]  # [B, K]
    baseline = torch.where((size > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        # empty responses are not group members: give them length -1 so they never count as a length
        start = _zero_tail_start(
            torch.where(lengths > 0, lengths, -torch.ones_like(lengths)), dense, num_groups, size
        )
        positions = torch.arange(width, device=mask.device).unsqueeze(0)
        baseline = torch.where(positions >= start.unsqueeze(-1), torch.zeros_like(baseline), baseline)
    return (returns - baseline.gather(1, rank)) * mask, returns * mask
