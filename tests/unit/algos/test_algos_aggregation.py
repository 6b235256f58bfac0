"""agg_loss: hand-worked values, loop reference, and exact micro-batch / rank split invariance."""

from __future__ import annotations

import _algos_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import LOSS_AGG_MODES, AlgoError, agg_loss, global_counts

F64 = dict(dtype=torch.float64)
settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], **F64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], **F64)  # row 2 is empty


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", {}, 5.0),  # (6 + 4) / 2 non-empty sequences
        ("seq-mean-token-mean", {}, 3.0),  # (6/3 + 4/1) / 2
        ("seq-mean-token-sum-norm", {}, 10 / 6),  # 10 / (2 sequences * T=3)
        ("seq-mean-token-sum-norm", {"max_response_len": 5}, 1.0),  # 10 / (2 * 5)
        ("token-mean", {"global_tokens": 8}, 10 / 8),  # this piece is half of an 8-token batch
        ("seq-mean-token-mean", {"global_seqs": 4}, 6 / 4),
    ],
)
def test_hand_worked(mode, kwargs, expected):
    assert float(agg_loss(LOSS, MASK, mode, **kwargs)) == pytest.approx(expected, abs=1e-12)


def test_counts_and_errors():
    tokens, seqs = global_counts(MASK)
    assert (int(tokens), int(seqs)) == (4, 2)
    with pytest.raises(AlgoError, match="Valid: token-mean"):
        agg_loss(LOSS, MASK, "token-sum")
    # an empty piece contributes exactly zero (and no NaN)
    assert float(agg_loss(LOSS, torch.zeros_like(MASK), "seq-mean-token-mean")) == 0.0


@st.composite
def split_batches(draw):
    """A batch with prefix masks (some empty rows), and a split into ranks, each into micro-batches."""
    b = draw(st.integers(2, 9))
    t = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b).filter(lambda xs: any(xs)))
    seed = draw(st.integers(0, 2**16))
    world = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(1, b - 1), max_size=4, unique=True)))
    return b, t, lengths, seed, world, cuts


def _pieces(b, cuts):
    bounds = [0, *cuts, b]
    return [list(range(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]


@given(split_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_matches_loop(case, mode):
    b, t, lengths, seed, _, _ = case
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=gen, **F64)
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths], **F64)
    assert float(agg_loss(loss, mask, mode)) == pytest.approx(ref.agg(loss, mask, mode), rel=1e-12, abs=1e-12)


@given(split_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_micro_batch_and_rank_split_is_exact(case, mode):
    """Sum over ranks (all-reduce SUM) of the sum over micro-batches == the full-batch loss and gradient.

    Each micro-batch is trimmed to its own padded width (dynamic padding), so only the global counts
    and the constant max_response_len make the pieces agree.
    """
    b, t, lengths, seed, world, cuts = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=gen, **F64)
    theta = torch.randn(t, generator=gen, **F64)  # the shared "model parameter"
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths], **F64)

    def per_token_loss(param, rows, width):
        return torch.sin(x[rows, :width] * param[:width]) + param[:width] ** 2  # [b, width]

    full_param = theta.clone().requires_grad_(True)
    full = agg_loss(per_token_loss(full_param, list(range(b)), t), mask, mode, max_response_len=t)
    full.backward()

    # ranks take interleaved rows; each rank splits its rows into micro-batches
    rank_rows = [list(range(r, b, world)) for r in range(world)]
    counts = [global_counts(mask[rows]) for rows in rank_rows]
    g_tokens = sum(c[0] for c in counts)  # all-reduce SUM of the counts
    g_seqs = sum(c[1] for c in counts)
    total_value, grads = 0.0, []
    for rows in rank_rows:
        param = theta.clone().requires_grad_(True)  # this rank's replica
        for piece in _pieces(len(rows), [c for c in cuts if c < len(rows)]):
            mb = [rows[i] for i in piece]
            if not mb:  # a rank with no rows (more ranks than sequences) contributes nothing
                continue
            width = max(1, int(mask[mb].sum(-1).max()))  # dynamic padding per micro-batch
            share = agg_loss(
                per_token_loss(param, mb, width),
                mask[mb, :width],
                mode,
                global_tokens=g_tokens,
                global_seqs=g_seqs,
                max_response_len=t,
            )
            share.backward()  # gradient accumulation = sum over micro-batches
            total_value += float(share.detach())
        grads.append(param.grad if param.grad is not None else torch.zeros_like(theta))
    summed = torch.stack(grads).sum(0)  # all-reduce SUM across ranks
    assert total_value == pytest.approx(float(full.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(summed, full_param.grad, rtol=1e-10, atol=1e-12)
    # DDP/FSDP default is a MEAN across ranks: it is off by the world size unless shares are scaled
    torch.testing.assert_close(torch.stack(grads).mean(0) * world, full_param.grad, rtol=1e-10, atol=1e-12)


def test_local_counts_would_be_wrong():
    """Why the counts are arguments: token-mean with per-micro-batch counts weights pieces unequally."""
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], **F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], **F64)
    full = float(agg_loss(loss, mask, "token-mean"))  # 7 / 4 = 1.75
    # (1 + 4) / 2
    naive = sum(float(agg_loss(loss[i : i + 1], mask[i : i + 1], "token-mean")) for i in range(2)) / 2
    exact = sum(
        float(agg_loss(loss[i : i + 1], mask[i : i + 1], "token-mean", global_tokens=4)) for i in range(2)
    )
    assert full == 1.75 and naive == 2.5 and exact == 1.75
