"""Environments (registry ``environments``): rows, scores dispatched by data_source, and the multi-turn
``environment`` agent loop — replies as masked user turns, the episode's reward on the trajectory, and bad
environments (raising, hanging, never ending) counted, never fatal."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import rlkit
from rlkit.batch import Batch
from rlkit.errors import RecipeError
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.plugin.specs import EnvironmentSpec
from rlkit.recipe import validate_recipe
from rlkit.recipe.compose import compose, resolve
from rlkit.recipe.schema import RolloutConfig
from rlkit.rewards.environment import EnvironmentScore
from rlkit.rewards.managers import NaiveRewardManager
from rlkit.rollout.agent import AgentLoopRollout
from rlkit.rollout.environment import EnvironmentAgentLoop
from rlkit.testing import ContractError, check_environment


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from rlkit.model.load import load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


class ScriptedPolicy:
    """A fake backend: turn k of a conversation emits ``turns[k]`` (the real tokenizer's ids) plus eos."""

    def __init__(self, tokenizer, turns: list[str], logprob: float = -0.5):
        self.tokenizer, self.turns, self.logprob = tokenizer, turns, logprob

    async def generate_ids(self, prompt_ids, sampling):
        turn = self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        text = self.turns[min(turn, len(self.turns) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = ids[: sampling["max_new_tokens"]]
        return ids, [self.logprob] * len(ids), "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"


class GuessEpisode:
    """Guess a number 1..9: the environment answers higher/lower; ``mode`` makes it misbehave."""

    def __init__(self, secret: int, mode: str = ""):
        self.secret, self.mode, self.guesses, self.won = secret, mode, 0, False

    def step(self, text: str):
        if self.mode == "raise":
            raise ValueError("the game crashed")
        if self.mode == "hang":
            time.sleep(30)
        self.guesses += 1
        digits = [int(c) for c in text if c.isdigit()]
        if self.mode != "endless" and digits and digits[-1] == self.secret:
            self.won = True
            return None, True
        hint = "higher" if not digits or digits[-1] < self.secret else "lower"
        return f"No, {hint}. Guess again.", False

    def reward(self):
        return {"score": 1.0 if self.won else 0.0, "won": float(self.won), "guesses": float(self.guesses)}


class GuessEnv:
    def __init__(self, params=None):
        self.mode = params.mode if params is not None else ""

    def rows(self, split):
        if split != "train":
            return []
        return [
            {"prompt": [{"role": "user", "content": "Guess my number (1-9)."}], "extra_info": {"secret": s}}
            for s in (3, 7)
        ]

    def score(self, solution_str, ground_truth, extra_info):
        raise AssertionError("a multi-turn environment is scored through its episodes")

    def episode(self, extra_info):
        return GuessEpisode(int(extra_info["secret"]), self.mode)


class ParityEnv:
    """Single-turn: is the number even? Rubric: correct (weight 1) and brevity (weight 0.5)."""

    def rows(self, split):
        return [
            {
                "prompt": [{"role": "user", "content": f"Is {n} even? yes/no"}],
                "reward_model": {"style": "rule", "ground_truth": "yes" if n % 2 == 0 else "no"},
            }
            for n in range(4 if split == "train" else 2)
        ]

    def score(self, solution_str, ground_truth, extra_info):
        correct = float(solution_str.strip().lower() == ground_truth)
        brief = float(len(solution_str) <= 3)
        return {"score": correct + 0.5 * brief, "correct": correct, "brief": brief}


class GuessParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = ""


class _Plugin:
    @rlkit.hookimpl
    def rlkit_register_environments(self):
        return [
            EnvironmentSpec(
                name="guess", cls=GuessEnv, params=GuessParams, multi_turn=True, description="guess a number"
            ),
            EnvironmentSpec(name="parity", cls=ParityEnv, description="even or odd"),
        ]


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False, extra_plugins=(("envs", _Plugin()),)))


def _recipe(tiny_model_dir, registries, *overrides, check_files=False):
    raw = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_batch_size": 2},
        "actor": {"ppo_mini_batch_size": 2},
        "rollout": {"n": 2},
    }
    return validate_recipe(raw, list(overrides), registries=registries, check_files=check_files)


def test_the_registry_lists_environments_and_validation_resolves_them(tiny_model_dir, registries):
    assert registries.environments.names() == ["guess", "parity"]
    recipe = _recipe(tiny_model_dir, registries, "data.environment={name: guess, mode: ''}")
    pipeline = compose(recipe, registries)
    assert pipeline.environment.name == "guess"
    assert pipeline.default_agent == "environment"  # a multi-turn environment runs in its loop by default
    assert pipeline.agent_loops["environment"].params.environment is pipeline.environment
    single = compose(_recipe(tiny_model_dir, registries, "data.environment=parity"), registries)
    assert single.default_agent is None and single.environment.spec.multi_turn is False


def test_validation_refuses_bad_environment_recipes(tiny_model_dir, registries):
    with pytest.raises(RecipeError) as info:
        _recipe(tiny_model_dir, registries, "data.environment=reasoning_gym")
    assert "pip install -e plugins/rlkit-reasoning-gym" in str(info.value)  # the package to install
    with pytest.raises(RecipeError) as info:
        _recipe(tiny_model_dir, registries, "data.environment={name: guess, level: 3}")
    assert "data.environment.level" in str(info.value) and "Valid: mode" in str(info.value)
    with pytest.raises(RecipeError) as info:
        _recipe(tiny_model_dir, registries, "data.environment=parity", "data.train_files=[a.parquet]")
    assert "data.train_files" in str(info.value) and "gives the rows" in str(info.value)
    with pytest.raises(RecipeError) as info:
        _recipe(tiny_model_dir, registries)
    assert "data.train_files" in str(info.value) and "data.environment" in str(info.value)
    with pytest.raises(RecipeError) as info:
        _recipe(tiny_model_dir, registries, "data.environment=guess", "rollout.agent=tool")
    assert "multi-turn" in str(info.value)


def test_rows_are_written_with_the_environment_as_data_source(tmp_path, registries):
    import pyarrow.parquet as pq

    from rlkit.data.environment import write_environment_rows

    guess, _ = resolve("data.environment", "environments", "guess", registries)
    train, val = write_environment_rows(guess, tmp_path / "g")
    rows = pq.read_table(train[0]).to_pylist()
    assert val == [] and [r["data_source"] for r in rows] == ["guess", "guess"]
    # multi-turn rows name the loop
    assert [r["extra_info"]["agent_name"] for r in rows] == ["environment"] * 2
    parity, _ = resolve("data.environment", "environments", "parity", registries)
    train, val = write_environment_rows(parity, tmp_path / "p")
    assert (
        len(pq.read_table(val[0])) == 2
        and "agent_name" not in pq.read_table(train[0]).to_pylist()[0]["extra_info"]
    )


def _loop(tokenizer, policy, registries, max_len=200, **params):
    env, _ = resolve(
        "data.environment", "environments", {"name": "guess", "mode": params.pop("mode", "")}, registries
    )
    loop, problems = resolve("rollout.agent", "agent_loops", {"name": "environment", **params}, registries)
    assert not problems
    return EnvironmentAgentLoop(
        policy, tokenizer, max_response_length=max_len, params=loop.params.with_environment(env)
    )


def _play(loop, secret=7):
    return asyncio.run(
        loop.run([{"role": "user", "content": "Guess my number (1-9)."}], {}, extra_info={"secret": secret})
    )


def test_an_episode_masks_the_environment_replies_and_keeps_its_reward(tokenizer, registries):
    policy = ScriptedPolicy(tokenizer, ["5", "8", "7"])
    traj = _play(_loop(tokenizer, policy, registries))
    assert (traj.num_turns, traj.finish_reason, traj.env_truncated) == (3, "stop", False)
    assert traj.reward == {"score": 1.0, "won": 1.0, "guesses": 3.0}
    ids, mask = traj.response_ids, traj.response_mask
    generated = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    injected = tokenizer.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert generated == "5<|im_end|>8<|im_end|>7<|im_end|>"
    assert injected.count("<|im_start|>user\nNo, higher. Guess again.<|im_end|>") == 1
    assert injected.count("<|im_start|>user\nNo, lower. Guess again.<|im_end|>") == 1
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(traj.log_probs, mask))
    loop = _loop(tokenizer, policy, registries)
    full = tokenizer.decode(traj.prompt_ids + ids, skip_special_tokens=False)
    assert full + "\n" == loop.render(traj.messages, add_generation_prompt=False)  # token-exact conversation


def test_bad_environments_are_counted_not_fatal(tokenizer, registries):
    policy = ScriptedPolicy(tokenizer, ["5"])
    raised = _play(_loop(tokenizer, policy, registries, mode="raise"))
    assert raised.env_errors == 1 and "the game crashed" in raised.reward["error"]
    start = time.monotonic()
    hung = _play(_loop(tokenizer, policy, registries, mode="hang", reply_timeout_s=0.3))
    assert time.monotonic() - start < 20  # the hung reply was left behind
    assert hung.env_timeouts == 1 and "longer than 0.3 s" in hung.reward["error"]
    endless = _play(_loop(tokenizer, policy, registries, mode="endless", max_turns=3))
    assert (endless.num_turns, endless.finish_reason, endless.env_truncated) == (3, "max_turns", True)
    assert endless.reward["score"] == 0.0
    short = _play(_loop(tokenizer, policy, registries, max_len=12, mode="endless", max_turns=50))
    assert short.env_truncated and len(short.response_ids) <= 12


def test_the_rollout_hands_episode_rewards_to_the_reward_manager(tokenizer, registries, tiny_model_dir):
    recipe = _recipe(
        tiny_model_dir,
        registries,
        "data.environment=guess",
        "rollout.agent={name: environment, max_turns: 2}",
    )
    pipeline = compose(recipe, registries)
    policy = ScriptedPolicy(tokenizer, ["3", "7"])
    rows = GuessEnv().rows("train")
    encoded = [
        tokenizer(
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for r in rows
    ]
    prompts = Batch(
        {"input_ids": torch.tensor(encoded), "attention_mask": torch.ones(2, len(encoded[0]))},
        non_tensors={
            "raw_prompt": [r["prompt"] for r in rows],
            "extra_info": [{**r["extra_info"], "agent_name": "environment"} for r in rows],
        },
    )
    rollout = AgentLoopRollout(
        policy,
        tokenizer,
        rollout_config=RolloutConfig(),
        max_response_length=64,
        loops=dict(pipeline.agent_loops),
        default_agent=pipeline.default_agent,
        generate_ids=True,
    )
    out = rollout.generate(prompts, n=1)
    # secret 3 is guessed in turn 1; secret 7 in turn 2 (the turn limit)
    assert [r["won"] for r in out.non_tensors["env_reward"]] == [1.0, 1.0]
    assert list(out.non_tensors["num_turns"]) == [1, 2]
    assert out.meta["metrics"]["env/errors"] == 0.0 and out.meta["metrics"]["env/truncated"] == 0.0
    out.non_tensors.update({"data_source": ["guess", "guess"], "extra_info": [{}, {}]})
    with NaiveRewardManager(tokenizer, EnvironmentScore(pipeline.environment)) as manager:
        result = manager(out)
    assert result.token_level_scores.sum(dim=1).tolist() == [1.0, 1.0]
    assert result.extra["guesses"] == [1.0, 2.0]
    out.non_tensors["env_reward"][1] = {"error": "the game crashed"}
    with NaiveRewardManager(tokenizer, EnvironmentScore(pipeline.environment), default_score=-1.0) as manager:
        result = manager(out)
    assert result.metrics["reward/errors"] == 1.0 and result.token_level_scores.sum(dim=1).tolist() == [
        1.0,
        -1.0,
    ]


def test_a_single_turn_environment_scores_by_its_rubric(registries):
    parity, _ = resolve("data.environment", "environments", "parity", registries)
    score = EnvironmentScore(parity)
    assert score("parity", "yes", "yes", {}) == {"score": 1.5, "correct": 1.0, "brief": 1.0}
    assert score("parity", "I think no", "yes", {})["score"] == 0.0


def test_the_conformance_check_plays_and_scores(registries):
    seen = check_environment("parity", registries=registries)
    assert seen["rows"] == 4 and max(seen["scores"]) == 1.5
    seen = check_environment("guess", registries=registries, answers=["3", "7"])
    assert seen["turns"] == [1, 2]

    class Broken(ParityEnv):
        def score(self, solution_str, ground_truth, extra_info):
            return float("nan")

    with pytest.raises(ContractError, match="finite number"):
        check_environment(EnvironmentSpec(name="broken", cls=Broken))


def test_the_conformance_check_of_an_environment_its_agent_loop_plays(registries):
    """played_by: the rows must name the (registered) loop; score() is never asked, so it may refuse."""

    class Played(ParityEnv):
        def rows(self, split):
            return [
                r | {"extra_info": {**r.get("extra_info", {}), "agent_name": "environment"}}
                for r in super().rows(split)
            ]

        def score(self, solution_str, ground_truth, extra_info):
            raise AssertionError("the loop scores")

    seen = check_environment(
        EnvironmentSpec(name="played", cls=Played, played_by="environment"), registries=registries
    )
    assert seen["rows"] == 4 and seen["scores"] == []
    with pytest.raises(ContractError, match="must be 'environment'"):
        check_environment(
            EnvironmentSpec(name="bare", cls=ParityEnv, played_by="environment"), registries=registries
        )
    with pytest.raises(ContractError, match="not registered"):
        check_environment(
            EnvironmentSpec(name="played", cls=Played, played_by="nowhere"), registries=registries
        )


def test_the_step_and_validation_keep_the_generations_own_fields():
    """join_generation (the training step) keeps the generation's per-sample fields the prompts lack."""
    from rlkit.step.generate import join_generation

    repeated = Batch(
        {"input_ids": torch.ones(2, 3, dtype=torch.long)},
        non_tensors={"uid": ["a", "b"], "data_source": ["guess", "guess"]},
    )
    gen = Batch(
        {"responses": torch.ones(2, 4, dtype=torch.long)},
        non_tensors={"env_reward": [{"score": 1.0}, {"error": "x"}], "data_source": ["other", "other"]},
    )
    batch, _ = join_generation(repeated, gen)
    assert list(batch["env_reward"]) == [{"score": 1.0}, {"error": "x"}]
    assert list(batch["data_source"]) == ["guess", "guess"]  # the prompts' own fields win
