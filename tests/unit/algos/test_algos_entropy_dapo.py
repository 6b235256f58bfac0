"""Chunked entropy / log-probs, overlong shaping, and the dynamic-sampling group filter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import (
    AlgoError,
    DynamicSamplingAccumulator,
    DynamicSamplingError,
    entropy_from_logits,
    filter_groups,
    first_groups_mask,
    log_probs_from_logits,
    overlong_penalty,
)
from rlkit.errors import RlkitError

settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_entropy_and_log_probs_match_full_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    full_logp = torch.log_softmax(logits, -1)
    full_h = -(full_logp.exp() * full_logp).sum(-1)
    h = entropy_from_logits(logits, chunk_size=chunk)
    lp = log_probs_from_logits(logits, labels, chunk_size=chunk)
    assert h.shape == lp.shape == (2, 5)
    torch.testing.assert_close(h.double(), full_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        lp.double(), full_logp.gather(-1, labels[..., None])[..., 0], rtol=1e-6, atol=1e-6
    )
    # gradients agree too (each chunk is recomputed in backward)
    (g1,) = torch.autograd.grad((h.sum() + lp.sum()), logits)
    (g2,) = torch.autograd.grad(full_h.sum() + full_logp.gather(-1, labels[..., None]).sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_entropy_hand_worked_and_bf16():
    # uniform over 4 -> ln 4; one-hot (a huge logit) -> 0
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    h = entropy_from_logits(logits, chunk_size=1)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, torch.tensor([1.3862944, 0.0]), atol=1e-6, rtol=0)
    with pytest.raises(AlgoError, match="labels must have shape"):
        log_probs_from_logits(logits, torch.zeros(3, dtype=torch.long))


def test_overlong_penalty_hand_worked():
    # max 10, buffer 4 -> expected length 6; factor 1: L=3,6 -> 0; L=8 -> -(8-6)/4 = -0.5; L=10 -> -1
    p = overlong_penalty(
        torch.tensor([3, 6, 8, 10]), max_response_length=10, buffer_len=4, penalty_factor=1.0
    )
    torch.testing.assert_close(p, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    with pytest.raises(AlgoError, match="overlong_buffer.len"):
        overlong_penalty(torch.tensor([1]), 10, 0, 1.0)


def test_filter_groups_hand_worked():
    # group 4: 1,1 constant -> dropped; group 9: 0,1 varies -> kept; group 2: singleton -> kept (veRL)
    index = torch.tensor([4, 9, 4, 2, 9])
    keep = filter_groups(index, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    assert keep.tolist() == [False, True, False, True, True]
    # equal floats whose numpy std is 1e-17, not 0, are still dropped here
    keep = filter_groups(torch.tensor([0, 0, 0]), torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64))
    assert keep.tolist() == [False, False, False]


@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=20))
def test_filter_groups_matches_loop(pairs):
    index = torch.tensor([g for g, _ in pairs])
    values = torch.tensor([v for _, v in pairs])
    by_group: dict[int, list[float]] = {}
    for g, v in pairs:
        by_group.setdefault(g, []).append(v)
    expected = [len(by_group[g]) == 1 or len(set(by_group[g])) > 1 for g, _ in pairs]
    assert filter_groups(index, values).tolist() == expected


def test_first_groups_mask():
    assert first_groups_mask(torch.tensor([7, 7, 3, 3, 9, 9]), 2).tolist() == [True] * 4 + [False] * 2


def test_accumulator_fills_then_stops():
    acc = DynamicSamplingAccumulator(target_groups=3, max_num_gen_batches=3)
    # batch 1: groups 0 (varies) and 1 (constant) -> 1 kept
    keep = acc.add(torch.tensor([0, 0, 1, 1]), torch.tensor([0.0, 1.0, 1.0, 1.0]))
    assert keep.tolist() == [True, True, False, False] and not acc.full
    # batch 2: groups 2, 3 vary -> 3 kept: full
    acc.add(torch.tensor([2, 2, 3, 3]), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert acc.full and acc.metrics()["train/num_gen_batches"] == 2.0
    # 4 groups seen: 3 kept (0, 2, 3), 1 dropped (1)
    assert (
        acc.metrics()["train/filter_groups_kept"] == 3.0
        and acc.metrics()["train/filter_groups_dropped"] == 1.0
    )
    assert acc.metrics()["train/filter_groups_kept_frac"] == 0.75
    acc.reset()
    assert acc.num_groups == 0 and acc.num_gen_batches == 0


def test_accumulator_raises_with_advice_after_budget():
    acc = DynamicSamplingAccumulator(target_groups=2, max_num_gen_batches=2, metric="acc")
    constant = (torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    acc.add(*constant)
    with pytest.raises(DynamicSamplingError) as err:
        acc.add(*constant)
    assert isinstance(err.value, RlkitError)
    assert "max_num_gen_batches=2" in str(err.value) and "'acc'" in str(err.value)
    assert "algorithm.filter_groups.enable=false" in str(err.value)
    assert "algorithm.filter_groups.metric='acc'" in str(err.value)
    assert "[1 1] x2" in str(err.value)  # what every group scored: two groups, both all 1
    unlimited = DynamicSamplingAccumulator(target_groups=2, max_num_gen_batches=0)
    for _ in range(20):
        unlimited.add(*constant)  # 0 = no limit (veRL)


def test_accumulator_summary_counts_every_group():
    acc = DynamicSamplingAccumulator(target_groups=10, max_num_gen_batches=0)
    acc.add(torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
    acc.add(torch.tensor([0, 0]), torch.tensor([-1.0, -1.0]))
    assert acc.summary() == "[0 0] x2, [0 1] x1, [-1 -1] x1"
    assert acc.summary(limit=1) == "[0 0] x2, and 2 more groups"
