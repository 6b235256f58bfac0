"""Advantage estimators: hand-worked values, loop references, and properties."""

from __future__ import annotations

import _algos_reference as ref
import pytest
import torch
from _algos_strategies import batches
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import AlgoError
from rlkit.algos import advantages as A

F64 = dict(dtype=torch.float64)
settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")


def outcome(scores, t=3, lengths=None):
    """Rewards [B, T] with each score on the last valid token, and the prefix mask."""
    lengths = lengths or [t] * len(scores)
    rewards = torch.zeros(len(scores), t, **F64)
    mask = torch.zeros(len(scores), t, **F64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask


def close(a, b, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, **F64), torch.as_tensor(b, **F64), atol=tol, rtol=tol)


# ---------------------------------------------------------------- hand-worked values
def test_grpo_hand_worked():
    # group 7: scores 1,0,1,0 -> mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.5773503
    #   advantage = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    # group 3: one sample, score 2 -> mean 0, std 1 -> 2 / (1 + 1e-6)
    rewards, mask = outcome([1, 0, 2, 1, 0], lengths=[3, 2, 1, 3, 3])
    index = torch.tensor([7, 7, 3, 7, 7])
    adv, ret = A.compute_grpo_advantage(rewards, mask, index)
    std = (1 / 3) ** 0.5
    expected = [
        0.5 / (std + 1e-6),
        -0.5 / (std + 1e-6),
        2 / (1 + 1e-6),
        0.5 / (std + 1e-6),
        -0.5 / (std + 1e-6),
    ]
    close(adv[:, 0], expected)
    close(adv, torch.tensor(expected, **F64)[:, None] * mask)  # broadcast over valid tokens only
    assert adv.shape == ret.shape == (5, 3) and torch.equal(adv, ret)


def test_dr_grpo_hand_worked():
    # no std division: 1 - 0.5 = 0.5, 0 - 0.5 = -0.5
    rewards, mask = outcome([1, 0, 1, 0])
    adv, _ = A.compute_grpo_advantage(rewards, mask, torch.tensor([0, 0, 0, 0]), norm_adv_by_std=False)
    close(adv[:, 0], [0.5, -0.5, 0.5, -0.5])


def test_rloo_hand_worked():
    # scores 1,0,0: 1 - mean(0,0) = 1; 0 - mean(1,0) = -0.5. Singleton keeps its score (veRL).
    rewards, mask = outcome([1, 0, 0, 4])
    adv, _ = A.compute_rloo_advantage(rewards, mask, torch.tensor([0, 0, 0, 1]))
    close(adv[:, 0], [1.0, -0.5, -0.5, 4.0])


def test_opo_hand_worked():
    # scores 1,0 with lengths 1,3: baseline (1*1 + 3*0) / 4 = 0.25 -> 0.75, -0.25
    rewards, mask = outcome([1, 0], t=3, lengths=[1, 3])
    adv, _ = A.compute_opo_advantage(rewards, mask, torch.tensor([5, 5]))
    close(adv, [[0.75, 0, 0], [-0.25, -0.25, -0.25]])


def test_gpg_hand_worked():
    # scores 1,0,1,1: mean 0.75, alpha = B / #non-zero = 4 / 3
    #   1 -> 4/3 * 0.25 = 1/3;  0 -> 4/3 * -0.75 = -1
    rewards, mask = outcome([1, 0, 1, 1])
    adv, _ = A.compute_gpg_advantage(rewards, mask, torch.tensor([0, 0, 0, 0]))
    close(adv[:, 0], [1 / 3, -1.0, 1 / 3, 1 / 3])


def test_passk_hand_worked():
    # group 0: 0.2, 0.9, 0.5 -> only the best (0.9) gets 0.9 - 0.5 = 0.4
    # group 1: 1, 1 -> tie, the gap is 0
    rewards, mask = outcome([0.2, 0.9, 0.5, 1, 1])
    adv, _ = A.compute_grpo_passk_advantage(
        rewards, mask, torch.tensor([0, 0, 0, 1, 1]), norm_adv_by_std=False
    )
    close(adv[:, 0], [0, 0.4, 0, 0, 0])
    # with std: unbiased std of (0.2, 0.9, 0.5) = 0.3511885 -> 0.4 / (0.3511885 + 1e-6)
    adv, _ = A.compute_grpo_passk_advantage(rewards, mask, torch.tensor([0, 0, 0, 1, 1]))
    close(adv[1, 0], 0.4 / (0.35118845842842 + 1e-6), tol=1e-7)


def test_passk_rejects_singletons():
    rewards, mask = outcome([1, 0, 1])
    with pytest.raises(AlgoError, match="at least 2"):
        A.compute_grpo_passk_advantage(rewards, mask, torch.tensor([0, 0, 1]))


def test_remax_hand_worked():
    # returns-to-go of [0, 0, 1] = [1, 1, 1]; minus greedy baseline 0.25 -> 0.75 everywhere
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], **F64)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], **F64)
    adv, ret = A.compute_remax_advantage(rewards, mask, torch.tensor([0.25, 1.0], **F64))
    close(ret, [[1, 1, 1], [2, 2, 0]])
    close(adv, [[0.75, 0.75, 0.75], [1, 1, 0]])


def test_reinforce_plus_plus_returns_hand_worked():
    # gamma 0.5. Row 0: 1 at t=2 -> returns 0.25, 0.5, 1.
    # Row 1: 2 at t=1, t=2 is padding -> returns 1, 2, 0 (padding restarts the return).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], **F64)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], **F64)
    adv, ret = A.compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # whitened over the 5 valid returns: mean 4.75 / 5 = 0.95; squared deviations
    # 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8, unbiased var 1.8 / 4 = 0.45
    valid = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], **F64)
    close(adv[mask.bool()], (valid - 0.95) / (0.45 + 1e-8) ** 0.5)
    assert adv[1, 2] == 0


def test_gae_hand_worked():
    # T=2, r = [0, 1], V = [0.5, 0.5], gamma 0.9, lam 0.5
    # t=1: delta = 1 + 0.9*0 - 0.5 = 0.5, A1 = 0.5
    # t=0: delta = 0 + 0.9*0.5 - 0.5 = -0.05, A0 = -0.05 + 0.9*0.5*0.5 = 0.175
    # returns = A + V = [0.675, 1.0]; advantages are then whitened over the batch
    rewards = torch.tensor([[0.0, 1.0]], **F64)
    values = torch.tensor([[0.5, 0.5]], **F64)
    mask = torch.ones(1, 2, **F64)
    adv, ret = A.compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(ret, [[0.675, 1.0]])
    raw = torch.tensor([0.175, 0.5], **F64)
    close(adv[0], (raw - raw.mean()) / (raw.var() + 1e-8).sqrt())


# ---------------------------------------------------------------- loop references
@given(batches(outcome=True), st.booleans())
def test_grpo_matches_loop(batch, norm):
    rewards, mask, index = batch
    adv, _ = A.compute_grpo_advantage(rewards, mask, index, norm_adv_by_std=norm)
    close(adv, ref.grpo(rewards, mask, index, norm), tol=1e-7)


@given(batches())
def test_group_estimators_match_loop(batch):
    rewards, mask, index = batch
    close(A.compute_rloo_advantage(rewards, mask, index)[0], ref.rloo(rewards, mask, index), tol=1e-7)
    close(A.compute_opo_advantage(rewards, mask, index)[0], ref.opo(rewards, mask, index), tol=1e-7)
    close(A.compute_gpg_advantage(rewards, mask, index)[0], ref.gpg(rewards, mask, index), tol=1e-7)


@given(batches(min_group=2), st.booleans())
def test_passk_matches_loop(batch, norm):
    rewards, mask, index = batch
    adv, _ = A.compute_grpo_passk_advantage(rewards, mask, index, norm_adv_by_std=norm)
    close(adv, ref.passk(rewards, mask, index, norm), tol=1e-7)


@given(batches(), st.sampled_from([1.0, 0.9, 0.5]))
def test_whitened_estimators_match_loop(batch, gamma):
    rewards, mask, index = batch
    if mask.sum() < 2:
        return
    adv, ret = A.compute_reinforce_plus_plus_advantage(rewards, mask, gamma)
    ref_adv, ref_ret = ref.rfpp(rewards, mask, gamma)
    close(ret * mask, torch.tensor(ref_ret, **F64) * mask, tol=1e-7)
    close(adv, ref_adv, tol=1e-6)
    adv, _ = A.compute_reinforce_plus_plus_baseline_advantage(rewards, mask, index)
    close(adv, ref.rfpp_baseline(rewards, mask, index), tol=1e-6)


@given(batches(), st.sampled_from([(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]), st.randoms())
def test_gae_matches_loop(batch, gl, rnd):
    rewards, mask, _ = batch
    if mask.sum() < 2:
        return
    values = torch.tensor(
        [[rnd.uniform(-1, 1) for _ in range(mask.shape[1])] for _ in range(mask.shape[0])], **F64
    )
    adv, ret = A.compute_gae(rewards, values, mask, *gl)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, *gl)
    close(ret * mask, torch.tensor(ref_ret, **F64) * mask, tol=1e-7)
    close(adv * mask, torch.tensor(ref_adv, **F64) * mask, tol=1e-6)


# ---------------------------------------------------------------- properties
@given(batches(min_group=2, outcome=True))
def test_constant_reward_group_has_zero_advantage(batch):
    rewards, mask, index = batch
    # give every group one constant score (its id mod 3)
    rewards = torch.zeros_like(rewards)
    lengths = mask.sum(-1).long()
    for i, g in enumerate(index.tolist()):
        rewards[i, lengths[i] - 1] = float(g % 3)
    for fn in (
        A.compute_grpo_advantage,
        A.compute_rloo_advantage,
        A.compute_opo_advantage,
        A.compute_gpg_advantage,
        A.compute_grpo_passk_advantage,
    ):
        adv, _ = fn(rewards, mask, index)
        assert torch.count_nonzero(adv) == 0, fn.__name__


@given(batches(min_group=2, outcome=True), st.booleans())
def test_grpo_group_mean_is_zero(batch, norm):
    rewards, mask, index = batch
    adv, _ = A.compute_grpo_advantage(rewards, mask, index, norm_adv_by_std=norm)
    seq_adv = adv[:, 0]  # every response has >= 1 token
    for g in index.unique():
        assert abs(float(seq_adv[index == g].mean())) < 1e-9


@given(batches(min_group=2, outcome=True))
def test_rloo_is_zero_sum_per_group(batch):
    rewards, mask, index = batch
    adv, _ = A.compute_rloo_advantage(rewards, mask, index)
    for g in index.unique():
        assert abs(float(adv[index == g, 0].sum())) < 1e-9


def test_group_ids_need_not_be_contiguous_or_dense():
    rewards, mask = outcome([1, 5, 0, 3])
    a, _ = A.compute_grpo_advantage(rewards, mask, torch.tensor([900, 12, 900, 12]))
    b, _ = A.compute_grpo_advantage(rewards[[0, 2, 1, 3]], mask, torch.tensor([0, 0, 1, 1]))
    close(a[[0, 2, 1, 3]], b)


def test_shape_errors_are_explained():
    rewards, mask = outcome([1, 0])
    with pytest.raises(AlgoError, match=r"response_mask must have shape \(2, 3\)"):
        A.compute_grpo_advantage(rewards, mask[:, :2], torch.tensor([0, 0]))
    with pytest.raises(AlgoError, match="reward_baselines"):
        A.compute_remax_advantage(rewards, mask, torch.zeros(3, **F64))
