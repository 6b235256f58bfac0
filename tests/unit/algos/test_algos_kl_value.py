"""KL estimators and controllers, KL-in-reward, and the clipped value loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlkit.algos import (
    AdaptiveKLController,
    AlgoError,
    FixedKLController,
    apply_kl_penalty,
    compute_value_loss,
    kl_penalty,
    make_kl_controller,
)

F64 = dict(dtype=torch.float64)
LN2 = math.log(2)


@pytest.mark.parametrize(
    ("kind", "value", "grad"),
    [
        # d = log 0.5 - log 0.25 = ln 2
        ("k1", LN2, 1.0),
        ("kl", LN2, 1.0),
        ("abs", LN2, 1.0),
        ("k2", 0.5 * LN2**2, LN2),  # d^2 / 2, gradient d
        ("mse", 0.5 * LN2**2, LN2),
        ("k3", 0.5 + LN2 - 1, 1 - 0.5),  # exp(-d) + d - 1 = 0.5 + 0.6931 - 1; gradient 1 - exp(-d)
        ("low_var_kl", 0.5 + LN2 - 1, 0.5),
        ("k1+", LN2, LN2),  # value of k1, gradient of k2
        ("k3+", 0.5 + LN2 - 1, LN2),  # value of k3, gradient of k2
    ],
)
def test_kl_values_and_gradients(kind, value, grad):
    log_prob = torch.tensor([[math.log(0.5)]], **F64).requires_grad_(True)
    ref = torch.tensor([[math.log(0.25)]], **F64)
    kl = kl_penalty(log_prob, ref, kind)
    assert kl.shape == (1, 1) and float(kl.detach()) == pytest.approx(value, abs=1e-12)
    kl.sum().backward()
    assert float(log_prob.grad) == pytest.approx(grad, abs=1e-12)


def test_k3_is_clamped_like_verl():
    # d = -30: -d = 30 is clamped to 20 first, then exp(20) - 20 - 1 is clamped to 10
    kl = kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3")
    assert float(kl) == 10.0
    with pytest.raises(AlgoError, match="Valid: k1"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(AlgoError, match="straight-through"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "abs+")


def test_controllers_follow_verls_rule():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    # current 0.1 vs target 0.05 -> error 1 clipped to 0.2; mult = 1 + 0.2 * 10 / 100 = 1.02
    adaptive = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    adaptive.update(0.1, 10)
    assert adaptive.value == pytest.approx(0.102)
    # current 0.04 vs 0.05 -> error -0.2; mult = 1 - 0.2 * 50 / 100 = 0.9
    adaptive.update(0.04, 50)
    assert adaptive.value == pytest.approx(0.102 * 0.9)
    assert isinstance(make_kl_controller("adaptive", 0.1, 0.05, 100), AdaptiveKLController)
    with pytest.raises(AlgoError, match="Valid: fixed, adaptive"):
        make_kl_controller("pid", 0.1)


def test_apply_kl_penalty_hand_worked():
    # k1 per token: row 0 = [0.2, 0.4], row 1 = [0.6, pad]; beta = 0.5
    # rewards = scores - 0.5 * kl * mask; batch kl = mean(mean(0.2, 0.4), 0.6) = mean(0.3, 0.6) = 0.45
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]], **F64)
    old = torch.tensor([[0.2, 0.4], [0.6, 9.0]], **F64)
    ref = torch.zeros(2, 2, **F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], **F64)
    ctrl = AdaptiveKLController(0.5, target_kl=0.45, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8], [1.7, 0.0]], **F64))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.45)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == pytest.approx(0.5)  # kl on target -> error 0 -> unchanged


def test_value_loss_hand_worked():
    # token 0: v=1.0, V_old=0, R=2, clip 0.5 -> clipped v = 0.5: (1-2)^2 = 1 vs (0.5-2)^2 = 2.25 -> 2.25
    # (clipped) token 1: v=0.2, V_old=0, R=0 -> inside the range: 0.04 both -> 0.04 loss = 0.5 *
    # token-mean(2.25, 0.04) = 0.5 * 1.145 = 0.5725; vf_clipfrac = 1/2
    vpreds = torch.tensor([[1.0, 0.2]], **F64).requires_grad_(True)
    values = torch.zeros(1, 2, **F64)
    returns = torch.tensor([[2.0, 0.0]], **F64)
    loss, metrics = compute_value_loss(vpreds, values, returns, torch.ones(1, 2, **F64), 0.5)
    assert float(loss.detach()) == pytest.approx(0.5725)
    assert metrics["vf_clipfrac"] == 0.5
    loss.backward()
    # token 0's loss comes from the clipped branch (no gradient); token 1: 0.5 * 2 * 0.2 / 2 = 0.1
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.1]], **F64))
    half, _ = compute_value_loss(
        vpreds[:, :1], values[:, :1], returns[:, :1], torch.ones(1, 1, **F64), 0.5, global_tokens=2
    )
    assert float(half.detach()) == pytest.approx(0.5 * 2.25 / 2)  # global count reaches agg_loss
