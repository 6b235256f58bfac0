"""veRL's metric names mean veRL's quantities for clip_cov, kl_cov and geo_mean (issue 26.5).

The references below are plain loops written from the formulas of veRL's ``compute_policy_loss_clip_cov``,
``compute_policy_loss_kl_cov`` and ``compute_policy_loss_geo_mean`` (verl/trainer/ppo/core_algos.py at
v0.7.0-125-gb178a3cd), not its code:

- clip_cov ``actor/pg_clipfrac`` = (tokens whose loss the covariance rule sets to 0) / (valid tokens);
  ``actor/ppo_kl`` = mean over valid tokens of ``old_log_prob - log_prob``.
- kl_cov ``actor/ppo_kl`` = mean over valid tokens of ``|log_prob - old_log_prob|``.
- geo_mean: per sequence, ``c_t = sgn(A_t) min(sgn(A_t) log r_t, sgn(A_t) clip(log r_t, -low, high))``,
  ``rho_i = exp(sum_t m c_t / n_i)``, ``Abar_i = sum_t m A_t / n_i``; loss = mean over sequences of
  ``-Abar_i rho_i``; ``pg_clipfrac`` / ``pg_clipfrac_lower`` = share of valid tokens whose log ratio lies
  outside ``[-low, high]`` with ``A_t > 0`` / ``A_t < 0``. The advantages are per token (they vary within a
  sequence in every case here).

Shapes: ``B`` sequences, ``T`` response tokens; every tensor is [B, T].
"""

from __future__ import annotations

import math

import pytest
import torch

from rlkit.algos import agg_loss
from rlkit.algos import cov_losses as C
from rlkit.algos import policy_losses as P

F64 = dict(dtype=torch.float64)


def t(rows):
    return torch.tensor(rows, **F64)


def _valid(mask):
    return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j] > 0]


def verl_clip_cov_metrics(log_prob, old, adv, mask, low, high):
    """veRL's clip_cov metrics with every candidate cut (clip_cov_ratio 1, bounds that admit every token):
    the candidates are the valid tokens whose ratio clip does not bind."""
    valid = _valid(mask)
    cut = 0
    for i, j in valid:
        ratio = math.exp(float(log_prob[i, j] - old[i, j]))
        a = float(adv[i, j])
        if not (-a * min(max(ratio, 1 - low), 1 + high) > -a * ratio):
            cut += 1
    kl = sum(float(old[i, j] - log_prob[i, j]) for i, j in valid) / len(valid)
    return {"pg_clipfrac": cut / len(valid), "ppo_kl": kl}


def verl_kl_cov_ppo_kl(log_prob, old, mask):
    valid = _valid(mask)
    return sum(abs(float(log_prob[i, j] - old[i, j])) for i, j in valid) / len(valid)


def verl_geo_mean(log_prob, old, adv, mask, low, high):
    """(loss, pg_clipfrac, pg_clipfrac_lower): a loop over sequences and tokens."""
    losses, upper, lower, n_valid = [], 0, 0, 0
    for i in range(mask.shape[0]):
        c_sum, a_sum, n = 0.0, 0.0, 0
        for j in range(mask.shape[1]):
            if mask[i, j] <= 0:
                continue
            n += 1
            log_r, a = float(log_prob[i, j] - old[i, j]), float(adv[i, j])
            clipped = min(max(log_r, -low), high)
            s = (a > 0) - (a < 0)
            c_sum += s * min(s * log_r, s * clipped)
            a_sum += a
            if clipped != log_r:
                upper += a > 0
                lower += a < 0
        losses.append(-(a_sum / n) * math.exp(c_sum / n))
        n_valid += n
    return sum(losses) / len(losses), upper / n_valid, lower / n_valid


# ------------------------------------------------------------------------------------------ hand-worked
def test_clip_cov_pg_clipfrac_is_the_share_cut_by_the_covariance_rule_hand_worked():
    """One row of 4, A = [2, -2, 0.5, -0.5], log_prob = [-1, -3, -2, -2], old = [-1.5, -3, -2, -2]:
    log r = [0.5, 0, 0, 0]; token 0 has r = e^0.5 = 1.65 > 1.2 with A > 0, so the ratio clip binds there
    (ratio_clipfrac 1/4). Covariance (A - 0)(log_prob + 2) = [2, 2, 0, 0]; bounds (1, 5) admit tokens 0, 1;
    token 0 is excluded (clipped), ratio 1.0 asks for 4: token 1 alone is cut, pg_clipfrac = 1/4.
    ppo_kl = mean(old - new) = -0.5 / 4 = -0.125."""
    lp, old = t([[-1.0, -3.0, -2.0, -2.0]]), t([[-1.5, -3.0, -2.0, -2.0]])
    adv, mask = t([[2.0, -2.0, 0.5, -0.5]]), torch.ones(1, 4, **F64)
    _, m = C.clip_cov(lp, old, adv, mask, clip_cov_ratio=1.0, clip_cov_lb=1.0, clip_cov_ub=5.0)
    assert m == pytest.approx({"pg_clipfrac": 0.25, "ratio_clipfrac": 0.25, "ppo_kl": -0.125})
    # bounds (-1e9, 1e9): every unclipped valid token is cut (3 of 4); the ratio clip share stays 1/4
    _, m = C.clip_cov(lp, old, adv, mask, clip_cov_ratio=1.0, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    assert m["pg_clipfrac"] == 0.75 and m["ratio_clipfrac"] == 0.25


def test_kl_cov_ppo_kl_is_the_mean_absolute_log_ratio_hand_worked():
    """log r = [0.5, -0.3, 0, 0] on 4 valid tokens (a fifth is padding with log r = 9):
    ppo_kl = (0.5 + 0.3) / 4 = 0.2 (veRL); ppo_kl_k1 = -(0.5 - 0.3) / 4 = -0.05."""
    old = t([[-1.5, -2.7, -2.0, -2.0, -10.0]])
    lp = t([[-1.0, -3.0, -2.0, -2.0, -1.0]])
    mask = t([[1.0, 1.0, 1.0, 1.0, 0.0]])
    _, m = C.kl_cov(lp, old, t([[2.0, -2.0, 0.5, -0.5, 7.0]]), mask, kl_cov_ratio=0.25)
    assert m["ppo_kl"] == pytest.approx(0.2) and m["ppo_kl_k1"] == pytest.approx(-0.05)
    assert m["kl_cov_frac"] == 0.25


def test_geo_mean_with_advantages_that_vary_within_a_sequence_hand_worked():
    """One row, A = [1, -1], log r = [0.5, -0.6], range [-0.4, 0.4] in log space.
    Token 0 (A > 0): c = min(0.5, 0.4) = 0.4. Token 1 (A < 0): c = -min(0.6, 0.4) = -0.4.
    rho = exp((0.4 - 0.4) / 2) = 1; Abar = 0: loss 0. Both tokens are outside the range: clipfrac 1/2
    (A > 0) and clipfrac_lower 1/2 (A < 0). veRL's loop gives the same numbers."""
    lp, old = t([[0.5, -0.6]]), torch.zeros(1, 2, **F64)
    adv, mask = t([[1.0, -1.0]]), torch.ones(1, 2, **F64)
    per_token, m = P.geo_mean(lp, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    assert float(agg_loss(per_token, mask, "seq-mean-token-mean")) == 0.0
    assert (m["pg_clipfrac"], m["pg_clipfrac_lower"]) == (0.5, 0.5)
    assert verl_geo_mean(lp, old, adv, mask, 0.4, 0.4) == (0.0, 0.5, 0.5)


# ------------------------------------------------------------------------------------------ loops
def _inputs(seed: int, token_level_adv: bool = True):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, **F64) * 3
    log_prob = old + 0.4 * torch.randn(B, T, generator=g, **F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    adv = torch.randn(B, T if token_level_adv else 1, generator=g, **F64).expand(B, T).clone()
    return log_prob, old, adv, mask


@pytest.mark.parametrize("seed", range(6))
def test_clip_cov_metrics_equal_verl_loop(seed):
    log_prob, old, adv, mask = _inputs(seed)
    _, m = C.clip_cov(
        log_prob,
        old,
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_cov_ratio=1.0,
        clip_cov_lb=-1e9,
        clip_cov_ub=1e9,
    )
    want = verl_clip_cov_metrics(log_prob, old, adv, mask, 0.2, 0.28)
    assert m["pg_clipfrac"] == pytest.approx(want["pg_clipfrac"], abs=1e-12)
    assert m["ppo_kl"] == pytest.approx(want["ppo_kl"], abs=1e-12)
    assert m["ratio_clipfrac"] + m["pg_clipfrac"] == pytest.approx(1.0)  # every valid token: clipped or cut


@pytest.mark.parametrize("seed", range(6))
def test_kl_cov_ppo_kl_equals_verl_loop(seed):
    log_prob, old, adv, mask = _inputs(seed)
    _, m = C.kl_cov(log_prob, old, adv, mask, kl_cov_ratio=0.2)
    assert m["ppo_kl"] == pytest.approx(verl_kl_cov_ppo_kl(log_prob, old, mask), abs=1e-12)


@pytest.mark.parametrize("token_level_adv", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_geo_mean_equals_verl_loop_under_seq_mean_token_mean(seed, token_level_adv):
    """veRL averages -Abar_i rho_i over sequences whatever loss_agg_mode says; rlkit's per-token form gives
    the same value (and gradient, against the loop's autograd) under seq-mean-token-mean, with advantages
    that vary within a sequence as with constant ones, and with sequences of unequal length."""
    log_prob, old, adv, mask = _inputs(seed, token_level_adv)
    lp = log_prob.clone().requires_grad_(True)
    per_token, m = P.geo_mean(lp, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    loss = agg_loss(per_token, mask, "seq-mean-token-mean")
    want, upper, lower = verl_geo_mean(log_prob, old, adv, mask, 0.4, 0.4)
    assert float(loss.detach()) == pytest.approx(want, abs=1e-12)
    assert m["pg_clipfrac"] == pytest.approx(upper, abs=1e-12)
    assert m["pg_clipfrac_lower"] == pytest.approx(lower, abs=1e-12)
    loss.backward()
    ref = log_prob.clone().requires_grad_(True)  # the formula in tensors, for its autograd gradient
    sign = torch.sign(adv)
    c = sign * torch.minimum(sign * (ref - old), sign * torch.clamp(ref - old, -0.4, 0.4))
    n = mask.sum(-1)
    (-((adv * mask).sum(-1) / n) * torch.exp((c * mask).sum(-1) / n)).mean().backward()
    torch.testing.assert_close(lp.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_geo_mean_under_token_mean_weights_sequences_by_length():
    """The relation off seq-mean-token-mean (documented in docs/algorithms.md): token-mean gives
    sum_i n_i L_i / sum_i n_i, not veRL's mean_i L_i; equal only when every sequence has the same length."""
    log_prob, old, adv, mask = _inputs(3)
    per_token, _ = P.geo_mean(log_prob, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    seq_loss = per_token[:, 0]  # L_i sits on every valid token of row i (every row has token 0 valid)
    n = mask.sum(-1)
    token_mean = float(agg_loss(per_token, mask, "token-mean"))
    assert token_mean == pytest.approx(float((n * seq_loss).sum() / n.sum()), abs=1e-12)
    verl = verl_geo_mean(log_prob, old, adv, mask, 0.4, 0.4)[0]
    assert len(set(n.tolist())) > 1 and token_mean != pytest.approx(verl)
