"""The params models of the newer losses, estimators and rollout corrections match their functions:
same keyword names, same defaults, a description on every field, unknown keys and bad bounds refused."""

from __future__ import annotations

import inspect

import pytest
import torch
from pydantic import ValidationError

from rlkit.algos import cov_losses as C
from rlkit.algos import estimators as E
from rlkit.algos import policy_losses as P
from rlkit.algos import rollout_correction as R
from rlkit.builtin import algo_params as A

PAIRS = [
    (A.ClipCovParams, C.clip_cov),
    (A.KLCovParams, C.kl_cov),
    (A.GeoMeanParams, P.geo_mean),
    (A.LuspoParams, P.luspo),
    (A.VespoParams, P.vespo),
    (A.OptimalTokenBaselineParams, E.optimal_token_baseline),
    (A.TirOptimalTokenBaselineParams, E.tir_optimal_token_baseline),
    (A.TokenTISParams, R.token_tis),
    (A.SeqTISParams, R.seq_tis),
    (A.TokenMISParams, R.token_mis),
    (A.SeqMISParams, R.seq_mis),
    (A.IcePopParams, R.icepop),
    (A.DecoupledParams, R.decoupled),
]
NOT_PARAMS = {
    "generator",
    "selected",
    "values",
    "reward_baselines",
    "old_log_prob",
    "sum_pi_squared",
    "rollout_is_weights",
}


@pytest.mark.parametrize(("model", "fn"), PAIRS, ids=[m.__name__ for m, _ in PAIRS])
def test_fields_are_the_functions_keyword_scalars_with_its_defaults(model, fn):
    keywords = {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in NOT_PARAMS
    }
    assert model().model_dump() == keywords
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
    assert model.model_config.get("extra") == "forbid"


def test_unknown_keys_and_impossible_bounds_are_refused():
    with pytest.raises(ValidationError, match="extra"):
        A.TokenTISParams(cap=2.0)
    with pytest.raises(ValidationError, match="lower"):
        A.TokenMISParams(lower=2.0, upper=1.0)
    with pytest.raises(ValidationError, match="clip_cov_lb"):
        A.ClipCovParams(clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValidationError):
        A.VespoParams(lambda_pos=0.0)


def test_a_validated_model_drives_its_function():
    old = torch.tensor([[0.0, -1.0]])
    rollout = torch.tensor([[-2.0, -1.0]])  # ratio e^2 = 7.39, then 1
    params = A.TokenTISParams.model_validate({"threshold": 3.0})
    weights, _ = R.token_tis(old, rollout, torch.ones(1, 2), **params.model_dump())
    torch.testing.assert_close(weights, torch.tensor([[3.0, 1.0]]))


RECIPE = {
    "model": {"path": "some/model"},
    "data": {"train_files": ["train.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 2},
    "rollout": {"n": 4},
    "algorithm": {"estimator": "grpo"},
}


@pytest.mark.parametrize(
    ("name", "param"),
    [
        ("gmpo", {"clip_ratio_high": 0.1}),
        ("luspo", {"clip_ratio_low": 0.3}),
        ("vespo", {"k_neg": 1.5}),
        ("clip_cov", {"clip_cov_ratio": 0.1}),
        ("kl_cov", {"kl_cov_ratio": 0.1}),
    ],
)
def test_a_recipe_names_each_registered_new_loss_with_its_parameters(name, param):
    """The recipe door: `actor.policy_loss: {name, **params}` validates against the params model and the
    resolved component calls the function with the validated keywords."""
    from rlkit.errors import RecipeError
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe import validate_recipe
    from rlkit.recipe.compose import resolve

    registries = build_registries(make_plugin_manager(entry_points=False))
    raw = {**RECIPE, "actor": {**RECIPE["actor"], "policy_loss": {"name": name, **param}}}
    recipe = validate_recipe(raw, registries=registries, check_files=False)
    resolved, problems = resolve("actor.policy_loss", "policy_losses", recipe.actor.policy_loss, registries)
    assert not problems and resolved.kwargs.items() >= param.items()
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    log_prob = old + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    via_recipe, _ = resolved.fn(log_prob, old, adv, mask, **resolved.kwargs)
    function = getattr(P, resolved.name, None) or getattr(C, resolved.name)  # Clip-Cov, KL-Cov: cov_losses
    direct, _ = function(log_prob, old, adv, mask, **resolved.kwargs)
    torch.testing.assert_close(via_recipe, direct)
    bad = {**RECIPE, "actor": {**RECIPE["actor"], "policy_loss": {"name": name, "no_such_key": 1}}}
    with pytest.raises(RecipeError, match="no_such_key"):
        validate_recipe(bad, registries=registries, check_files=False)


@pytest.mark.parametrize(
    ("loss", "select"),
    [(C.clip_cov, C.clip_cov_mini_batch_selection), (C.kl_cov, C.kl_cov_mini_batch_selection)],
)
def test_clip_cov_and_kl_cov_are_registered_with_a_mini_batch_selection_taking_their_parameters(loss, select):
    """The actor calls the spec's selection with the loss's validated parameters: same keywords, same
    defaults."""
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries

    spec = build_registries(make_plugin_manager(entry_points=False)).policy_losses.get(loss.__name__)
    assert spec.mini_batch_selection.target.endswith(select.__name__)
    keywords = {
        name: p.default
        for name, p in inspect.signature(select).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in NOT_PARAMS
    }
    assert spec.params().model_dump() == keywords
