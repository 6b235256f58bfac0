"""The conformance kit (rlkit.testing) run against every built-in of every kind: what a plugin author runs
against their own component, rlkit passes itself (a tiny real model; no mocks)."""

from __future__ import annotations

import pytest
import torch

from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.testing import (
    check_agent_loop,
    check_compute_score,
    check_estimator,
    check_policy_loss,
    check_reward_manager,
    check_role,
    check_rollout_backend,
    check_rollout_correction,
    check_tool,
    check_tracker,
)

BUILTINS = build_registries(make_plugin_manager(entry_points=False))  # built-ins only (no torch import)


def names(kind: str) -> list[str]:
    return BUILTINS[kind].names()


# Non-default parameters, so the params model reaches the component (the kit validates them first).
ESTIMATOR_PARAMS = {
    "grpo": {"norm_adv_by_std": False, "epsilon": 1e-3},
    "ppo": {"gamma": 0.9, "lam": 0.95},
    "reinforce_plus_plus": {"gamma": 0.9},
}
LOSS_PARAMS = {
    "ppo_clip": {"clip_ratio_high": 0.28, "clip_ratio_c": 2.0},
    "sapo": {"tau_pos": 0.5},
    # ratios that select several tokens of the kit's 8 x 6 batch (the defaults select one)
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -5.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.2},
}
CORRECTION_PARAMS = {"decoupled": {"cap": 3.0}, "seq_mis": {"geometric": True, "lower": 0.8, "upper": 1.25}}
SCORE_EXAMPLES = {
    "openai/gsm8k": [("so #### 3", "3", 1.0), ("#### 4", "3", 0.0)],
    "HuggingFaceH4/MATH-500": [("The answer is \\boxed{4}", "4", 1.0), ("\\boxed{5}", "4", 0.0)],
    "rlkit/arithmetic": [("so 7", "7", 1.0), ("8", "7", 0.0)],
}
TOOL_CALLS = {"calculator": ({"expression": "2 + 3 * 4"}, "14"), "python": ({"code": "print(6 * 7)"}, "42")}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    torch.set_num_threads(1)
    config = ModelConfig(path=str(tiny_model_dir))
    tokenizer = load_tokenizer(config)
    return load_model(config, tokenizer=tokenizer).eval(), tokenizer


@pytest.mark.parametrize("name", names("estimators"))
def test_estimator(name):
    check_estimator(name, registries=BUILTINS)
    if name in ESTIMATOR_PARAMS:
        check_estimator(name, registries=BUILTINS, **ESTIMATOR_PARAMS[name])


@pytest.mark.parametrize("name", names("policy_losses"))
def test_policy_loss(name):
    check_policy_loss(name, registries=BUILTINS, **LOSS_PARAMS.get(name, {}))


@pytest.mark.parametrize("name", names("rollout_corrections"))
def test_rollout_correction(name):
    check_rollout_correction(name, registries=BUILTINS)
    if name in CORRECTION_PARAMS:
        check_rollout_correction(name, registries=BUILTINS, **CORRECTION_PARAMS[name])


@pytest.mark.parametrize("name", names("reward_managers"))
def test_reward_manager(name, tiny):
    check_reward_manager(name, tiny[1], registries=BUILTINS)


@pytest.mark.parametrize("name", names("compute_scores"))
def test_compute_score(name):
    check_compute_score(name, SCORE_EXAMPLES[name], registries=BUILTINS)


@pytest.mark.parametrize("name", names("rollout_backends"))
def test_rollout_backend(name, tiny):
    model, tokenizer = tiny
    # hf in float32: its log-probs are the model's to float rounding on every CPU (its auto dtype follows the
    # machine; the bf16 copy is checked below with a bf16 tolerance)
    params = {"dtype": "float32"} if name == "hf" else {}
    check_rollout_backend(name, model, tokenizer, registries=BUILTINS, **params)


def test_hf_backend_with_a_parameter(tiny):
    """``rollout.backend: {name: hf, dtype: bfloat16}``: a bf16 decode copy; its log-probs are the bf16
    model's."""
    model, tokenizer = tiny
    backend = check_rollout_backend("hf", model, tokenizer, registries=BUILTINS, dtype="bfloat16", atol=0.1)
    assert backend.decode_dtype == torch.bfloat16


@pytest.mark.parametrize("name", names("agent_loops"))
def test_agent_loop(name, tiny):
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.agent import HFTurnGenerator
    from rlkit.rollout.hf import HFRollout
    from rlkit.rollout.tools.calculator import CalculatorTool

    model, tokenizer = tiny
    backend = HFRollout(
        module=model, tokenizer=tokenizer, rollout_config=RolloutConfig(), max_response_length=12, seed=0
    )
    params = {"max_turns": 2} if BUILTINS.agent_loops.get(name).params is not None else {}
    check_agent_loop(
        name,
        HFTurnGenerator(backend),
        tokenizer,
        tools={"calculator": CalculatorTool()},
        registries=BUILTINS,
        **params,
    )


@pytest.mark.parametrize("name", names("tools"))
def test_tool(name):
    arguments, answer = TOOL_CALLS[name]
    check_tool(name, arguments, contains=answer, registries=BUILTINS)


# MLflow's first SQLite store takes seconds to create (its schema migrations); tests/unit/test_tracking.py
# runs the MLflow tracker in the default run, this check of it runs with the slow tests (`nox -s slow`).
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "mlflow" else n for n in names("trackers")]
)
def test_tracker(name, tmp_path):
    check_tracker(name, tmp_path, registries=BUILTINS)


@pytest.mark.parametrize("name", names("roles"))
def test_role(name):
    check_role(name, registries=BUILTINS)


def test_every_kind_is_covered():
    covered = {
        "estimators",
        "policy_losses",
        "reward_managers",
        "compute_scores",
        "rollout_backends",
        "agent_loops",
        "tools",
        "trackers",
        "roles",
        "rollout_corrections",
        # none built in: check_environment runs on the plugins' (tests/plugins/test_reasoning_gym_plugin.py,
        # test_textarena_plugin.py) and on the test environments of tests/unit/rollout/test_environment.py
        "environments",
    }
    assert covered == {kind for kind, _ in BUILTINS.items()}
    assert BUILTINS.environments.names() == []
    assert set(SCORE_EXAMPLES) == set(names("compute_scores")) and set(TOOL_CALLS) == set(names("tools"))
