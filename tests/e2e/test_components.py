"""Every registered estimator, policy loss and rollout correction through `rlkit run` (issue 26's untested
doors).

The names come from the registry when the tests are collected, so a component registered later (a built-in
or an installed plugin) is covered without an edit here. One component per run, each run as cheap as an honest
run can be: the tiny model, 2 prompts x 2 samples, 6 response tokens, one step, one colocated worker, jsonl
only, no validation (the last step's checkpoint is always written). The graded reward
(tests/fixtures/graded_score.py) makes rewards vary within groups from step 1, so every run has a gradient.

What proves a component ran: an estimator's advantages are finite and the update has a gradient (ReMax: its
greedy baseline phase ran and every baseline is > 0, so each advantage is below its sample's score); a
policy loss logs each of its own metrics (learnt by calling the loss on a small batch), finite and in range; a
rollout correction logs each of its own metrics under ``rollout_corr/`` (learnt the same way), finite.

The full matrix (one run each, 31 runs) is behind the ``e2e`` marker; the default run keeps ``DEFAULT``: ReMax
(its greedy phase runs nowhere else), one policy loss and one rollout correction.
"""

from __future__ import annotations

import math

import pytest
import torch
from rlkit_harness import GRADED_SCORE, recipe_text, records
from rlkit_harness import run as run_rlkit

from rlkit.plugin.registry import build_registries

# what a component needs beside its name to run on the tiny recipe (nothing else is tuned): recipe sections,
# and the component's own parameters
NEEDS: dict[tuple[str, str], dict] = {
    ("estimator", "ppo"): {"critic": {"optim": {"lr": 1.0e-3}, "ppo_micro_batch_size_per_rank": 4}},
    # cuts
    ("policy_loss", "clip_cov"): {"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0},
    ("policy_loss", "kl_cov"): {"kl_cov_ratio": 0.2},
}
# DAPO's overlong shaping starts 64 tokens before the maximum by default: more than the 6 tokens here
REWARD = {("estimator", "dapo"): {"overlong_buffer": {"len": 2}}}
# the graded score is in [0, 1]; DAPO's overlong shaping subtracts up to its penalty_factor (1) from it
SCORE_LOW = {("estimator", "dapo"): -1.0}
DEFAULT = {("estimator", "remax"), ("policy_loss", "kl_cov"), ("rollout_correction", "seq_mis")}
KINDS = {
    "estimator": "estimators",
    "policy_loss": "policy_losses",
    "rollout_correction": "rollout_corrections",
}


def _components() -> list:
    registries = build_registries()
    params = []
    for kind, registry in KINDS.items():
        for name in sorted(registries[registry].names()):
            marks = () if (kind, name) in DEFAULT else (pytest.mark.e2e,)
            params.append(pytest.param(kind, name, id=f"{kind}-{name}", marks=marks))
    return params


def _overrides(kind: str, name: str) -> dict:
    """What names the component (and what it needs) and the graded reward, on top of the tiny base recipe
    (``rlkit_harness.tiny_recipe``: one step, no validation, jsonl only)."""
    need = NEEDS.get((kind, name), {})
    reward = {"custom_score": {"path": str(GRADED_SCORE)}, **REWARD.get((kind, name), {})}
    overrides = {"trainer.experiment_name": "doors", "reward": reward}
    if kind == "estimator":
        return {**overrides, "algorithm.estimator": name, **need}
    if kind == "policy_loss":
        # the whole actor section, as it was before the shared builder: default optimizer and micro-batch
        return {**overrides, "actor": {"policy_loss": {"name": name, **need}}}
    return {**overrides, "algorithm.rollout_correction": {"name": name}}


def _own_metrics(fn, with_advantages: bool) -> set[str]:
    """The metric keys ``fn`` returns on a small batch (its defaults): what the run must log for it."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 3, generator=g)
    new = old + 0.1 * torch.randn(2, 3, generator=g)
    mask = torch.ones(2, 3)
    if with_advantages:
        return set(fn(new, old, torch.tensor([[1.0] * 3, [-1.0] * 3]), mask)[1])
    return set(fn(old, new, mask)[1])


def _check_estimator(name: str, step: dict) -> None:
    assert math.isfinite(step["critic/advantages/mean"])
    assert step["critic/advantages/max"] >= step["critic/advantages/min"]
    if name == "remax":  # A = score - greedy score, every greedy score > 0 (graded): A below every score
        assert step["critic/advantages/max"] < step["critic/score/max"], step
        assert step["critic/advantages/min"] < step["critic/score/min"], step
    if name == "ppo":
        assert math.isfinite(step["critic/vf_loss"]) and "critic/values/mean" in step


def _check_policy_loss(name: str, step: dict, spec) -> None:
    for key in _own_metrics(spec.fn, with_advantages=True):
        value = step[f"actor/{key}"]
        assert math.isfinite(value), (key, value)
        if "clipfrac" in key or key.endswith("_frac"):
            assert 0.0 <= value <= 1.0, (key, value)
        if key in ("ppo_kl", "ppo_kl_k1"):  # one step on-policy: old = new up to float noise
            assert abs(value) < 1e-3, (key, value)
    if name == "clip_cov":
        assert step["actor/pg_clipfrac"] > 0  # tokens were cut by the covariance rule
    if name == "kl_cov":
        assert step["actor/kl_cov_frac"] > 0  # tokens were penalised


def _check_correction(name: str, step: dict, spec) -> None:
    assert step["rollout_corr/bypass"] == 0.0
    own = _own_metrics(spec.fn, with_advantages=False)
    assert own, name
    for key in own:
        assert math.isfinite(step[f"rollout_corr/{key}"]), (key, step[f"rollout_corr/{key}"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("kind", "name"), _components())
def test_component_runs_through_rlkit_run(kind, name, tiny_assets, tmp_path):
    model, data = tiny_assets
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text(model, data, out, _overrides(kind, name)))
    result = run_rlkit("run", str(recipe), timeout=800)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1], steps
    step = steps[0]
    low = SCORE_LOW.get((kind, name), 0.0)
    assert low <= step["critic/score/min"] < step["critic/score/max"] <= 1.0  # graded: rewards vary
    assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"]), step
    assert step["actor/entropy"] > 0
    registries = build_registries()
    if kind == "estimator":
        _check_estimator(name, step)
    elif kind == "policy_loss":
        _check_policy_loss(name, step, registries.policy_losses.get(name))
    else:
        _check_correction(name, step, registries.rollout_corrections.get(name))
