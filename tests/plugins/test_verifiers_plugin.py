"""The rlkit-verifiers plugin on the real verifiers 0.4.0: vf-guess-number (a multi-turn verifiers v1
environment written for these tests, plugins/rlkit-verifiers/tests/vf-guess-number) played by verifiers
itself, offline and in-process, against the token-in endpoint over the tiny model's rollout: two assistant
turns or more per episode, the environment's turns masked out, the endpoint's log-probs equal to the
actor's recompute of the same ids, and the rubric's reward reaching the batch and the reward manager."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlkit_harness import rlkit_env

pytest.importorskip("rlkit_verifiers", reason="pip install -e plugins/rlkit-verifiers")

from rlkit.batch import Batch  # noqa: E402
from rlkit.errors import RlkitError  # noqa: E402
from rlkit.plugin.registry import build_registries  # noqa: E402
from rlkit.recipe import validate_recipe  # noqa: E402
from rlkit.recipe.compose import compose, resolve  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GUESS = REPO / "plugins" / "rlkit-verifiers" / "tests" / "vf-guess-number"


@pytest.fixture(scope="module")
def guess_installed():
    """vf-guess-number installed by pip from its folder (as a user installs a local verifiers environment)."""
    try:
        import vf_guess_number  # noqa: F401
    except ImportError:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(GUESS)],
            check=True,
            capture_output=True,
        )


def _pipeline(tiny_model_dir, **environment):
    registries = build_registries()
    raw = {
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "environment": {
                "name": "verifiers",
                "env_id": "vf-guess-number",
                "args": {"size": 4, "max_turns": 3, "high": 1000000},  # never guessed: 3 turns each
                "size": 2,
                "max_tokens_per_turn": 12,
                **environment,
            },
            "train_batch_size": 2,
            "max_response_length": 64,
        },
        "actor": {"ppo_mini_batch_size": 2},
        "rollout": {"n": 2, "agent": {"name": "verifiers"}},
    }
    return compose(validate_recipe(raw, registries=registries, check_files=False), registries)


def _rollout(tiny_model_dir, pipeline):
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig, RolloutConfig
    from rlkit.rollout.agent import AgentLoopRollout
    from rlkit.rollout.hf import HFRollout

    torch.set_num_threads(1)
    config = ModelConfig(path=str(tiny_model_dir), dtype="float32")
    tokenizer = load_tokenizer(config)
    module = load_model(config, tokenizer=tokenizer)
    backend = HFRollout(
        module=module,
        tokenizer=tokenizer,
        rollout_config=RolloutConfig(),
        max_response_length=64,
        device="cpu",
        seed=0,
    )
    rollout = AgentLoopRollout(
        backend,
        tokenizer,
        rollout_config=RolloutConfig(),
        max_response_length=64,
        loops=dict(pipeline.agent_loops),
        default_agent=pipeline.default_agent,
    )
    return rollout, tokenizer, module


def _prompts(tokenizer, rows):
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(e) for e in encoded)
    return Batch(
        {
            "input_ids": torch.tensor([[0] * (width - len(e)) + e for e in encoded]),
            "attention_mask": torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded]),
        },
        non_tensors={
            "raw_prompt": [r["prompt"] for r in rows],
            "extra_info": [r["extra_info"] for r in rows],
        },
    )


def _runs_of(mask: list[int]) -> list[int]:
    """The values of the maximal runs of equal entries: [1, 1, 0, 1] -> [1, 0, 1]."""
    return [v for i, v in enumerate(mask) if i == 0 or mask[i - 1] != v]


def test_episodes_are_multi_turn_token_exact_and_scored_by_the_rubric(tiny_model_dir, guess_installed):
    from rlkit.data.environment import build_environment, environment_rows
    from rlkit.model.forward import response_outputs
    from rlkit.rewards.environment import EnvironmentScore
    from rlkit.rewards.managers import NaiveRewardManager

    pipeline = _pipeline(tiny_model_dir, max_turns=2)  # the game allows 3; the seat's limit stops it at 2
    assert pipeline.default_agent == "verifiers"
    env = build_environment(pipeline.environment)
    rows = environment_rows(pipeline.environment, "train", env)
    assert len(rows) == 2 and rows[0]["data_source"] == "verifiers" and rows[1]["extra_info"]["vf_index"] == 1
    rollout, tokenizer, module = _rollout(tiny_model_dir, pipeline)
    for _ in range(2):  # two generate calls: each runs its own event loop (the endpoint and the lock follow)
        out = rollout.generate(_prompts(tokenizer, rows), n=2, temperature=1.0)
        turns = list(out.non_tensors["num_turns"])
        assert turns == [2, 2, 2, 2], turns
        for r in range(4):
            runs = _runs_of(
                out["response_mask"][r, : int(out["response_mask"][r].nonzero().max()) + 1].tolist()
            )
            assert runs[:3] == [1, 0, 1], runs  # assistant, environment (masked), assistant
        rewards = list(out.non_tensors["env_reward"])
        assert all(set(w) == {"score", "solved", "format"} for w in rewards), rewards
        assert all(w["score"] == pytest.approx(w["solved"] + 0.5 * w["format"]) for w in rewards)
        assert out.meta["metrics"]["env/errors"] == 0.0
    # the endpoint's log-probs are the actor's: recompute the same ids
    batch = Batch(
        {k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    )
    with torch.no_grad():
        recomputed = response_outputs(
            module, batch, temperature=1.0, with_entropy=False, mixed_precision="fp32", device="cpu"
        )["log_prob"]
    served = out["rollout_log_probs"] * out["response_mask"]
    assert float((recomputed * out["response_mask"] - served).abs().max()) < 1e-4
    # the rubric's reward reaches the reward manager: score trains, each part is logged
    out.non_tensors.update({"data_source": ["verifiers"] * 4, "extra_info": [{}] * 4})
    with NaiveRewardManager(tokenizer, EnvironmentScore(pipeline.environment)) as manager:
        result = manager(out)
    assert result.token_level_scores.sum(dim=1).tolist() == pytest.approx([w["score"] for w in rewards])
    assert result.extra["solved"] == [w["solved"] for w in rewards]
    assert result.extra["format"] == [w["format"] for w in rewards]


def test_an_episode_past_its_timeout_is_counted_not_fatal(tiny_model_dir, guess_installed):
    pipeline = _pipeline(tiny_model_dir, episode_timeout_s=0.001)
    from rlkit.data.environment import build_environment, environment_rows

    rows = environment_rows(pipeline.environment, "train", build_environment(pipeline.environment))
    rollout, tokenizer, _ = _rollout(tiny_model_dir, pipeline)
    out = rollout.generate(_prompts(tokenizer, rows), n=2, temperature=1.0)
    assert out.meta["metrics"]["env/timeouts"] == 4.0 and out.meta["metrics"]["env/errors"] == 0.0
    assert all("error" in w for w in out.non_tensors["env_reward"])
    assert int(out["response_mask"].sum()) == 0  # nothing generated is trained on


def test_a_model_call_that_fails_is_an_episode_error_naming_the_call(
    tiny_model_dir, guess_installed, monkeypatch
):
    """verifiers records a failed model call (here: nothing listens at the endpoint's address) on the trace,
    not as an episode error: the loop counts the episode in env/errors with the call's message. Two generate
    calls, each on its own event loop and address: renderers' module-level lock, bound to the first loop,
    must not fail the second loop's calls ("bound to a different event loop")."""
    import socket

    from rlkit_verifiers.loop import VerifiersAgentLoop

    from rlkit.data.environment import build_environment, environment_rows

    pipeline = _pipeline(tiny_model_dir)
    rows = environment_rows(pipeline.environment, "train", build_environment(pipeline.environment))
    rollout, tokenizer, _ = _rollout(tiny_model_dir, pipeline)
    context = VerifiersAgentLoop._context
    for _ in range(2):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            dead = free.getsockname()[1]
        monkeypatch.setattr(
            VerifiersAgentLoop,
            "_context",
            lambda loop, url, port=dead: context(loop, f"http://127.0.0.1:{port}"),
        )
        out = rollout.generate(_prompts(tokenizer, rows), n=2, temperature=1.0)
        assert out.meta["metrics"]["env/errors"] == 4.0 and out.meta["metrics"]["env/timeouts"] == 0.0
        messages = [w["error"] for w in out.non_tensors["env_reward"]]
        assert all(
            "a model call to the endpoint failed" in m and "Connection error" in m for m in messages
        ), messages
        assert int(out["response_mask"].sum()) == 0  # nothing generated is trained on


def test_an_env_id_that_is_not_installed_names_the_package_to_install(tmp_path):
    from rlkit.data.environment import build_environment

    registries = build_registries()
    resolved, problems = resolve(
        "data.environment",
        "environments",
        {"name": "verifiers", "env_id": "owner/vf-not-installed@0.1"},
        registries,
    )
    assert not problems
    with pytest.raises(
        RlkitError, match="verifiers environment 'owner/vf-not-installed@0.1' is not installed"
    ) as err:
        build_environment(resolved)
    assert "pip install vf-not-installed (" in str(err.value)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlkit",
            "run",
            str(REPO / "recipes" / "verifiers.yaml"),
            "--smoke",
            "data.environment.env_id=vf-not-installed",
            f"trainer.output_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        env=rlkit_env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode != 0
    assert "pip install vf-not-installed" in result.stderr, result.stderr[-3000:]


def test_the_environment_passes_the_conformance_check_and_validation_names_its_loop(
    tiny_model_dir, guess_installed
):
    from rlkit.testing import check_environment

    registries = build_registries()
    seen = check_environment(
        "verifiers", registries=registries, env_id="vf-guess-number", args={"size": 4}, size=2
    )
    assert seen["rows"] == 2
    raw = {
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "environment": {"name": "verifiers", "env_id": "vf-guess-number", "size": 2},
            "train_batch_size": 2,
        },
        "actor": {"ppo_mini_batch_size": 2},
        "rollout": {"n": 2, "agent": {"name": "tool"}},
    }
    with pytest.raises(RlkitError, match="played by the 'verifiers' agent loop, not 'tool'"):
        validate_recipe(raw, registries=registries, check_files=False)
