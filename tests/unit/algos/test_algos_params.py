"""The params models of the issue-16 algorithms match their functions: same keyword names, same defaults,
a description on every field, unknown keys and impossible bounds refused."""

from __future__ import annotations

import inspect

import pytest
import torch
from pydantic import ValidationError

from rlkit.algos import estimators as E
from rlkit.algos import policy_losses as P
from rlkit.algos import rollout_correction as R
from rlkit.builtin import algo_params as A

PAIRS = [
    (A.ClipCovParams, P.clip_cov), (A.KLCovParams, P.kl_cov), (A.GeoMeanParams, P.geo_mean),
    (A.LuspoParams, P.luspo), (A.VespoParams, P.vespo),
    (A.OptimalTokenBaselineParams, E.optimal_token_baseline),
    (A.TirOptimalTokenBaselineParams, E.tir_optimal_token_baseline),
    (A.TokenTISParams, R.token_tis), (A.SeqTISParams, R.seq_tis), (A.TokenMISParams, R.token_mis),
    (A.SeqMISParams, R.seq_mis), (A.IcePopParams, R.icepop), (A.DecoupledParams, R.decoupled),
]
NOT_PARAMS = {"generator", "values", "reward_baselines", "old_log_prob", "sum_pi_squared", "rollout_is_weights"}


@pytest.mark.parametrize(("model", "fn"), PAIRS, ids=[m.__name__ for m, _ in PAIRS])
def test_fields_are_the_functions_keyword_scalars_with_its_defaults(model, fn):
    keywords = {name: p.default for name, p in inspect.signature(fn).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in NOT_PARAMS}
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
    weights, _ = R.token_tis(old, rollout, torch.ones(1, 2), **A.TokenTISParams.model_validate({"threshold": 3.0}).model_dump())
    torch.testing.assert_close(weights, torch.tensor([[3.0, 1.0]]))
