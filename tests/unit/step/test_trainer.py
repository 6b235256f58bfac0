"""``Trainer.step`` against in-process fakes of its slots (``rlkit.testing.fakes``): the data flow of each
feature, with the real estimators, corrections and KL controller on top, in about a second per case."""

from __future__ import annotations

import pytest
import torch

from rlkit.recipe.validate import validate_recipe
from rlkit.step.trainer import Trainer
from rlkit.testing.fakes import FakePool, FakeRuntime

N = 4  # samples per prompt
PROMPTS = 4


def make(tmp_path, *overrides: str, prompts: int | None = None) -> tuple[Trainer, FakeRuntime]:
    raw = {
        "model": {"path": "fake-model"},
        "data": {
            "train_files": ["fake.parquet"],
            "train_batch_size": PROMPTS,
            "max_response_length": 6,
            "max_prompt_length": 8,
        },
        "rollout": {"n": N},
        "actor": {"ppo_mini_batch_size": PROMPTS},
        "trainer": {"total_steps": 3},
    }
    recipe = validate_recipe(raw, list(overrides), check_files=False)
    rt = FakeRuntime(recipe, tmp_path, prompts=prompts)
    return Trainer(recipe, rt), rt


def step(trainer: Trainer, rt: FakeRuntime) -> dict[str, float]:
    trainer.global_step += 1
    return trainer.step(rt.prompts(), rt.prompt_stream())


def updated(rt: FakeRuntime):
    return rt.actor.calls["update_actor"][-1]


def test_grpo_step_normalises_within_groups_and_skips_the_on_policy_log_prob_pass(tmp_path):
    trainer, rt = make(tmp_path, "algorithm.estimator=grpo")
    metrics = step(trainer, rt)
    batch = updated(rt)
    assert len(batch) == PROMPTS * N and "compute_log_prob" not in rt.actor.calls  # one epoch, one mini-batch
    scores = batch["token_level_scores"].sum(-1)
    adv = (batch["advantages"] * batch["response_mask"]).sum(-1) / batch["response_mask"].sum(-1)
    for g in batch["group_id"].unique():
        rows = batch["group_id"] == g
        assert int(rows.sum()) == N and len(set(batch["uid"][rows.numpy()])) == 1
        s = scores[rows]
        want = (s - s.mean()) / (s.std() + 1e-6)  # GRPO: (r - mean) / (std + eps) within the group
        torch.testing.assert_close(adv[rows], want, rtol=1e-4, atol=1e-5)
    assert scores.std() > 0 and metrics["actor/pg_loss"] == metrics["actor/pg_loss"]
    assert metrics["training/global_step"] == 1.0 and metrics["timing_s/gen"] > 0


def test_dynamic_sampling_refills_from_new_prompts_until_every_group_varies(tmp_path):
    trainer, rt = make(
        tmp_path,
        "algorithm.estimator=dapo",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "reward.overlong_buffer.len=2",
    )
    metrics = step(trainer, rt)
    batch = updated(rt)
    assert len(rt.actor.calls["generate_sequences"]) > 1  # refilled
    assert len(batch) == PROMPTS * N and batch["group_id"].unique().numel() == PROMPTS
    scores = batch["token_level_scores"].sum(-1)
    for g in batch["group_id"].unique():
        assert scores[batch["group_id"] == g].std() > 0  # the filter kept only groups whose scores vary
    assert metrics["train/num_gen_batches"] == len(rt.actor.calls["generate_sequences"]) > 1
    assert metrics["train/filter_groups_dropped"] > 0


def test_kl_in_reward_subtracts_the_penalty_from_the_scores(tmp_path):
    trainer, rt = make(
        tmp_path,
        "algorithm.estimator=grpo",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.5",
    )
    metrics = step(trainer, rt)
    batch = updated(rt)
    kl = (
        batch["old_log_prob"] - batch["ref_log_prob"]
        if "old_log_prob" in batch
        else batch["rollout_log_probs"] - batch["ref_log_prob"]
    )
    want = batch["token_level_scores"] - 0.5 * kl * batch["response_mask"]
    torch.testing.assert_close(batch["token_level_rewards"], want)
    assert metrics["actor/reward_kl_penalty"] > 0


def test_bypass_uses_the_rollout_log_probs_as_old_and_runs_no_log_prob_pass(tmp_path):
    trainer, rt = make(
        tmp_path,
        "algorithm.estimator=grpo",
        "actor.ppo_epochs=2",
        "algorithm.rollout_correction={name: decoupled, bypass: true}",
    )
    metrics = step(trainer, rt)
    batch = updated(rt)
    assert "compute_log_prob" not in rt.actor.calls
    assert (
        torch.equal(batch["old_log_prob"], batch["rollout_log_probs"])
        and metrics["rollout_corr/bypass"] == 1.0
    )


def test_a_correction_forces_the_old_log_prob_pass_and_weights_the_loss(tmp_path):
    trainer, rt = make(tmp_path, "algorithm.estimator=grpo", "algorithm.rollout_correction=token_tis")
    metrics = step(trainer, rt)
    batch = updated(rt)
    assert len(rt.actor.calls["compute_log_prob"]) == 1 and "rollout_is_weights" in batch
    ratio = torch.exp(batch["old_log_prob"] - batch["rollout_log_probs"])  # the fake's mismatch: exp(-0.05)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["rollout_is_weights"][mask], ratio[mask].clamp(max=2.0))
    assert metrics["rollout_corr/bypass"] == 0.0 and metrics["training/rollout_probs_diff_max"] > 0


def test_remax_runs_its_greedy_baseline_phase(tmp_path):
    trainer, rt = make(tmp_path, "algorithm.estimator=remax")
    step(trainer, rt)
    greedy = [c for c in rt.actor.calls["generate_sequences"] if len(c) == PROMPTS]  # one row per prompt
    assert len(rt.actor.calls["generate_sequences"]) == 2 and len(greedy) == 1
    batch = updated(rt)
    torch.testing.assert_close(batch["reward_baselines"], torch.full((PROMPTS * N,), 0.25))
    scores = batch["token_level_scores"].sum(-1)
    adv0 = batch["advantages"][:, 0]  # ReMax: the return minus the greedy score, the same at every token
    torch.testing.assert_close(adv0, scores - 0.25)


def test_a_rollout_pool_hands_batches_generated_ahead(tmp_path):
    trainer, rt = make(tmp_path, "algorithm.estimator=grpo")
    trainer.pipe = FakePool(rt.actor)
    trainer.global_step = 2
    metrics = trainer.step(None, rt.prompt_stream())
    batch = updated(rt)
    # one behind
    assert all(u.startswith("g0-") for u in batch["uid"]) and metrics["async/staleness_mean"] == 1.0
    assert trainer.pipe.pushed == [2] and metrics["async/weights_version"] == 1.0


def test_otb_gets_sum_pi_squared_from_the_log_prob_pass(tmp_path):
    trainer, rt = make(tmp_path, "algorithm.estimator=optimal_token_baseline")
    step(trainer, rt)
    assert len(rt.actor.calls["compute_log_prob"]) == 1
    batch = updated(rt)
    assert "sum_pi_squared" in batch and torch.isfinite(batch["advantages"]).all()
    assert (batch["advantages"] * batch["response_mask"]).abs().sum() > 0


def test_ppo_computes_values_and_updates_the_critic_before_the_actor(tmp_path):
    trainer, rt = make(tmp_path, "algorithm.estimator=ppo")
    metrics = step(trainer, rt)
    assert len(rt.critic.calls["compute_values"]) == 1 and len(rt.critic.calls["update_critic"]) == 1
    batch = rt.critic.calls["update_critic"][-1]
    assert "returns" in batch and "values" in batch and metrics["critic/vf_loss"] > 0


@pytest.mark.parametrize("public", [["fit", "step"]])
def test_the_trainer_shows_fit_and_step_only(public):
    assert sorted(n for n in vars(Trainer) if not n.startswith("_")) == public
