"""Rollout correction (TIS, MIS, IcePop, decoupled PPO): hand-worked values, loop references, properties
and split invariance (every output row depends on its own row only)."""

from __future__ import annotations

import math

import _algos_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import AlgoError, agg_loss
from rlkit.algos import rollout_correction as R

F64 = dict(dtype=torch.float64)
settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")

E = math.e


def t(rows):
    return torch.tensor(rows, **F64)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, **F64), torch.as_tensor(b, **F64), atol=tol, rtol=tol)


# row 0: log rho = old - rollout = [1, 0, -2] -> rho = [e, 1, e^-2 = 0.135335]
# row 1: log rho = [-0.2, -0.1, pad] -> rho = [0.818731, 0.904837]
OLD = t([[0.0, -1.0, -2.0], [0.0, 0.0, 0.0]])
ROLLOUT = t([[-1.0, -1.0, 0.0], [0.2, 0.1, 0.0]])
MASK = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RHO = [[E, 1.0, math.exp(-2)], [math.exp(-0.2), math.exp(-0.1), 0.0]]
# mismatch: kl = mean(rollout - old) = (-1 + 0 + 2 + 0.2 + 0.1) / 5 = 0.26
# k3 = mean(rho - log rho - 1) = (e - 2 + 0 + e^-2 + 1 + e^-0.2 - 0.8 + e^-0.1 - 0.9) / 5
K3 = (E - 2 + math.exp(-2) + 1 + math.exp(-0.2) - 0.8 + math.exp(-0.1) - 0.9) / 5
RHO_MEAN = (E + 1 + math.exp(-2) + math.exp(-0.2) + math.exp(-0.1)) / 5


def test_token_tis_hand_worked():
    # cap C = 2: e -> 2 (truncated, 1 of 5 tokens); 1/C = 0.5 > e^-2 (1 of 5 below)
    w, m = R.token_tis(OLD, ROLLOUT, MASK, threshold=2.0)
    close(w, [[2.0, 1.0, math.exp(-2)], [math.exp(-0.2), math.exp(-0.1), 0.0]])
    assert m == pytest.approx(
        {
            "rollout_is_mean": RHO_MEAN,
            "rollout_is_max": E,
            "rollout_is_min": math.exp(-2),
            "rollout_is_ratio_fraction_high": 0.2,
            "rollout_is_ratio_fraction_low": 0.2,
            "kl": 0.26,
            "k3_kl": K3,
        }
    )


def test_seq_tis_hand_worked():
    # products: row 0 e^(1 + 0 - 2) = e^-1 = 0.367879, row 1 e^-0.3 = 0.740818; cap 0.5 truncates row 1 only
    w, m = R.seq_tis(OLD, ROLLOUT, MASK, threshold=0.5)
    close(w, [[math.exp(-1)] * 3, [0.5, 0.5, 0.0]])
    assert m["rollout_is_max"] == pytest.approx(math.exp(-0.3)) and m["rollout_is_min"] == pytest.approx(
        math.exp(-1)
    )
    assert m["rollout_is_ratio_fraction_high"] == 0.5  # one of two sequences above C
    assert m["rollout_is_ratio_fraction_low"] == 1.0  # "low" is below 1/C = 2 (veRL's): both sequences
    # token-weighted
    assert m["rollout_is_mean"] == pytest.approx((3 * math.exp(-1) + 2 * math.exp(-0.3)) / 5)


def test_token_mis_hand_worked():
    # keep lower 0.5 <= rho <= 2: row 0 keeps only rho = 1; row 1 keeps both -> 2 of 5 valid tokens dropped,
    # 1 of 2 sequences touched
    keep, m = R.token_mis(OLD, ROLLOUT, MASK, lower=0.5, upper=2.0)
    close(keep, [[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert (
        m["rollout_rs_masked_fraction"] == pytest.approx(0.4) and m["rollout_rs_seq_masked_fraction"] == 0.5
    )


def test_seq_mis_hand_worked():
    # product ratios e^-1 = 0.368 (< 0.5: dropped) and e^-0.3 = 0.741 (kept)
    keep, m = R.seq_mis(OLD, ROLLOUT, MASK, lower=0.5, upper=2.0)
    close(keep, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert (
        m["rollout_rs_masked_fraction"] == pytest.approx(0.6) and m["rollout_rs_seq_masked_fraction"] == 0.5
    )
    # geometric means e^(-1/3) = 0.717 and e^-0.15 = 0.861 are both inside [0.5, 2]; not inside [0.8, 1.25]
    keep, _ = R.seq_mis(OLD, ROLLOUT, MASK, lower=0.5, upper=2.0, geometric=True)
    close(keep, MASK)
    keep, _ = R.seq_mis(OLD, ROLLOUT, MASK, lower=0.8, upper=1.25, geometric=True)
    close(keep, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])


def test_icepop_hand_worked():
    # [0.5, 5]: e stays (not truncated), e^-2 = 0.135 is dropped (weight 0, not 0.5)
    w, m = R.icepop(OLD, ROLLOUT, MASK, lower=0.5, upper=5.0)
    close(w, [[E, 1.0, 0.0], [math.exp(-0.2), math.exp(-0.1), 0.0]])
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.2)
    assert (
        m["rollout_is_ratio_fraction_low"] == pytest.approx(0.2)
        and m["rollout_is_ratio_fraction_high"] == 0.0
    )


def test_decoupled_hand_worked():
    w, m = R.decoupled(OLD, ROLLOUT, MASK)  # no cap: the plain ratio pi_prox / pi_behav
    close(w, RHO)
    assert m["rollout_rs_masked_fraction"] == 0.0
    w, m = R.decoupled(OLD, ROLLOUT, MASK, cap=2.0)  # AReaL: a weight above the cap is dropped
    close(w, [[0.0, 1.0, math.exp(-2)], [math.exp(-0.2), math.exp(-0.1), 0.0]])
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.2)


def test_decoupled_ppo_clip_hand_worked():
    # token 0: A = 1, pi_theta/pi_prox = e^0.1 = 1.105171 (inside [0.8, 1.2]), pi_prox/pi_behav = 1.4 (< cap
    # 1.5) loss -1.4 * 1.105171 = -1.547240, gradient -1.4 * 1.105171 (the weight scales the PPO gradient)
    # token 1: A = 1, ratio e^0.5 = 1.6487 clipped to 1.2 by the proximal anchor, weight 1 -> -1.2, no
    # gradient token 2: as token 0 but the behaviour weight is 2, over cap 1.5 -> dropped (0, no gradient)
    log_prob = t([[0.1, 0.5, 0.1]]).requires_grad_(True)
    prox = t([[0.0, 0.0, 0.0]])
    behav = t([[-math.log(1.4), 0.0, -math.log(2)]])
    adv = torch.ones(1, 3, **F64)
    mask = torch.ones(1, 3, **F64)
    loss, m = R.decoupled_ppo_clip(log_prob, prox, behav, adv, mask, cap=1.5)
    r = math.exp(0.1)
    close(loss.detach(), [[-1.4 * r, -1.2, 0.0]])
    agg_loss(loss, mask, "token-mean").backward()
    close(log_prob.grad, [[-1.4 * r / 3, 0.0, 0.0]])
    assert m["pg_clipfrac"] == pytest.approx(1 / 3) and m["rollout_rs_masked_fraction"] == pytest.approx(
        1 / 3
    )


def test_metric_names_are_verl_rollout_corr_names():
    ratio = {
        "rollout_is_mean",
        "rollout_is_max",
        "rollout_is_min",
        "rollout_is_ratio_fraction_high",
        "rollout_is_ratio_fraction_low",
        "kl",
        "k3_kl",
    }
    masked = ratio | {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}
    assert set(R.token_tis(OLD, ROLLOUT, MASK)[1]) == set(R.seq_tis(OLD, ROLLOUT, MASK)[1]) == ratio
    for fn in (R.token_mis, R.seq_mis, R.icepop, R.decoupled):
        assert set(fn(OLD, ROLLOUT, MASK)[1]) == masked, fn.__name__


def test_output_kinds_name_every_correction():
    assert set(R.OUTPUT_KINDS) == {name for name, _ in CASES}
    for name, kind in R.OUTPUT_KINDS.items():  # a mask is 0/1 where a weight is a ratio
        out, _ = getattr(R, name)(OLD, ROLLOUT, MASK)
        assert (set(out.unique().tolist()) <= {0.0, 1.0}) == (kind == "mask"), name


def test_bad_parameters_are_explained():
    with pytest.raises(AlgoError, match="threshold"):
        R.token_tis(OLD, ROLLOUT, MASK, threshold=0.0)
    with pytest.raises(AlgoError, match="lower < upper"):
        R.token_mis(OLD, ROLLOUT, MASK, lower=2.0, upper=0.5)
    with pytest.raises(AlgoError, match="cap must be > 0"):
        R.decoupled(OLD, ROLLOUT, MASK, cap=-1.0)
    with pytest.raises(AlgoError, match="no effect with bypass"):
        R.decoupled(OLD, ROLLOUT, MASK, cap=2.0, bypass=True)
    with pytest.raises(AlgoError, match=r"rollout_log_probs must have shape \(2, 3\)"):
        R.icepop(OLD, ROLLOUT[:, :2], MASK)


# ---------------------------------------------------------------- loop references and properties
@st.composite
def corr_inputs(draw):
    b, n = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    old = -torch.rand(b, n, generator=g, **F64) * 4
    scale = draw(st.sampled_from([0.0, 0.05, 0.5, 2.0]))
    rollout = old + torch.randn(b, n, generator=g, **F64) * scale
    lengths = draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    mask = torch.tensor([[1.0] * k + [0.0] * (n - k) for k in lengths], **F64)
    return old, rollout, mask


CASES = [
    ("token_tis", {"threshold": 2.0}),
    ("token_tis", {"threshold": 1.1}),
    ("seq_tis", {"threshold": 2.0}),
    ("seq_tis", {"threshold": 5.0}),
    ("token_mis", {"lower": 0.5, "upper": 2.0}),
    ("token_mis", {"lower": 0.9, "upper": 1.1}),
    ("seq_mis", {"lower": 0.5, "upper": 2.0}),
    ("seq_mis", {"lower": 0.9, "upper": 1.1, "geometric": True}),
    ("icepop", {"lower": 0.5, "upper": 5.0}),
    ("icepop", {"lower": 0.8, "upper": 1.2}),
    ("decoupled", {}),
    ("decoupled", {"cap": 1.5}),
]


@given(corr_inputs(), st.sampled_from(CASES))
def test_matches_loop(inputs, case):
    name, kw = case
    old, rollout, mask = inputs
    out, _ = getattr(R, name)(old, rollout, mask, **kw)
    close(out, ref.correction(name, old, rollout, mask, **kw), tol=1e-9)


@given(corr_inputs(), st.sampled_from(CASES))
def test_outputs_are_constants_on_valid_tokens_only(inputs, case):
    """No gradient flows into the weights; padding is 0; masks are 0/1 inside response_mask; TIS caps."""
    name, kw = case
    old, rollout, mask = inputs
    out, metrics = getattr(R, name)(
        old.clone().requires_grad_(True), rollout.clone().requires_grad_(True), mask, **kw
    )
    assert not out.requires_grad
    assert bool((out[mask == 0] == 0).all()) and bool((out >= 0).all())
    if name.endswith("_mis"):
        assert set(out.unique().tolist()) <= {0.0, 1.0}
    if name.endswith("_tis"):
        assert bool((out <= kw["threshold"]).all())
    if name.startswith("seq_"):  # one value per sequence
        for row, m in zip(out, mask):
            assert len(set(row[m > 0].tolist())) <= 1
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


@given(corr_inputs(), st.sampled_from(CASES))
def test_on_policy_changes_nothing(inputs, case):
    """rollout == old: every weight is 1 and every valid token is kept; the mismatch KL is 0."""
    name, kw = case
    old, _, mask = inputs
    out, metrics = getattr(R, name)(old, old.clone(), mask, **kw)
    close(out, mask)
    assert metrics["kl"] == 0.0 and metrics["k3_kl"] == 0.0
    assert metrics.get("rollout_rs_masked_fraction", 0.0) == 0.0


@given(corr_inputs(), st.sampled_from(CASES), st.lists(st.integers(1, 4), max_size=3, unique=True))
def test_split_into_pieces_is_exact(inputs, case, cuts):
    """Each row depends on its own row only: pieces of the batch (each cut to its own padded width)
    give the same weights as the whole batch."""
    name, kw = case
    old, rollout, mask = inputs
    fn = getattr(R, name)
    whole, _ = fn(old, rollout, mask, **kw)
    b = old.shape[0]
    bounds = [0, *sorted(c for c in cuts if c < b), b]
    for lo, hi in zip(bounds, bounds[1:]):
        width = max(1, int(mask[lo:hi].sum(-1).max()))
        piece, _ = fn(old[lo:hi, :width], rollout[lo:hi, :width], mask[lo:hi, :width], **kw)
        close(piece, whole[lo:hi, :width])


# ---------------------------------------------------------------- bypass (pi_old := pi_rollout)
def test_bypass_ppo_ratio_hand_worked():
    """Bypass: the PPO ratio is pi_theta / pi_rollout. Row 0 (A = +1): ratios 1.1 (inside [0.8, 1.2]) -> -1.1,
    and 1.5 clipped to 1.2 -> -1.2; row 1 (A = -1): ratio 1.5 -> max(1.5, 1.2) = 1.5 (dual clip 3 not
    reached), ratio 0.5 -> max(0.5, 0.8) = 0.8. That is decoupled PPO with pi_prox = pi_behav: every weight is
    1."""
    from rlkit.algos.policy_losses import ppo_clip

    behav = t([[-1.5, -2.0], [-0.5, -1.0]])
    log_prob = behav + t([[math.log(1.1), math.log(1.5)], [math.log(1.5), math.log(0.5)]])
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, **F64)
    loss, _ = ppo_clip(log_prob, behav, adv, mask)
    close(loss, [[-1.1, -1.2], [1.5, 0.8]])
    decoupled, m = R.decoupled_ppo_clip(log_prob, behav, behav, adv, mask)
    close(decoupled, loss)
    assert m["rollout_is_mean"] == 1.0 and m["kl"] == 0.0


@given(corr_inputs(), st.sampled_from([0.1, 1.0, 3.0]))
def test_decoupled_collapses_to_ppo_on_the_behaviour_policy_under_bypass(inputs, spread):
    """For any batch: decoupled's weight with pi_prox = pi_behav is exactly the response mask, so decoupled
    PPO is bit-for-bit ppo_clip(pi_theta / pi_behav) -- what the actor computes when bypass skips the
    weights."""
    from rlkit.algos.policy_losses import ppo_clip

    _, behav, mask = inputs
    g = torch.Generator().manual_seed(int(mask.numel()))
    log_prob = behav + spread * torch.randn(behav.shape, generator=g, **F64)
    adv = torch.randn(behav.shape, generator=g, **F64)
    weights, _ = R.decoupled(behav, behav.clone(), mask)
    assert torch.equal(weights, mask)
    # bypass ignores old_log_prob: weight 1 anyway
    other = behav + torch.randn(behav.shape, generator=g, **F64)
    assert torch.equal(R.decoupled(other, behav, mask, bypass=True)[0], mask)
    plain, _ = ppo_clip(log_prob, behav, adv, mask)
    decoupled, _ = R.decoupled_ppo_clip(log_prob, behav, behav.clone(), adv, mask)
    assert torch.equal(decoupled, plain * mask)
