"""Numeric cross-check of the newer losses, estimators and rollout corrections against veRL's and
TRL's own functions.

Not a test (veRL and TRL are not dependencies): it loads the named functions from source files of a
veRL and a TRL checkout with ``ast`` (decorators dropped, ``verl_F`` masked reductions stubbed), runs
both on 200 random batches (float64) and prints the largest absolute difference per quantity::

    python benchmarks/crosscheck_verl_trl.py --core-algos VERL/verl/trainer/ppo/core_algos.py \
        --rollout-corr VERL/verl/trainer/ppo/rollout_corr_helper.py --grpo-trainer
        TRL/trl/trainer/grpo_trainer.py

Recorded results: docs/algorithms.md ("Checked against veRL and TRL").
"""

import argparse
import ast
import math
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch

from rlkit.algos import agg_loss
from rlkit.algos import policy_losses as P
from rlkit.algos import rollout_correction as R
from rlkit.algos import token_baseline as O


def masked_sum(values, mask, axis=None):
    return (values * mask).sum(axis) if axis is not None else (values * mask).sum()


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis) + 1e-8) if axis is not None else s / (mask.sum() + 1e-8)


verl_F = SimpleNamespace(masked_sum=masked_sum, masked_mean=masked_mean)


def load(path, names):
    tree = ast.parse(open(path).read())
    ns = dict(
        torch=torch,
        np=np,
        math=math,
        defaultdict=defaultdict,
        verl_F=verl_F,
        Optional=__import__("typing").Optional,
        Any=__import__("typing").Any,
        ActorConfig=object,
        AlgoConfig=type("AlgoConfig", (), {}),
        SAFETY_BOUND=20.0,
        TOKEN_LEVEL_ROLLOUT_RS_OPTIONS={"token_k1", "token_k2", "token_k3"},
        SUPPORTED_ROLLOUT_RS_OPTIONS={
            "token_k1",
            "token_k2",
            "token_k3",
            "seq_sum_k1",
            "seq_sum_k2",
            "seq_sum_k3",
            "seq_mean_k1",
            "seq_mean_k2",
            "seq_mean_k3",
            "seq_max_k2",
            "seq_max_k3",
        },
    )
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            exec(compile(ast.Module([node], []), path, "exec"), ns)
    return ns


ARGS = argparse.ArgumentParser()
for flag in ("--core-algos", "--rollout-corr", "--grpo-trainer"):
    ARGS.add_argument(flag, required=True)
ARGS = ARGS.parse_args()

V = load(
    ARGS.core_algos,
    {
        "agg_loss",
        "compute_policy_loss_kl_cov",
        "compute_policy_loss_clip_cov",
        "compute_policy_loss_geo_mean",
        "compute_optimal_token_baseline_advantage",
        "compute_multi_turn_optimal_token_baseline_advantage",
    },
)
RC = load(
    ARGS.rollout_corr,
    {
        "compute_rollout_correction_weights",
        "compute_is_metrics",
        "compute_rollout_rejection_mask",
        "_parse_rollout_rs_thresholds",
        "compute_rs_metrics",
        "compute_offpolicy_metrics",
    },
)

torch.manual_seed(0)
np.random.seed(0)
worst = {}


def rec(name, a, b):
    d = float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())
    worst[name] = max(worst.get(name, 0.0), d)


for trial in range(200):
    B, T = np.random.randint(2, 7), np.random.randint(2, 8)
    old = -torch.rand(B, T, dtype=torch.float64) * 3
    lp = old + 0.4 * torch.randn(B, T, dtype=torch.float64)
    lengths = np.random.randint(1, T + 1, size=B)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    seq_adv = torch.randn(B, 1, dtype=torch.float64).expand(B, T).clone()
    tok_adv = torch.randn(B, T, dtype=torch.float64)
    cfg = SimpleNamespace(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        global_batch_info={},
        policy_loss=SimpleNamespace(
            kl_cov_ratio=0.2, ppo_kl_coef=1.0, clip_cov_ratio=0.5, clip_cov_lb=-1e9, clip_cov_ub=1e9
        ),
    )
    # kl_cov: token-mean loss and per-token via gradient
    a = tok_adv
    l1 = lp.clone().requires_grad_(True)
    vl, vm = V["compute_policy_loss_kl_cov"](old, l1, a, mask, "token-mean", cfg)
    l2 = lp.clone().requires_grad_(True)
    pt, m = P.kl_cov(l2, old, a, mask, kl_cov_ratio=0.2, ppo_kl_coef=1.0)
    rl = agg_loss(pt, mask, "token-mean")
    rec("kl_cov loss", vl.detach(), rl.detach())
    vl.backward()
    rl.backward()
    rec("kl_cov grad", l1.grad, l2.grad)
    rec("kl_cov ppo_kl", vm["actor/ppo_kl"], m["ppo_kl"])
    # clip_cov with every valid unclipped token a candidate and ratio 1.0: deterministic (all candidates cut)
    cfg.policy_loss.clip_cov_ratio = 1.0
    vl, vm = V["compute_policy_loss_clip_cov"](old, lp, a, mask, "token-mean", cfg)
    pt, m = P.clip_cov(
        lp,
        old,
        a,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_cov_ratio=1.0,
        clip_cov_lb=-1e9,
        clip_cov_ub=1e9,
    )
    rec("clip_cov loss", vl, agg_loss(pt, mask, "token-mean"))
    rec("clip_cov pg_clipfrac", vm["actor/pg_clipfrac"], m["pg_clipfrac"])
    # geo_mean: veRL mean over B == seq-mean-token-mean when no empty sequences
    cfg.clip_ratio_low = cfg.clip_ratio_high = 0.4
    l1 = lp.clone().requires_grad_(True)
    vl, vm = V["compute_policy_loss_geo_mean"](old, l1, seq_adv, mask, "token-mean", cfg)
    l2 = lp.clone().requires_grad_(True)
    pt, m = P.geo_mean(l2, old, seq_adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    rl = agg_loss(pt, mask, "seq-mean-token-mean")
    rec("geo_mean loss", vl.detach(), rl.detach())
    vl.backward()
    rl.backward()
    rec("geo_mean grad", l1.grad, l2.grad)
    rec("geo_mean clipfrac", vm["actor/pg_clipfrac"], m["pg_clipfrac"])
    rec("geo_mean clipfrac_lower", vm["actor/pg_clipfrac_lower"], m["pg_clipfrac_lower"])
    # OTB / TIR-OTB, with holes for TIR
    G = np.random.randint(1, 4)
    index = np.random.randint(0, G, size=B)
    rewards = torch.randint(-1, 3, (B, T)).double() * (torch.rand(B, T) < 0.4)
    sumsq = torch.exp(old) ** 2 + torch.rand(B, T, dtype=torch.float64) * 0.3
    isw = torch.rand(B, T, dtype=torch.float64) * 2 if trial % 2 else None
    holes = (torch.rand(B, T) < 0.8).double()
    for zt in (False, True):
        va, vr = V["compute_optimal_token_baseline_advantage"](rewards, mask, index, old, sumsq, isw, zt)
        ra, rr = O.compute_optimal_token_baseline_advantage(
            rewards, mask, torch.tensor(index), old, sumsq, isw, zt
        )
        rec("otb adv", va, ra)
        rec("otb ret", vr, rr)
        va, vr = V["compute_multi_turn_optimal_token_baseline_advantage"](
            rewards, holes, index, old, sumsq, isw, zt
        )
        ra, rr = O.compute_tir_optimal_token_baseline_advantage(
            rewards, holes, torch.tensor(index), old, sumsq, isw, zt
        )
        rec("tir_otb adv", va, ra)
        rec("tir_otb ret", vr, rr)
    # rollout correction
    ro = old + 0.5 * torch.randn(B, T, dtype=torch.float64)
    lr = old - ro
    for level, fn in (("token", R.token_tis), ("sequence", R.seq_tis)):
        vw, vm = RC["compute_rollout_correction_weights"](lr, mask, level, 2.0)
        rw, m = fn(old, ro, mask, threshold=2.0)
        rec(f"{level} tis weights", vw, rw)
        rec(f"{level} tis mean", vm["rollout_is_mean"], m["rollout_is_mean"])
        if level == "token":
            rec("token tis max", vm["rollout_is_max"], m["rollout_is_max"])
            rec("token frac_high", vm["rollout_is_ratio_fraction_high"], m["rollout_is_ratio_fraction_high"])
    for opt, fn, kw in (
        ("token_k1", R.token_mis, {}),
        ("seq_sum_k1", R.seq_mis, {}),
        ("seq_mean_k1", R.seq_mis, {"geometric": True}),
    ):
        vmask, vm = RC["compute_rollout_rejection_mask"](lr, mask, opt, "0.5_2.0")
        rmask, m = fn(old, ro, mask, lower=0.5, upper=2.0, **kw)
        rec(f"mis {opt} mask", vmask, rmask)
        rec(f"mis {opt} masked_fraction", vm["rollout_rs_masked_fraction"], m["rollout_rs_masked_fraction"])
    vm = RC["compute_offpolicy_metrics"](old, ro, mask)
    m = R.mismatch_metrics(old, ro, mask)
    rec("kl", vm["kl"], m["kl"])
    rec("k3_kl", vm["k3_kl"], m["k3_kl"])

for k, v in worst.items():
    print(f"{k:32s} max |diff| = {v:.2e}")

# ---- TRL: VESPO's gamma weights
tree = ast.parse(open(ARGS.grpo_trainer).read())
ns = {"torch": torch, "math": math}
for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef) and node.name == "get_gamma_weights":
        node.decorator_list = []
        exec(compile(ast.Module([node], []), ARGS.grpo_trainer, "exec"), ns)
worst_vespo = 0.0
for trial in range(300):
    B, T = torch.randint(1, 6, ()).item(), torch.randint(1, 8, ()).item()
    old = -torch.rand(B, T, dtype=torch.float64) * 3
    lp = old + 0.3 * torch.randn(B, T, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    adv = torch.randn(B, 1, dtype=torch.float64)
    phi = ns["get_gamma_weights"](adv, lp - old, mask, None, 2.0, 3.0, 3.0, 2.0)  # (B, 1)
    trl_loss = -phi * adv * lp  # TRL's per_token_loss for vespo
    ours, _ = P.vespo(lp, old, adv.expand(B, T), mask)
    worst_vespo = max(worst_vespo, float(((trl_loss - ours) * mask).abs().max()))
print(f"{'vespo loss vs TRL':32s} max |diff| = {worst_vespo:.2e}")
