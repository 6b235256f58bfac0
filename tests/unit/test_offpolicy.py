"""The rollout-correction door and phase: recipe key → registry → pipeline; the driver-side phase
(``rlkit.step.correction``) and its mismatch metrics; validation refuses a correction a backend cannot
feed."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

import rlkit
from rlkit.algos import rollout_correction as R
from rlkit.batch import Batch
from rlkit.errors import RecipeError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.plugin.specs import RolloutBackendSpec
from rlkit.recipe import recipe_to_dict, validate_recipe
from rlkit.recipe.compose import compose
from rlkit.step.correction import correct_rollout, loss_batch

RAW = {
    "model": {"path": "m"},
    "data": {"train_files": ["t.parquet"], "train_batch_size": 4},
    "rollout": {"n": 2},
}


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


def validate(registries, *overrides):
    return validate_recipe(RAW, list(overrides), registries=registries, check_files=False)


def test_off_by_default_and_on_by_name_with_parameters(registries):
    assert validate(registries).algorithm.rollout_correction is None
    assert compose(validate(registries), registries).rollout_correction is None
    recipe = validate(registries, "algorithm.rollout_correction={name: token_tis, threshold: 3.0}")
    assert recipe_to_dict(recipe)["algorithm"]["rollout_correction"] == {
        "name": "token_tis",
        "threshold": 3.0,
    }
    pipeline = pickle.loads(pickle.dumps(compose(recipe, registries)))  # what the trainer holds
    assert pipeline.rollout_correction.kwargs == {"threshold": 3.0}
    assert pipeline.rollout_correction.spec.output == "weights"
    short = compose(
        validate(registries, "algorithm.rollout_correction=seq_mis"), registries
    ).rollout_correction
    assert short.kwargs == {"lower": 0.5, "upper": 2.0, "geometric": False}  # defaults from the params model


def test_bad_names_and_parameters_are_recipe_errors(registries):
    with pytest.raises(RecipeError) as info:
        validate(
            registries,
            "algorithm.rollout_correction={name: token_tsi}",
        )
    assert "Did you mean 'token_tis'?" in str(info.value)
    with pytest.raises(RecipeError) as info:
        validate(registries, "algorithm.rollout_correction={name: icepop, lower: 6.0}")
    assert "lower (6.0) must be below upper" in str(info.value)


class _NoLogProbBackend:
    @rlkit.hookimpl
    def rlkit_register_rollout_backends(self):
        return [RolloutBackendSpec(name="blind", cls="rlkit.rollout.hf:HFRollout", rollout_log_probs=False)]


def test_a_backend_without_rollout_log_probs_refuses_a_correction():
    registries = build_registries(
        make_plugin_manager(entry_points=False, extra_plugins=(("blind", _NoLogProbBackend()),))
    )
    validate(registries, "rollout.backend=blind")  # fine without a correction
    with pytest.raises(RecipeError) as info:
        validate(registries, "rollout.backend=blind", "algorithm.rollout_correction=token_tis")
    found = dict(info.value.problems)["algorithm.rollout_correction"]
    assert "'blind' does not return rollout_log_probs" in found


def test_every_correction_spec_says_what_its_function_returns(registries):
    assert {e.spec.name: e.spec.output for e in registries.rollout_corrections} == R.OUTPUT_KINDS
    assert all(e.spec.paper and e.spec.description for e in registries.rollout_corrections)


def test_rlkit_plugins_lists_the_corrections():
    """What `rlkit plugins --json` prints (its ``collect``; the command itself is tested in test_cli.py)."""
    from rlkit.cli.plugins import collect

    listed = {e["name"]: e["params"] for e in collect()["registries"]["rollout_corrections"]}
    assert set(listed) == set(R.OUTPUT_KINDS)
    assert "threshold" in json.dumps(listed["token_tis"])


def _batch():
    # rho = pi_old / pi_rollout per token: row 0 [e^0.5, 1, pad], row 1 [e^-1, e^2, 1]
    old = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -0.5, -1.0]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0], [-2.0, -2.5, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return Batch({"old_log_prob": old, "rollout_log_probs": rollout, "response_mask": mask})


def test_mismatch_metrics_hand_worked():
    _, metrics = correct_rollout(_batch(), None)
    p = [math.exp(x) for x in (-1.5, -2.0, -2.0, -2.5, -1.0)]  # rollout probabilities of the 5 valid tokens
    q = [math.exp(x) for x in (-1.0, -2.0, -3.0, -0.5, -1.0)]
    d = [abs(a - b) for a, b in zip(p, q, strict=True)]
    mean = sum(d) / 5
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(mean)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(max(d))
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(
        math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    )
    # k1: mean(log pi_rollout - log pi_old) = (-0.5 + 0 + 1 - 2 + 0) / 5
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.3)
    k3 = [math.exp(r) - r - 1 for r in (0.5, 0.0, -1.0, 2.0, 0.0)]
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(sum(k3) / 5)
    corr = torch.corrcoef(torch.tensor([p, q], dtype=torch.float64))[0, 1]
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(float(corr))


def test_mismatch_stats_of_pieces_add_up_to_the_whole():
    """The actor's fast path sums per-micro-batch statistics over ranks: the same metrics as one pass."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(7, 5, generator=g) * 3
    rollout = old + 0.2 * torch.randn(7, 5, generator=g)
    mask = (torch.rand(7, 5, generator=g) > 0.3).long()
    whole = R.mismatch_stats(old, rollout, mask)
    parts = [R.mismatch_stats(old[r], rollout[r], mask[r]) for r in (slice(0, 2), slice(2, 3), slice(3, 7))]
    summed = torch.stack(parts).sum(0)
    summed[-1] = max(p[-1] for p in parts)
    assert R.mismatch_from_stats(summed) == pytest.approx(R.mismatch_from_stats(whole))


def test_a_weights_correction_adds_weights_and_a_mask_correction_a_loss_mask(registries):
    recipe = validate(registries, "algorithm.rollout_correction={name: token_tis, threshold: 2.0}")
    batch, metrics = correct_rollout(_batch(), compose(recipe, registries).rollout_correction)
    # weights min(rho, 2): [e^0.5 -> 1.6487, 1, 0], [e^-1 -> 0.3679, e^2 -> 2 (truncated), 1]
    torch.testing.assert_close(
        batch["rollout_is_weights"], torch.tensor([[math.exp(0.5), 1.0, 0.0], [math.exp(-1.0), 2.0, 1.0]])
    )
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(2.0))
    assert loss_batch(batch) is batch  # weights leave the mask alone
    recipe = validate(registries, "algorithm.rollout_correction={name: token_mis, lower: 0.5, upper: 2.0}")
    batch, metrics = correct_rollout(_batch(), compose(recipe, registries).rollout_correction)
    # kept where 0.5 <= rho <= 2: e^0.5 = 1.65 yes, 1 yes; e^-1 = 0.37 no, e^2 no, 1 yes
    assert batch["rollout_rs_mask"].tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert loss_batch(batch)["response_mask"].tolist() == [[1, 1, 0], [0, 0, 1]]
    # the rest of the step keeps the rollout's
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_no_rollout_log_probs_no_metrics():
    batch = Batch({"old_log_prob": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)})
    assert correct_rollout(batch, None) == (batch, {})


def test_decoupled_correction_with_ppo_clip_is_decoupled_ppo(registries):
    """The actor multiplies ppo_clip(pi_theta / pi_old) by the correction's weights: with ``decoupled`` that
    is decoupled PPO (pi_old the proximal clip anchor, pi_rollout the behaviour IS anchor)."""
    from rlkit.algos.policy_losses import ppo_clip

    recipe = validate(registries, "algorithm.rollout_correction={name: decoupled, cap: 5.0}")
    batch, _ = correct_rollout(_batch(), compose(recipe, registries).rollout_correction)
    g = torch.Generator().manual_seed(0)
    log_prob = batch["old_log_prob"] + 0.3 * torch.randn(2, 3, generator=g)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    per_token, _ = ppo_clip(log_prob, batch["old_log_prob"], adv, batch["response_mask"])
    expected, _ = R.decoupled_ppo_clip(
        log_prob, batch["old_log_prob"], batch["rollout_log_probs"], adv, batch["response_mask"], cap=5.0
    )
    torch.testing.assert_close(per_token * batch["rollout_is_weights"], expected)
    # the behaviour weight e^2 = 7.39 of row 1, token 1 is above the cap: that token is dropped (weight 0)
    assert batch["rollout_is_weights"][1, 1] == 0


# ---------------------------------------------------------------- bypass mode
def test_bypass_is_a_decoupled_parameter(registries):
    from rlkit.step.correction import bypass_on

    recipe = validate(registries, "algorithm.rollout_correction={name: decoupled, bypass: true}")
    assert recipe_to_dict(recipe)["algorithm"]["rollout_correction"] == {
        "name": "decoupled",
        "cap": None,
        "bypass": True,
    }
    corr = pickle.loads(pickle.dumps(compose(recipe, registries))).rollout_correction
    assert bypass_on(corr) and corr.kwargs == {"cap": None, "bypass": True}
    off = compose(
        validate(registries, "algorithm.rollout_correction={name: decoupled, cap: 5.0}"), registries
    )
    assert not bypass_on(off.rollout_correction) and not bypass_on(None)
    assert [e.spec.name for e in registries.rollout_corrections if e.spec.bypass] == ["decoupled"]


def test_bypass_uses_the_rollout_log_probs_as_old_and_adds_no_weights(registries):
    corr = compose(
        validate(registries, "algorithm.rollout_correction={name: decoupled, bypass: true}"), registries
    ).rollout_correction
    batch = _batch()
    rollout = batch["rollout_log_probs"].clone()
    del batch.tensors["old_log_prob"]  # the trainer ran no old-log-prob pass
    out, metrics = correct_rollout(batch, corr)
    assert torch.equal(out["old_log_prob"], rollout)  # the actor's PPO ratio is pi_theta / pi_rollout
    # the actor logs the mismatch from its own first log-probs
    assert out.meta["old_log_prob_is_rollout"] is True
    assert "rollout_is_weights" not in out and "rollout_rs_mask" not in out and loss_batch(out) is out
    # no mismatch of old_log_prob against itself (it would read 0)
    assert metrics == {"rollout_corr/bypass": 1.0}
    _, metrics = correct_rollout(
        _batch(),
        off := compose(
            validate(registries, "algorithm.rollout_correction=decoupled"), registries
        ).rollout_correction,
    )
    assert metrics["rollout_corr/bypass"] == 0.0 and off.kwargs == {"cap": None, "bypass": False}


def test_bypass_is_refused_where_it_would_do_nothing_or_starve_a_component(registries):
    with pytest.raises(RecipeError) as info:
        validate(registries, "algorithm.rollout_correction={name: token_tis, bypass: true}")
    found = " ".join(m for k, m in info.value.problems if k == "algorithm.rollout_correction.bypass")
    assert (
        "'token_tis' has no bypass mode" in found
        and "would be 1 on every token" in found
        and "['decoupled']" in found
    )
    with pytest.raises(RecipeError) as info:
        validate(registries, "algorithm.rollout_correction={name: decoupled, bypass: true, cap: 5.0}")
    assert "cap (5.0) has no effect with bypass: true" in str(info.value)
    with pytest.raises(RecipeError) as info:
        validate(
            registries,
            "algorithm.rollout_correction={name: decoupled, bypass: true}",
            "algorithm.estimator=optimal_token_baseline",
        )
    found = " ".join(m for k, m in info.value.problems if k == "algorithm.rollout_correction.bypass")
    assert "needs sum_pi_squared" in found and "bypass skips" in found
    validate(
        registries,
        "algorithm.rollout_correction={name: decoupled, bypass: false}",
        "algorithm.estimator=optimal_token_baseline",
    )


class _BypassWithoutField:
    @rlkit.hookimpl
    def rlkit_register_rollout_corrections(self):
        from rlkit.plugin.specs import RolloutCorrectionSpec

        return [
            RolloutCorrectionSpec(
                name="half_bypass",
                fn="rlkit.algos.rollout_correction:token_tis",
                params="rlkit.builtin.algo_params:TokenTISParams",
                bypass=True,
            )
        ]


def test_a_bypass_spec_needs_its_params_field():
    """The conformance check a plugin runs refuses ``bypass=True`` without a bool ``bypass`` params field."""
    from rlkit.testing import ContractError, check_rollout_correction

    registries = build_registries(
        make_plugin_manager(entry_points=False, extra_plugins=(("hb", _BypassWithoutField()),))
    )
    with pytest.raises(ContractError, match="bypass: bool = Field"):
        check_rollout_correction("half_bypass", registries=registries)
    check_rollout_correction("decoupled", registries=registries)
