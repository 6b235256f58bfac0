"""Policy losses: hand-worked values and gradients, loop reference, properties."""

from __future__ import annotations

import math

import _algos_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.algos import AlgoError, agg_loss
from rlkit.algos import policy_losses as P

F64 = dict(dtype=torch.float64)
settings.register_profile("algos", max_examples=60, deadline=None)
settings.load_profile("algos")


def t(rows):
    return torch.tensor(rows, **F64)


def test_ppo_clip_hand_worked():
    # token 0: A=+1, r=e^0.5=1.6487 > 1+0.28 -> clipped: -1.28, no gradient
    # token 1: A=-1, r=e^-0.5=0.6065 < 1-0.2 -> max(0.6065, 0.8) = 0.8, clipped, no gradient
    # token 2: A=-1, r=e^2=7.389 -> max(7.389, 1.28) = 7.389 > dual bound c*|A| = 3 -> 3, no gradient
    # token 3: A=+1, r=1 -> -1, gradient -A*r = -1
    old = t([[0.0, 0.0, 0.0, 0.0]])
    log_prob = t([[0.5, -0.5, 2.0, 0.0]]).requires_grad_(True)
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4, **F64)
    loss, m = P.ppo_clip(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, t([[-1.28, 0.8, 3.0, -1.0]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[0.0, 0.0, 0.0, -1.0]]))
    assert m["pg_clipfrac"] == pytest.approx(2 / 4)  # tokens 0 and 1 had L2 > L1 (7.389 > 1.28 for token 2)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 4)  # token 2
    assert m["ppo_kl"] == pytest.approx(-(0.5 - 0.5 + 2.0) / 4)  # mean(old - new)


def test_ppo_clip_rejects_bad_dual_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(AlgoError, match="clip_ratio_c must be > 1"):
        P.ppo_clip(x, x, x, x + 1, clip_ratio_c=1.0)


@st.composite
def loss_inputs(draw):
    b, n = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, n, generator=g, **F64) * 3
    log_prob = old + torch.randn(b, n, generator=g, **F64) * 0.6
    adv = torch.randn(b, n, generator=g, **F64)
    lengths = draw(st.lists(st.integers(1, n), min_size=b, max_size=b))
    mask = torch.tensor([[1.0] * k + [0.0] * (n - k) for k in lengths], **F64)
    return log_prob, old, adv, mask


@given(loss_inputs(), st.sampled_from([(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.5, 1.5)]))
def test_ppo_clip_matches_loop(inputs, clips):
    log_prob, old, adv, mask = inputs
    loss, _ = P.ppo_clip(
        log_prob, old, adv, mask, clip_ratio_low=clips[0], clip_ratio_high=clips[1], clip_ratio_c=clips[2]
    )
    expected = [
        [ref.ppo_clip_token(lp, o, a, *clips) for lp, o, a in zip(*rows)]
        for rows in zip(log_prob.tolist(), old.tolist(), adv.tolist())
    ]
    torch.testing.assert_close(loss, t(expected))


@given(loss_inputs())
def test_ratio_one_gives_minus_mean_advantage(inputs):
    """On-policy (r = 1) under token-mean: ppo_clip and gspo losses are -mean(A) over valid tokens,
    and the gradient per valid token is -A / N (plain policy gradient)."""
    _, old, adv, mask = inputs
    n_tokens = mask.sum()
    for fn in (P.ppo_clip, P.gspo):
        log_prob = old.clone().requires_grad_(True)
        per_token, _ = fn(log_prob, old, adv, mask)
        loss = agg_loss(per_token, mask, "token-mean")
        assert float(loss.detach()) == pytest.approx(float(-(adv * mask).sum() / n_tokens), abs=1e-12)
        loss.backward()
        torch.testing.assert_close(log_prob.grad, -adv * mask / n_tokens)


def test_gspo_uses_the_geometric_mean_ratio():
    # sequence of 2 valid tokens with log ratios 0.1 and -0.3 -> s = exp(-0.1) = 0.904837, inside [0.8, 1.2]
    old = t([[0.0, 0.0, 0.0]])
    log_prob = t([[0.1, -0.3, 5.0]]).requires_grad_(True)  # the padded token must not count
    adv = t([[2.0, 2.0, 2.0]])
    mask = t([[1.0, 1.0, 0.0]])
    loss, _ = P.gspo(log_prob, old, adv, mask)
    s = math.exp(-0.1)
    torch.testing.assert_close(loss[0, :2], t([-2 * s, -2 * s]))
    # gradient of token t: -A * s (straight-through: sg[s] * d log_prob)
    (loss * mask).sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[-2 * s, -2 * s, 0.0]]))


def test_gspo_clips_the_whole_sequence():
    # log ratios 0.5 and 0.5 -> s = e^0.5 = 1.6487 > 1.2 with A > 0 -> every token clipped, zero gradient
    old = torch.zeros(1, 2, **F64)
    log_prob = t([[0.5, 0.5]]).requires_grad_(True)
    loss, m = P.gspo(log_prob, old, torch.ones(1, 2, **F64), torch.ones(1, 2, **F64))
    loss.sum().backward()
    assert torch.count_nonzero(log_prob.grad) == 0 and m["pg_clipfrac"] == 1.0


def test_cispo_hand_worked():
    # r = e^0.5 = 1.6487 clipped to 1.28 (stop-grad); A = 1; log_prob = 0.5 -> loss = -1.28 * 0.5, grad -1.28
    # r = e^-0.1 = 0.9048 in range; A = -2; log_prob = -0.1 -> loss = -0.9048 * -2 * -0.1, grad +1.8097
    old = torch.zeros(1, 2, **F64)
    log_prob = t([[0.5, -0.1]]).requires_grad_(True)
    adv = t([[1.0, -2.0]])
    loss, m = P.cispo(log_prob, old, adv, torch.ones(1, 2, **F64), clip_ratio_low=0.2, clip_ratio_high=0.28)
    w = math.exp(-0.1)
    torch.testing.assert_close(loss, t([[-0.64, -w * 0.2]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[-1.28, 2 * w]]))
    assert m["pg_clipfrac"] == 0.5


def test_gpg_is_plain_policy_gradient():
    log_prob = t([[-1.0, -2.0]]).requires_grad_(True)
    adv = t([[0.5, -1.0]])
    loss, _ = P.gpg(log_prob, log_prob.detach() - 7, adv, torch.ones(1, 2, **F64))
    torch.testing.assert_close(loss, t([[0.5, -2.0]]))  # -A * log_prob, the ratio plays no part
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, -adv)


def test_sapo_hand_worked():
    # r = 1: gate = sigmoid(0) * 4 / tau = 2 / tau; loss = -2A / tau; gradient = -A (f'(1) = 1)
    # r = e^1 with A = 1, tau_pos = 1: gate = sigmoid(e - 1) * 4 = 0.847968 * 4 = 3.391872
    #   gradient = -A * 4 * s (1 - s) * r = -4 * 0.847968 * 0.152032 * e = -1.401786
    old = torch.zeros(1, 3, **F64)
    log_prob = t([[0.0, 0.0, 1.0]]).requires_grad_(True)
    adv = t([[1.0, -1.0, 1.0]])
    loss, m = P.sapo(log_prob, old, adv, torch.ones(1, 3, **F64), tau_pos=1.0, tau_neg=1.05)
    s = 1 / (1 + math.exp(-(math.e - 1)))
    torch.testing.assert_close(loss, t([[-2.0, 2 / 1.05, -4 * s]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, t([[-1.0, 1.0, -4 * s * (1 - s) * math.e]]))
    assert set(m) == {"ppo_kl", "sapo_gate_mean"}


def test_metric_names_are_unprefixed():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3)
    assert set(P.ppo_clip(x, x, x, m)[1]) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert set(P.gspo(x, x, x, m)[1]) == {"pg_clipfrac", "ppo_kl"}
    assert set(P.cispo(x, x, x, m)[1]) == {"pg_clipfrac", "ppo_kl"}
