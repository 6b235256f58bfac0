"""clip_cov, kl_cov, geo_mean (GMPO), luspo, vespo: hand-worked values and gradients, loop references,
properties, and micro-batch split invariance for the losses whose per-token values are per-sequence."""

from __future__ import annotations

import math

import _algos_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import AlgoError, agg_loss, global_counts
from rlkit.algos import cov_losses as C
from rlkit.algos import policy_losses as P

F64 = dict(dtype=torch.float64)
settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")


def t(rows):
    return torch.tensor(rows, **F64)


# ---------------------------------------------------------------- hand-worked
# one row, on-policy except where noted; log_prob = [-1, -3, -2, -2] (mean -2), A = [2, -2, 0.5, -0.5] (mean
# 0) covariance (A - 0)(log_prob + 2) = [2*1, -2*-1, 0.5*0, -0.5*0] = [2, 2, 0, 0]
LOGP = [[-1.0, -3.0, -2.0, -2.0]]
ADV = [[2.0, -2.0, 0.5, -0.5]]


def test_clip_cov_hand_worked():
    # lb 1 < cov 2 < ub 5: tokens 0 and 1 are candidates; ratio 0.5 * 4 tokens = 2 to cut -> both cut.
    # r = 1 everywhere: loss -A = [-2, 2, -0.5, 0.5] -> [0, 0, -0.5, 0.5]; gradient -A r on kept tokens.
    log_prob = t(LOGP).requires_grad_(True)
    mask = torch.ones(1, 4, **F64)
    loss, m = C.clip_cov(
        log_prob, t(LOGP), t(ADV), mask, clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=5.0
    )
    torch.testing.assert_close(loss, t([[0.0, 0.0, -0.5, 0.5]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[0.0, 0.0, -0.5, 0.5]]))
    assert m["pg_clipfrac"] == 0.5 and m["ratio_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
    # ub 1.5 < cov 2: nothing is a candidate, plain PPO
    loss, m = C.clip_cov(t(LOGP), t(LOGP), t(ADV), mask, clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=1.5)
    torch.testing.assert_close(loss, t([[-2.0, 2.0, -0.5, 0.5]]))
    assert m["pg_clipfrac"] == 0.0


def test_clip_cov_draws_its_subset_from_the_generator():
    # ratio 0.25 * 4 = 1 token cut, drawn from the 2 candidates: a seed fixes which, both can happen
    mask = torch.ones(1, 4, **F64)
    picks = set()
    for seed in range(20):
        loss, _ = C.clip_cov(
            t(LOGP), t(LOGP), t(ADV), mask, clip_cov_ratio=0.25, generator=torch.Generator().manual_seed(seed)
        )
        again, _ = C.clip_cov(
            t(LOGP), t(LOGP), t(ADV), mask, clip_cov_ratio=0.25, generator=torch.Generator().manual_seed(seed)
        )
        assert torch.equal(loss, again)
        cut = (loss[0, :2] == 0).nonzero().flatten().tolist()
        assert len(cut) == 1
        picks.add(cut[0])
    assert picks == {0, 1}


def test_clip_cov_never_cuts_a_ratio_clipped_token():
    # token 0: r = e^0.5 > 1.2 with A > 0: the PPO clip binds (loss -1.2 * 2 = -2.4), so it is no candidate
    old = t([[-1.5, -3.0, -2.0, -2.0]])
    log_prob = t(LOGP)
    loss, m = C.clip_cov(log_prob, old, t(ADV), torch.ones(1, 4, **F64), clip_cov_ratio=1.0)
    assert float(loss[0, 0]) == pytest.approx(-2.4) and float(loss[0, 1]) == 0.0
    assert m["ratio_clipfrac"] == 0.25 and m["pg_clipfrac"] == 0.25


def test_mini_batch_selections_hand_worked():
    """The registered selections (what the actor runs over the mini-batch): Clip-Cov excludes the
    ratio-clipped token 0 before drawing, so with ratio 1.0 (4 to cut) only token 1 of the two
    candidates (cov 2) is left; KL-Cov takes the top-k covariance tokens (k = 1: token 0, the earlier tie)."""
    old = t([[-1.5, -3.0, -2.0, -2.0]])  # token 0: r = e^0.5 > 1.2 with A > 0, the ratio clip binds
    mask = torch.ones(1, 4, **F64)
    sel = C.clip_cov_mini_batch_selection(
        t(LOGP), old, t(ADV), mask, clip_cov_ratio=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert sel.tolist() == [[False, True, False, False]]
    loss, m = C.clip_cov(t(LOGP), old, t(ADV), mask, clip_cov_ratio=1.0, selected=sel)
    assert float(loss[0, 1]) == 0.0 and m["pg_clipfrac"] == 0.25  # the loss cuts exactly the selection
    sel = C.kl_cov_mini_batch_selection(t(LOGP), old, t(ADV), mask, kl_cov_ratio=0.25)
    assert sel.tolist() == [[True, False, False, False]]


def test_kl_cov_hand_worked():
    # old = [-1.5, -3, -2, -2]: log r = [0.5, 0, 0, 0]; cov [2, 2, 0, 0]; k = max(1, int(4 * 0.25)) = 1:
    # the tie between tokens 0 and 1 goes to token 0 (row-major). Its loss -2 e^0.5 + 1 * 0.5 = -2.797443,
    # gradient -2 e^0.5 + 1 = -2.297443. Others: -A r = [2, -0.5, 0.5], gradient -A.
    log_prob = t(LOGP).requires_grad_(True)
    old = t([[-1.5, -3.0, -2.0, -2.0]])
    loss, m = C.kl_cov(log_prob, old, t(ADV), torch.ones(1, 4, **F64), kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    e = math.exp(0.5)
    torch.testing.assert_close(loss, t([[-2 * e + 0.5, 2.0, -0.5, 0.5]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[-2 * e + 1, 2.0, -0.5, 0.5]]))
    assert m == pytest.approx({"ppo_kl": 0.125, "ppo_kl_k1": -0.125, "kl_cov_frac": 0.25})


def test_geo_mean_hand_worked():
    # row 0, A = +1: log r = [0.5, -0.1] -> pessimistic clip to [-0.4, 0.4]: c = [0.4, -0.1], rho = e^0.15
    #   loss -rho on both tokens; gradient only through token 1 (token 0 is clipped).
    # row 1, A = -1: log r = [0.5, -0.6] -> c = max(log r, clip) = [0.5, -0.4], rho = e^0.05, loss +rho;
    #   gradient only through token 0.
    # seq-mean-token-mean = (-e^0.15 + e^0.05) / 2; gradient d/dlog_prob = -A_bar rho / n_i / S.
    old = torch.zeros(2, 2, **F64)
    log_prob = t([[0.5, -0.1], [0.5, -0.6]]).requires_grad_(True)
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, **F64)
    loss, m = P.geo_mean(log_prob, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    r0, r1 = math.exp(0.15), math.exp(0.05)
    torch.testing.assert_close(loss, t([[-r0, -r0], [r1, r1]]))
    total = agg_loss(loss, mask, "seq-mean-token-mean")
    assert float(total.detach()) == pytest.approx((-r0 + r1) / 2)
    total.backward()
    torch.testing.assert_close(log_prob.grad, t([[0.0, -r0 / 4], [r1 / 4, 0.0]]))
    assert m["pg_clipfrac"] == 0.25 and m["pg_clipfrac_lower"] == 0.5


def test_luspo_is_trl_luspo_under_seq_mean_token_sum():
    # row 0: 1 token, log r 0.1, A = 1 -> s = e^0.1 (inside [0.8, 1.2]): L0 = -e^0.1
    # row 1: 3 tokens, log r [0.1, 0.2, -0.3] (mean 0), A = -1 -> s = 1: L1 = 1
    # TRL: mean_i(n_i L_i) = (1 * -e^0.1 + 3 * 1) / 2 = 0.947414
    # gradient: row 1's tokens each get d(3 L1)/dlog_prob / 2 = 3 * (1/3) * 1 / 2 = 0.5; row 0: -e^0.1 / 2
    old = torch.zeros(2, 3, **F64)
    log_prob = t([[0.1, 9.0, 9.0], [0.1, 0.2, -0.3]]).requires_grad_(True)
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = t([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = P.luspo(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    total = agg_loss(loss, mask, "seq-mean-token-sum")
    assert float(total.detach()) == pytest.approx((-math.exp(0.1) + 3) / 2)
    assert float(total.detach()) == pytest.approx(ref.luspo_trl(log_prob.detach(), old, adv, mask, 0.2, 0.2))
    total.backward()
    torch.testing.assert_close(log_prob.grad, t([[-math.exp(0.1) / 2, 0.0, 0.0], [0.5, 0.5, 0.5]]))


def test_vespo_hand_worked():
    # row 0: log w = 0.2 - 0.2 = 0 -> w = 1 -> phi = 1 for either sign: loss -A log_prob, gradient -A
    # row 1 (A = +1, k 2, lambda 3): log w = ln 2 -> phi = e^3 * 2^2 * e^-6 = 4 e^-3 = 0.199148
    # row 2 (A = -1, k 3, lambda 2): log w = ln 2 -> phi = e^2 * 2^3 * e^-4 = 8 e^-2 = 1.082682
    old = t([[-1.2, -0.8], [-1.0 - math.log(2), -1.0], [-1.0 - math.log(2), -1.0]])
    log_prob = t([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]).requires_grad_(True)
    adv = t([[1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    loss, m = P.vespo(log_prob, old, adv, torch.ones(3, 2, **F64))
    p1, p2 = 4 * math.exp(-3), 8 * math.exp(-2)
    torch.testing.assert_close(loss, t([[1.0, -1.0], [p1, p1], [-p2, -p2]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[-1.0, 1.0], [-p1, -p1], [p2, p2]]))
    assert m["vespo_phi_mean"] == pytest.approx((2 + 2 * p1 + 2 * p2) / 6)


def test_bad_parameters_are_explained():
    x = torch.zeros(1, 2)
    with pytest.raises(AlgoError, match="clip_cov_lb < clip_cov_ub"):
        C.clip_cov(x, x, x, x + 1, clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(AlgoError, match="kl_cov_ratio > 0"):
        C.kl_cov(x, x, x, x + 1, kl_cov_ratio=0.0)
    with pytest.raises(AlgoError, match="lambda_pos, lambda_neg > 0"):
        P.vespo(x, x, x, x + 1, lambda_neg=0.0)


# ---------------------------------------------------------------- loop references
@st.composite
def loss_inputs(draw, seq_adv: bool = False):
    b, n = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    old = -torch.rand(b, n, generator=g, **F64) * 3
    log_prob = old + torch.randn(b, n, generator=g, **F64) * 0.6
    adv = torch.randn(b, 1 if seq_adv else n, generator=g, **F64).expand(b, n).clone()
    lengths = draw(st.lists(st.integers(1, n), min_size=b, max_size=b))
    mask = torch.tensor([[1.0] * k + [0.0] * (n - k) for k in lengths], **F64)
    return log_prob, old, adv, mask


@given(
    loss_inputs(),
    st.sampled_from([0.05, 0.3, 1.0]),
    st.sampled_from([(-1.0, 1.0), (0.0, 0.5), (0.1, 5.0)]),
    st.integers(0, 99),
)
def test_clip_cov_matches_loop(inputs, ratio, bounds, seed):
    log_prob, old, adv, mask = inputs
    loss, m = C.clip_cov(
        log_prob,
        old,
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_cov_ratio=ratio,
        clip_cov_lb=bounds[0],
        clip_cov_ub=bounds[1],
        generator=torch.Generator().manual_seed(seed),
    )
    ppo, cands, n_cut = ref.clip_cov_parts(log_prob, old, adv, mask, 0.2, 0.28, ratio, *bounds)
    cut = {(i, j) for i, j in (loss == 0).nonzero().tolist() if ppo[i][j] != 0 and mask[i, j]}
    assert cut <= set(cands) and len(cut) == min(n_cut, len(cands))
    keep = torch.tensor(
        [[0.0 if (i, j) in cut else 1.0 for j in range(mask.shape[1])] for i in range(mask.shape[0])], **F64
    )
    torch.testing.assert_close(loss, t(ppo) * keep)
    assert m["pg_clipfrac"] == pytest.approx(len(cut) / float(mask.sum()))


@given(loss_inputs(), st.sampled_from([0.01, 0.2, 0.5, 1.0]), st.sampled_from([0.0, 1.0, 3.0]))
def test_kl_cov_matches_loop(inputs, ratio, coef):
    log_prob, old, adv, mask = inputs
    loss, _ = C.kl_cov(log_prob, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    torch.testing.assert_close(loss, t(ref.kl_cov(log_prob, old, adv, mask, ratio, coef)))


def _gmpo_full_graph(log_prob, old, adv, mask, low, high):
    """The paper's sequence loss with the gradient through the whole mean (not the per-token trick)."""
    d = log_prob - old
    s = torch.sign(adv)
    c = s * torch.minimum(s * d, s * d.clamp(-low, high))
    n = mask.sum(-1)
    return -(adv * mask).sum(-1) / n * torch.exp((c * mask).sum(-1) / n)  # [B]


@given(loss_inputs(seq_adv=True), st.sampled_from([(0.4, 0.4), (0.2, 0.28), (1.0, 0.05)]))
def test_geo_mean_matches_loop_and_the_sequence_objective(inputs, clips):
    log_prob, old, adv, mask = inputs
    lp1 = log_prob.clone().requires_grad_(True)
    loss, _ = P.geo_mean(lp1, old, adv, mask, clip_ratio_low=clips[0], clip_ratio_high=clips[1])
    seq = ref.gmpo_seq_losses(log_prob, old, adv, mask, *clips)
    torch.testing.assert_close(loss * mask, t(seq)[:, None] * mask)
    agg = agg_loss(loss, mask, "seq-mean-token-mean")
    agg.backward()
    lp2 = log_prob.clone().requires_grad_(True)
    full = _gmpo_full_graph(lp2, old, adv, mask, *clips).mean()
    full.backward()
    assert float(agg.detach()) == pytest.approx(float(full.detach()), abs=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad)


@given(loss_inputs(seq_adv=True))
def test_luspo_matches_trl_loop(inputs):
    log_prob, old, adv, mask = inputs
    loss, _ = P.luspo(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    expected = ref.luspo_trl(log_prob, old, adv, mask, 0.2, 0.28)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(
        loss, P.gspo(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)[0]
    )


@given(loss_inputs(), st.sampled_from([(2.0, 3.0, 3.0, 2.0), (1.0, 1.0, 0.5, 4.0)]))
def test_vespo_matches_loop(inputs, kl):
    log_prob, old, adv, mask = inputs
    lp = log_prob.clone().requires_grad_(True)
    loss, _ = P.vespo(lp, old, adv, mask, k_pos=kl[0], lambda_pos=kl[1], k_neg=kl[2], lambda_neg=kl[3])
    phi = t(ref.vespo_phi(log_prob, old, adv, mask, *kl))
    torch.testing.assert_close(loss, -phi * adv * log_prob)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -phi * adv)  # phi is a constant: REINFORCE scaled by phi


# ---------------------------------------------------------------- properties
@given(loss_inputs())
def test_on_policy_every_new_loss_is_plain_policy_gradient(inputs):
    """r = 1: kl_cov's penalty |log r| is 0, clip_cov cuts only (some) tokens, vespo's phi(1) = 1, and
    geo_mean / luspo give -A with the policy-gradient direction."""
    _, old, adv, mask = inputs
    for fn in (C.kl_cov, P.vespo):
        lp = old.clone().requires_grad_(True)
        loss, _ = fn(lp, old, adv, mask)
        loss.sum().backward()
        torch.testing.assert_close(lp.grad * mask, -adv * mask)
    loss, _ = C.clip_cov(old, old, adv, mask)
    assert bool(((loss == -adv) | (loss == 0)).all())
    for fn in (P.geo_mean, P.luspo):
        lp = old.clone().requires_grad_(True)
        loss, _ = fn(lp, old, adv, mask)
        expected = (
            -(adv * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True) if fn is P.geo_mean else -adv
        )
        torch.testing.assert_close(loss * mask, expected * mask)


@given(loss_inputs(), st.sampled_from([(2.0, 3.0), (3.0, 2.0), (0.5, 0.1)]))
def test_vespo_weight_is_bounded_by_the_kernel_maximum(inputs, kl):
    """phi(w) = w^k e^{lambda (1 - w)} peaks at w = k / lambda with value (k/lambda)^k e^{lambda - k}."""
    log_prob, old, adv, mask = inputs
    k, lam = kl
    loss, m = P.vespo(log_prob, old, adv, mask, k_pos=k, lambda_pos=lam, k_neg=k, lambda_neg=lam)
    peak = (k / lam) ** k * math.exp(lam - k)
    assert 0.0 <= m["vespo_phi_mean"] <= peak + 1e-12


@given(loss_inputs(), st.sampled_from([0.0002, 0.1, 0.6]))
def test_kl_cov_penalises_exactly_k_tokens(inputs, ratio):
    log_prob, old, adv, mask = inputs
    _, m = C.kl_cov(log_prob, old, adv, mask, kl_cov_ratio=ratio)
    n = float(mask.sum())
    assert m["kl_cov_frac"] * n == pytest.approx(max(1, int(n * ratio)))


# ---------------------------------------------------------------- split invariance
SEQUENCE_LOSSES = [
    (P.geo_mean, "seq-mean-token-mean"),
    (P.luspo, "seq-mean-token-sum"),
    (P.vespo, "token-mean"),
    (P.geo_mean, "token-mean"),
    (P.luspo, "token-mean"),
]


@given(
    loss_inputs(seq_adv=True),
    st.lists(st.integers(1, 4), max_size=3, unique=True),
    st.sampled_from(range(len(SEQUENCE_LOSSES))),
)
def test_split_into_micro_batches_is_exact(inputs, cuts, which):
    """Each sequence's per-token loss depends on that sequence alone, so micro-batches (each padded to
    its own width) with global counts reproduce the full batch's loss and gradient. clip_cov / kl_cov
    need their selection made over the whole mini-batch for that (tested below)."""
    fn, mode = SEQUENCE_LOSSES[which]
    log_prob, old, adv, mask = inputs
    b = log_prob.shape[0]
    full_lp = log_prob.clone().requires_grad_(True)
    full = agg_loss(fn(full_lp, old, adv, mask)[0], mask, mode)
    full.backward()
    tokens, seqs = global_counts(mask)
    lp = log_prob.clone().requires_grad_(True)
    bounds = [0, *sorted(c for c in cuts if c < b), b]
    total = 0.0
    for lo, hi in zip(bounds, bounds[1:]):
        width = int(mask[lo:hi].sum(-1).max())
        piece = fn(lp[lo:hi, :width], old[lo:hi, :width], adv[lo:hi, :width], mask[lo:hi, :width])[0]
        share = agg_loss(piece, mask[lo:hi, :width], mode, global_tokens=tokens, global_seqs=seqs)
        share.backward()
        total += float(share.detach())
    assert total == pytest.approx(float(full.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp.grad, full_lp.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- clip_cov / kl_cov with a mini-batch
# selection
@given(
    loss_inputs(seq_adv=True),
    st.lists(st.integers(1, 4), max_size=3, unique=True),
    st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    st.integers(0, 99),
)
def test_cov_losses_split_exactly_with_a_mini_batch_selection(inputs, cuts, mode, seed):
    """Selected once over the whole mini-batch (then sliced with the rows), the tokens Clip-Cov cuts and
    KL-Cov penalises no longer depend on the micro-batch split: loss and gradient are exact."""
    log_prob, old, adv, mask = inputs
    b = log_prob.shape[0]
    tokens, seqs = global_counts(mask)
    bounds = [0, *sorted(c for c in cuts if c < b), b]
    selections = {
        C.clip_cov: C.clip_cov_selection(
            log_prob,
            adv,
            mask,
            clip_cov_ratio=0.3,
            clip_cov_lb=-1e9,
            clip_cov_ub=1e9,
            generator=torch.Generator().manual_seed(seed),
        ),
        C.kl_cov: C.kl_cov_selection(log_prob, adv, mask, kl_cov_ratio=0.3),
    }
    for fn, sel in selections.items():
        full_lp = log_prob.clone().requires_grad_(True)
        full = agg_loss(fn(full_lp, old, adv, mask, selected=sel)[0], mask, mode)
        full.backward()
        lp = log_prob.clone().requires_grad_(True)
        total = 0.0
        for lo, hi in zip(bounds, bounds[1:]):
            width = int(mask[lo:hi].sum(-1).max())
            piece = fn(
                lp[lo:hi, :width],
                old[lo:hi, :width],
                adv[lo:hi, :width],
                mask[lo:hi, :width],
                selected=sel[lo:hi, :width],
            )[0]
            share = agg_loss(piece, mask[lo:hi, :width], mode, global_tokens=tokens, global_seqs=seqs)
            share.backward()
            total += float(share.detach())
        assert total == pytest.approx(float(full.detach()), rel=1e-10, abs=1e-12)
        torch.testing.assert_close(lp.grad, full_lp.grad, rtol=1e-10, atol=1e-12)


@given(loss_inputs(), st.integers(0, 99))
def test_cov_losses_select_within_the_call_by_default(inputs, seed):
    """Without `selected` the loss draws its own selection from the call's tokens (veRL's behaviour):
    the same as passing the selection functions' result for that call."""
    log_prob, old, adv, mask = inputs
    a, _ = C.kl_cov(log_prob, old, adv, mask, kl_cov_ratio=0.3)
    b, _ = C.kl_cov(
        log_prob, old, adv, mask, selected=C.kl_cov_selection(log_prob, adv, mask, kl_cov_ratio=0.3)
    )
    torch.testing.assert_close(a, b)
    # on-policy nothing is ratio-clipped, so the draw is the selection function's with the same seed
    a, _ = C.clip_cov(
        old,
        old,
        adv,
        mask,
        clip_cov_ratio=0.3,
        clip_cov_lb=-1e9,
        clip_cov_ub=1e9,
        generator=torch.Generator().manual_seed(seed),
    )
    sel = C.clip_cov_selection(
        old,
        adv,
        mask,
        clip_cov_ratio=0.3,
        clip_cov_lb=-1e9,
        clip_cov_ub=1e9,
        generator=torch.Generator().manual_seed(seed),
    )
    b, _ = C.clip_cov(old, old, adv, mask, selected=sel)
    torch.testing.assert_close(a, b)
