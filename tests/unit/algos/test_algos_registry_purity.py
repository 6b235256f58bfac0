"""Every built-in estimator and policy loss is registered and callable with the one signature;
rlkit.algos imports only torch, the standard library and rlkit.errors."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlkit.algos
from rlkit.algos.estimators import EstimatorInputs
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.recipe.compose import params_model, resolve

ESTIMATORS = [
    "ppo",
    "gae",
    "grpo",
    "dr_grpo",
    "dapo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]
LOSSES = ["ppo_clip", "gspo", "cispo", "gpg", "sapo", "geo_mean", "luspo", "vespo", "clip_cov", "kl_cov"]
# values for every parameter a built-in's params model declares (algorithm.estimator.* / actor.policy_loss.*)
ALGORITHM_KEYS = {
    "gamma": 1.0,
    "lam": 0.95,
    "norm_adv_by_std": True,
    "epsilon": 1e-6,
    "handle_zero_tail": True,
}
ACTOR_KEYS = {
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "k_pos": 2.0,
    "lambda_pos": 3.0,
    "k_neg": 3.0,
    "lambda_neg": 2.0,
    "clip_cov_ratio": 0.1,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.1,
    "ppo_kl_coef": 1.0,
}


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


def small_batch(b=6, t=4):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(b, t)
    mask[1, 3:] = 0
    mask[4, 2:] = 0
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), mask.sum(-1).long() - 1] = torch.randint(0, 2, (b,), generator=g).float()
    index = torch.tensor([11, 11, 11, 5, 5, 5])
    return rewards, mask, index, torch.randn(b, t, generator=g), torch.rand(b, generator=g)


def estimator_inputs(spec, rewards, mask, index, values, baselines) -> EstimatorInputs:
    """What the advantage phase hands ``spec`` 's estimator for ``small_batch`` 's tensors: only the optional
    inputs the spec declares (critic values, greedy baselines, OTB's old log-probs and sum of pi²)."""
    otb = (
        {"old_log_prob": -values.abs() * mask, "sum_pi_squared": 0.5 * mask}
        if spec.needs_sum_pi_squared
        else {}
    )
    return EstimatorInputs(
        rewards,
        mask,
        index,
        values=values if spec.needs_critic else None,
        reward_baselines=baselines if spec.needs_greedy_baseline else None,
        **otb,
    )


def fields(spec) -> set[str]:
    model = params_model(spec)
    return set(model.model_fields) if model is not None else set()


def resolved(registries, key, kind, name, values):
    """The component as the driver resolves it, with this test's value for each of its parameters."""
    spec = registries[kind].get(name)
    component, problems = resolve(
        key, kind, {"name": name, **{k: values[k] for k in fields(spec)}}, registries
    )
    assert not problems, problems
    return component


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_registered_and_callable(registries, name):
    spec = registries.estimators.get(name)
    assert fields(spec) <= set(ALGORITHM_KEYS), f"{name} has a parameter this test does not know"
    names = list(inspect.signature(spec.fn).parameters)
    assert set(names[1:]) == fields(spec)  # one inputs object, then exactly its parameters
    est = resolved(registries, "algorithm.estimator", "estimators", name, ALGORITHM_KEYS)
    assert est.kwargs == {k: ALGORITHM_KEYS[k] for k in fields(spec)}
    rewards, *_ = batch = small_batch()
    adv, ret = est.fn(estimator_inputs(spec, *batch), **est.kwargs)
    assert adv.shape == ret.shape == rewards.shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert spec.paper and spec.description


@pytest.mark.parametrize("name", LOSSES)
def test_policy_loss_registered_and_callable(registries, name):
    spec = registries.policy_losses.get(name)
    assert fields(spec) <= set(ACTOR_KEYS), f"{name} has a parameter this test does not know"
    loss = resolved(registries, "actor.policy_loss", "policy_losses", name, ACTOR_KEYS)
    rewards, mask, _, noise, _ = small_batch()
    old = -torch.rand(rewards.shape)
    log_prob = (old + 0.1 * noise).requires_grad_(True)
    per_token, metrics = loss.fn(log_prob, old, noise, mask, **loss.kwargs)
    assert per_token.shape == rewards.shape and isinstance(metrics, dict)
    assert all(isinstance(v, float) and "/" not in k for k, v in metrics.items())
    rlkit.algos.agg_loss(per_token, mask, "token-mean").backward()
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()


def test_what_the_specs_declare(registries):
    est = registries.estimators
    assert est.get("gae") is est.get("ppo") and est.get("ppo").needs_critic
    assert est.get("remax").needs_greedy_baseline
    assert all(
        est.get(n).needs_groups
        for n in [
            "grpo",
            "dapo",
            "dr_grpo",
            "rloo",
            "opo",
            "gpg",
            "grpo_passk",
            "reinforce_plus_plus_baseline",
        ]
    )
    assert dict(est.get("dapo").recipe_defaults) == {
        "actor.policy_loss.clip_ratio_low": 0.2,
        "actor.policy_loss.clip_ratio_high": 0.28,
        "actor.loss_agg_mode": "token-mean",
        "algorithm.filter_groups.enable": True,
        "reward.overlong_buffer.enable": True,
    }
    assert dict(est.get("dr_grpo").recipe_defaults) == {"actor.loss_agg_mode": "seq-mean-token-sum-norm"}
    # Dr. GRPO's own default lives in its params model: no std division
    assert params_model(est.get("dr_grpo"))().norm_adv_by_std is False
    assert params_model(est.get("grpo"))().norm_adv_by_std is True
    assert sorted(registries.policy_losses.names()) == sorted(LOSSES)
    assert registries.policy_losses.get("gmpo") is registries.policy_losses.get("geo_mean")


def test_dr_grpo_through_its_defaults_is_unscaled(registries):
    rewards, mask, index, _, _ = small_batch()
    est, problems = resolve("algorithm.estimator", "estimators", "dr_grpo", registries)
    assert not problems and est.kwargs == {"norm_adv_by_std": False, "epsilon": 1e-6}
    adv, _ = est.fn(EstimatorInputs(rewards, mask, index), **est.kwargs)
    mean = torch.stack([rewards[index == g].sum(-1).mean() for g in index.tolist()])
    torch.testing.assert_close(adv[:, 0], rewards.sum(-1) - mean)


def test_registering_the_algorithms_does_not_import_torch():
    """`rlkit plugins` / `rlkit validate` stay fast: the specs hold lazy references to rlkit.algos."""
    code = (
        "import sys, rlkit.builtin.algorithms as m; "
        "m.rlkit_register_estimators();m.rlkit_register_policy_losses(); "
        "m.rlkit_register_rollout_corrections(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


ALGOS_DIR = Path(rlkit.algos.__file__).parent
ALLOWED_ROOTS = {"torch", "rlkit"}


def test_algos_sources_import_only_torch_stdlib_and_errors():
    for path in sorted(ALGOS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                ok = (
                    root in sys.stdlib_module_names
                    or root == "torch"
                    or name == "rlkit.errors"
                    or name == "rlkit.algos"
                    or name.startswith("rlkit.algos.")
                )
                assert ok, (
                    f"{path.name} imports {name}: rlkit.algos may import only torch, stdlib, rlkit.errors"
                )


def test_importing_algos_adds_no_third_party_module():
    """In a fresh interpreter: after `import torch, rlkit`, importing rlkit.algos adds only rlkit.algos,
    torch submodules and stdlib modules (numpy is imported by torch itself, so it is checked statically
    above); never transformers, ray, pydantic, etc."""
    code = (
        "import sys, json, torch, rlkit; before = set(sys.modules); import rlkit.algos;"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    added = json.loads(out.stdout)
    bad = [
        m
        for m in added
        if m.split(".")[0] not in sys.stdlib_module_names
        and m.split(".")[0] != "torch"
        and not (m == "rlkit.algos" or m.startswith("rlkit.algos."))
        and m != "rlkit.errors"
    ]
    assert not bad, f"importing rlkit.algos pulled in {bad}"
    assert "rlkit.algos" in added
