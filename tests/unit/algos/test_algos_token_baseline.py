"""Optimal token baseline (OTB) and its multi-turn variant: hand-worked values, loop references,
properties."""

from __future__ import annotations

import _algos_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import AlgoError
from rlkit.algos import estimators as E
from rlkit.algos import token_baseline as O

F64 = dict(dtype=torch.float64)
settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")


def t(rows):
    return torch.tensor(rows, **F64)


def close(a, b, tol=1e-7):
    torch.testing.assert_close(torch.as_tensor(a, **F64), torch.as_tensor(b, **F64), atol=tol, rtol=tol)


def test_otb_hand_worked():
    # w_t = 1 - 2 pi_t + sum pi^2. Sample 0: pi = 0.5, sum pi^2 = 0.5 -> w = 0.5, W = [0.5, 1.0];
    # rewards [0, 1] -> G = [1, 1]. Sample 1 (length 1): pi = 0.25, sum = 0.25 -> w = 0.75, W = [0.75, -];
    # G = [0, -]. Sample 2 is alone in its group: baseline 0, advantage = return.
    # t=0: B = (1 * 0.5 + 0 * 0.75) / (0.5 + 0.75) = 0.4 -> A = [0.6, -0.4]
    # t=1: only sample 0 is valid: B = 1 * 1 / 1 = 1 -> A = 0
    rewards = t([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    old = torch.log(t([[0.5, 0.5], [0.25, 0.25], [0.5, 0.5]]))
    sum_sq = t([[0.5, 0.5], [0.25, 0.25], [0.5, 0.5]])
    index = torch.tensor([4, 4, 9])
    adv, ret = O.compute_optimal_token_baseline_advantage(rewards, mask, index, old, sum_sq)
    close(ret, [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    close(adv, [[0.6, 0.0], [-0.4, 0.0], [2.0, 2.0]])
    # zero tail: sample 0 is its group's unique longest (2 > 1): baseline 0 from position 1 -> A = G = 1
    adv, _ = O.compute_optimal_token_baseline_advantage(
        rewards, mask, index, old, sum_sq, handle_zero_tail=True
    )
    close(adv, [[0.6, 1.0], [-0.4, 0.0], [2.0, 2.0]])
    # rollout IS weight 2 on sample 1 scales its w by 4 -> 3: t=0 B = 0.5 / 3.5 = 1/7 -> A = 6/7, -1/7
    is_w = t([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]])
    adv, _ = O.compute_optimal_token_baseline_advantage(rewards, mask, index, old, sum_sq, is_w)
    close(adv[:2, 0], [6 / 7, -1 / 7])


def test_tir_aligns_by_valid_token_index():
    # w = 0.5 everywhere. Sample 0 has a masked tool span at position 1: mask [1, 0, 1], reward 1 at the end
    #   -> W = [0.5, 0.5, 1.0], G = [1, 1, 1]. Sample 1: mask [1, 1, 0], no reward -> W = [0.5, 1.0, -], G =
    # 0. TIR, k-th valid token: k=0: B = 0.5 / 1.0 = 0.5; k=1 (sample 0 at t=2, sample 1 at t=1): B = 1 / 2 =
    # 0.5
    #   -> A = [[0.5, 0, 0.5], [-0.5, -0.5, 0]]
    # plain OTB by absolute position: t=1 and t=2 each have one valid trajectory -> B = its own G -> A = 0
    rewards = t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = t([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), 0.5, **F64).log()
    sum_sq = torch.full((2, 3), 0.5, **F64)
    index = torch.tensor([0, 0])
    adv, _ = O.compute_tir_optimal_token_baseline_advantage(rewards, mask, index, old, sum_sq)
    close(adv, [[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]])
    adv, _ = O.compute_optimal_token_baseline_advantage(rewards, mask, index, old, sum_sq)
    close(adv, [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]])


def test_sum_pi_squared_from_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, **F64) * 4
    expected = torch.softmax(logits, -1).square().sum(-1)
    for chunk in (1, 4, 100):
        close(O.sum_pi_squared_from_logits(logits, chunk_size=chunk), expected, tol=1e-6)


def test_estimator_wrappers_need_the_extra_tensors():
    rewards = torch.zeros(2, 3)
    with pytest.raises(AlgoError, match="needs old_log_prob, sum_pi_squared"):
        E.optimal_token_baseline(E.EstimatorInputs(rewards, rewards + 1, torch.tensor([0, 0])))
    with pytest.raises(AlgoError, match="needs sum_pi_squared"):
        E.tir_optimal_token_baseline(
            E.EstimatorInputs(rewards, rewards + 1, torch.tensor([0, 0]), old_log_prob=rewards)
        )


# ---------------------------------------------------------------- loop references
@st.composite
def otb_batches(draw, holes: bool = False):
    """Groups of 1-4 samples; prefix masks, or (holes) arbitrary 0/1 masks including empty rows."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    width = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(0, 999), min_size=len(sizes), max_size=len(sizes), unique=True))
    index = [gid for gid, n in zip(ids, sizes) for _ in range(n)]
    b = len(index)
    if holes:
        bits = draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=b, max_size=b))
        mask = torch.tensor(bits, **F64)
    else:
        lengths = draw(st.lists(st.integers(0, width), min_size=b, max_size=b))
        mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], **F64)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    sparse = torch.rand(b, width, generator=g) < 0.4
    rewards = torch.randint(-1, 3, (b, width), generator=g).to(torch.float64) * sparse
    old = -torch.rand(b, width, generator=g, **F64) * 3
    sum_sq = torch.exp(old) ** 2 + torch.rand(b, width, generator=g, **F64) * (1 - torch.exp(old) ** 2)
    is_w = torch.rand(b, width, generator=g, **F64) * 2 if draw(st.booleans()) else None
    return rewards, mask, torch.tensor(index), old, sum_sq, is_w


@given(otb_batches(), st.booleans())
def test_otb_matches_loop(batch, zero_tail):
    rewards, mask, index, old, sum_sq, is_w = batch
    adv, ret = O.compute_optimal_token_baseline_advantage(rewards, mask, index, old, sum_sq, is_w, zero_tail)
    ref_adv, ref_ret = ref.otb(rewards, mask, index, old, sum_sq, is_w, zero_tail)
    close(adv, ref_adv)
    close(ret, ref_ret)


@given(otb_batches(holes=True), st.booleans())
def test_otb_with_holes_matches_loop(batch, zero_tail):
    rewards, mask, index, old, sum_sq, is_w = batch
    adv, _ = O.compute_optimal_token_baseline_advantage(rewards, mask, index, old, sum_sq, is_w, zero_tail)
    close(adv, ref.otb(rewards, mask, index, old, sum_sq, is_w, zero_tail)[0])


@given(st.one_of(otb_batches(), otb_batches(holes=True)), st.booleans())
def test_tir_otb_matches_loop(batch, zero_tail):
    rewards, mask, index, old, sum_sq, is_w = batch
    adv, ret = O.compute_tir_optimal_token_baseline_advantage(
        rewards, mask, index, old, sum_sq, is_w, zero_tail
    )
    ref_adv, ref_ret = ref.tir_otb(rewards, mask, index, old, sum_sq, is_w, zero_tail)
    close(adv, ref_adv)
    close(ret, ref_ret)


# ---------------------------------------------------------------- properties
@given(otb_batches(), st.booleans())
def test_prefix_masks_make_tir_and_otb_agree(batch, zero_tail):
    """Without masked spans the k-th valid token is at position k: both variants are the same baseline
    (up to how empty responses count in a group, so drop them here)."""
    rewards, mask, index, old, sum_sq, is_w = batch
    keep = mask.sum(-1) > 0
    if not bool(keep.any()):
        return
    args = (
        rewards[keep],
        mask[keep],
        index[keep],
        old[keep],
        sum_sq[keep],
        None if is_w is None else is_w[keep],
    )
    a, _ = O.compute_optimal_token_baseline_advantage(*args, zero_tail)
    b, _ = O.compute_tir_optimal_token_baseline_advantage(*args, zero_tail)
    close(a, b)


@given(st.lists(st.integers(-2, 3), min_size=2, max_size=6), st.integers(1, 5))
def test_equal_path_variance_gives_the_group_mean_baseline(scores, width):
    """Same w everywhere and equal lengths: W_t is the same for every trajectory, so B_t is the group's
    mean return at t; for an outcome reward that is s_i - mean(s) (Dr.GRPO's advantage) on every token."""
    b = len(scores)
    rewards = torch.zeros(b, width, **F64)
    rewards[:, -1] = t(scores)
    mask = torch.ones(b, width, **F64)
    old = torch.full((b, width), -1.0, **F64)
    adv, _ = O.compute_optimal_token_baseline_advantage(
        rewards, mask, torch.zeros(b, dtype=torch.long), old, torch.full((b, width), 0.3, **F64)
    )
    s = t(scores)
    close(adv, (s - s.mean()).unsqueeze(-1).expand(b, width), tol=1e-6)


@given(otb_batches(holes=True), st.randoms())
def test_row_order_does_not_matter(batch, rnd):
    rewards, mask, index, old, sum_sq, is_w = batch
    perm = list(range(len(index)))
    rnd.shuffle(perm)
    for fn in (O.compute_optimal_token_baseline_advantage, O.compute_tir_optimal_token_baseline_advantage):
        a, _ = fn(rewards, mask, index, old, sum_sq, is_w)
        b, _ = fn(
            rewards[perm],
            mask[perm],
            index[perm],
            old[perm],
            sum_sq[perm],
            None if is_w is None else is_w[perm],
        )
        close(a[perm], b)
