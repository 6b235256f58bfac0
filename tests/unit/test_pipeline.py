"""The composition root and the parameter door: names and parameters resolved once, every error at
validation."""

from __future__ import annotations

import pickle

import pytest

from rlkit.errors import RecipeError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.recipe import recipe_to_dict, validate_recipe
from rlkit.recipe.compose import compose, resolve

RAW = {
    "model": {"path": "m"},
    "data": {"train_files": ["t.parquet"], "train_batch_size": 4},
    "rollout": {"n": 2},
}


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager())


def validate(registries, *overrides, raw=None):
    return validate_recipe(raw or RAW, list(overrides), registries=registries, check_files=False)


def problems(registries, *overrides, raw=None) -> dict[str, str]:
    with pytest.raises(RecipeError) as info:
        validate(registries, *overrides, raw=raw)
    return dict(info.value.problems)


def test_short_and_long_forms_are_one_component_with_defaults_filled_in(registries):
    recipe = validate(registries)
    assert recipe.algorithm.estimator.name == "grpo"
    # from the params model
    assert recipe.algorithm.estimator.params == {"norm_adv_by_std": True, "epsilon": 1e-6}
    shown = recipe_to_dict(recipe)
    assert shown["algorithm"]["estimator"] == {"name": "grpo", "norm_adv_by_std": True, "epsilon": 1e-6}
    assert shown["rollout"]["tools"] == []


def test_overrides_reach_parameters_after_a_name_change(registries):
    recipe = validate(
        registries,
        "algorithm.estimator=ppo",
        "algorithm.estimator.lam=0.9",
        "actor.policy_loss.clip_ratio_high=0.3",
    )
    assert recipe.algorithm.estimator.params == {"gamma": 1.0, "lam": 0.9}
    assert recipe.actor.policy_loss.name == "ppo_clip"  # a parameter without a name belongs to the default
    assert recipe.actor.policy_loss.params["clip_ratio_high"] == 0.3


def test_parameter_errors_name_the_key_the_entry_and_the_plugin(registries):
    found = problems(
        registries,
        "algorithm.estimator.my_param=2",
        "actor.policy_loss=gpg",
        "actor.policy_loss.clip_ratio_high=0.3",
        "algorithm.estimator.epsilon=-1",
    )
    assert "unknown parameter of estimators entry 'grpo'" in found["algorithm.estimator.my_param"]
    assert "rlkit.builtin.algorithms" in found["algorithm.estimator.my_param"]
    assert "Valid: norm_adv_by_std, epsilon" in found["algorithm.estimator.my_param"]
    assert "takes no parameters" in found["actor.policy_loss.clip_ratio_high"]
    assert "greater than 0" in found["algorithm.estimator.epsilon"]


def test_estimator_defaults_reach_only_components_that_have_the_parameter(registries):
    dapo = validate(registries, "algorithm.estimator=dapo", "reward.overlong_buffer.len=4")
    assert dapo.actor.policy_loss.params["clip_ratio_high"] == 0.28 and dapo.reward.overlong_buffer.enable
    with_gpg = validate(
        registries, "algorithm.estimator=dapo", "actor.policy_loss=gpg", "reward.overlong_buffer.len=4"
    )
    assert with_gpg.actor.policy_loss.params == {}  # gpg has no clip ratio: the default is not forced on it
    mine = validate(
        registries,
        "algorithm.estimator=dapo",
        "actor.policy_loss.clip_ratio_high=0.4",
        "reward.overlong_buffer.len=4",
    )
    assert mine.actor.policy_loss.params["clip_ratio_high"] == 0.4  # the user's value wins


def test_third_party_parameter_is_validated_against_the_plugins_model(registries):
    recipe = validate(registries, "algorithm.estimator=group_quantile", "algorithm.estimator.quantile=0.25")
    assert recipe.algorithm.estimator.params == {"quantile": 0.25}
    found = problems(registries, "algorithm.estimator=group_quantile", "algorithm.estimator.quantile=2")
    assert (
        "rlkit_example" in found["algorithm.estimator.quantile"]
        or "rlkit-example" in found["algorithm.estimator.quantile"]
    )


def test_roles_that_lead_nowhere_are_errors(registries):
    found = problems(
        registries,
        "resources.roles.critic=global",
        "resources.roles.ref=global",
        "resources.roles.reward_model=global",
        "resources.roles.actor=global",
    )
    assert "uses no critic" in found["resources.roles.critic"]
    assert "no KL term uses it" in found["resources.roles.ref"]
    assert "reward_model.enable is false" in found["resources.roles.reward_model"]
    assert "unknown roles entry 'actor'" in found["resources.roles.actor"]


def test_reward_model_needs_a_classification_folder(registries, tmp_path):
    found = problems(registries, "reward.reward_model.enable=true")
    assert "no model folder is given" in found["reward.reward_model.path"]
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    with pytest.raises(RecipeError) as info:
        validate_recipe(
            RAW,
            ["reward.reward_model.enable=true", f"reward.reward_model.path={tmp_path}"],
            registries=registries,
            check_files=True,
        )
    assert (
        "must be a *ForSequenceClassification model" in dict(info.value.problems)["reward.reward_model.path"]
    )


def test_tools_need_an_agent_loop_that_offers_them(registries):
    assert "no agent loop offers them" in problems(registries, "rollout.tools=[calculator]")["rollout.tools"]
    assert "offers tools but none are listed" in problems(registries, "rollout.agent=tool")["rollout.tools"]
    recipe = validate(
        registries, "rollout.agent=tool", "rollout.agent.max_turns=2", "rollout.tools=[calculator]"
    )
    assert recipe.rollout.agent.params == {"max_turns": 2, "max_tool_response_chars": 2000}


def test_compose_resolves_every_slot_once_and_pickles(registries):
    recipe = validate(
        registries,
        "algorithm.estimator=ppo",
        "actor.use_kl_loss=true",
        "resources.pools={global: {}, aux: {}}",
        "resources.roles.ref=aux",
    )
    pipeline = compose(recipe, registries)
    assert {slot: (r.role.name, r.pool) for slot, r in pipeline.roles.items()} == {
        "actor_rollout_ref": ("actor_rollout_ref", "global"),
        "critic": ("critic", "global"),
        "ref": ("ref", "aux"),
    }
    assert pipeline.estimator.kwargs == {"gamma": 1.0, "lam": 1.0}
    assert pipeline.policy_loss.kwargs == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    assert pipeline.score_fns["gsm8k"] is pipeline.score_fns["openai/gsm8k"]
    assert set(pipeline.agent_loops) >= {"single_turn", "tool"}
    restored = pickle.loads(pickle.dumps(pipeline))  # what workers receive
    assert restored.policy_loss.kwargs == pipeline.policy_loss.kwargs


def test_resolve_reports_an_unknown_name_with_suggestions(registries):
    resolved, found = resolve("algorithm.estimator", "estimators", "grp", registries)
    assert resolved is None and "Did you mean 'grpo'?" in found[0][1]


def test_a_misspelled_parameter_gets_a_suggestion_and_an_oversized_overlong_buffer_is_refused(registries):
    found = problems(
        registries,
        "algorithm.estimator.epsilonn=1",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=600",
        "data.max_response_length=512",
    )
    assert "Did you mean 'epsilon'?" in found["algorithm.estimator.epsilonn"]
    assert "does not fit in data.max_response_length=512" in found["reward.overlong_buffer.len"]


def test_python_tool_limits_come_through_the_parameter_door(registries):
    from dataclasses import fields

    from rlkit.builtin.params import PythonToolParams
    from rlkit.rollout.tools.sandbox import SandboxLimits

    # the params model mirrors the sandbox's limits: same names, same defaults
    assert {f.name: f.default for f in fields(SandboxLimits)} == PythonToolParams().model_dump()
    recipe = validate(registries, "rollout.agent=tool", "rollout.tools=[{name: python, wall_s: 3}]")
    tool = compose(recipe, registries).tools[0].build()
    assert tool.limits.wall_s == 3.0 and tool.limits.cpu_s == 5
    found = problems(registries, "rollout.agent=tool", "rollout.tools=[{name: python, wall: 3}]")
    assert "Did you mean 'wall_s'?" in found["rollout.tools.0.wall"]


def test_auto_decode_dtype_of_a_sharded_hybrid_actor_is_its_own(registries):
    """A hybrid actor FSDP-sharded over 2 ranks has no decode copy: auto resolves to the weights' own dtype
    with the reason (whatever this machine's bf16 or fp16 decision), and fp16 weights are never weighed there
    (its model's layer is never asked for: this recipe's model path does not exist). An async run's rollout
    pool decodes plain copies, however many ranks train."""
    from rlkit.runtime.build import _hybrid_ranks, _plan_hardware

    def planned(*overrides):
        recipe = validate(registries, *overrides)
        return _hybrid_ranks(recipe, compose(recipe, registries)), _plan_hardware(
            recipe, compose(recipe, registries)
        )

    ranks, hw = planned("resources.pools={global: {bundles_per_node: 2}}")
    assert ranks == 2 and hw.precision.decode_dtype == "float32"
    assert hw.precision.decode_reason == (
        "the hybrid actor is FSDP-sharded over 2 ranks and decodes with its own float32 weights"
    )
    assert "decode: the hybrid actor is FSDP-sharded over 2 ranks" in hw.summary()
    _, own = planned("resources.pools={global: {bundles_per_node: 2}}", "model.dtype=bfloat16")
    assert own.precision.decode_dtype == "bfloat16"
    _, engine = planned("resources.pools={global: {bundles_per_node: 2}}", "rollout.backend=sglang")
    assert engine.precision.decode_dtype is None  # sglang's dtype is its engine's, not rlkit's
    async_run = (
        "trainer.mode=async",
        "resources.pools={train: {bundles_per_node: 2}, generate: {}}",
        "resources.roles={actor_rollout_ref: train, rollout: generate}",
    )
    recipe = validate(registries, *async_run)
    assert _hybrid_ranks(recipe, compose(recipe, registries)) == 0


def test_onnxruntime_linears_decode_in_float32_and_are_refused_where_they_cannot_run(registries, monkeypatch):
    """``rollout.backend.linears: onnxruntime`` (rlkit.rollout.mlas_weights): auto resolves to float32 with
    the reason (no fp16 probe: this recipe's model path does not exist); an fp16/bf16 copy, cuda, a sharded
    hybrid actor and a missing onnxruntime are validation errors on the key."""
    from rlkit.runtime.build import _plan_hardware

    mlas = "rollout.backend={name: hf, linears: onnxruntime}"
    recipe = validate(registries, mlas)
    hw = _plan_hardware(recipe, compose(recipe, registries))
    assert hw.precision.decode_dtype == "float32"
    assert "linears=onnxruntime decodes with fp32 weights" in hw.precision.decode_reason
    assert compose(recipe, registries).rollout_backend.params.linears == "onnxruntime"
    key = "rollout.backend.linears"
    found = problems(registries, "rollout.backend={name: hf, linears: onnxruntime, dtype: float16}")
    assert "decode in float32, not float16" in found[key]
    assert "run on the CPU" in problems(registries, mlas, "resources.device=cuda")[key]
    sharded = problems(registries, mlas, "resources.pools={global: {bundles_per_node: 2}}")
    assert "pool has 2 ranks" in sharded[key]
    monkeypatch.setattr("rlkit.hardware.onnxruntime_unavailable", lambda: "no onnxruntime here")
    # the rule reads rlkit.hardware's function at call time
    assert "no onnxruntime here; or set rollout.backend.linears=torch" in problems(registries, mlas)[key]
