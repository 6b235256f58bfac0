"""Critic, reference and reward-model workers in one process (world size 1, real gloo, FSDP2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlkit.recipe.schema import CriticConfig, ModelConfig, OptimConfig, RefConfig
from rlkit.workers.critic import FSDPCritic
from rlkit.workers.ref import FSDPRef
from rlkit.workers.reward_model import FSDPRewardModel

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_ranks import global_batch, resolved_policy_loss  # noqa: E402

sys.path.pop(0)


def make_critic(model_dir, micro: int = 8) -> FSDPCritic:
    cfg = CriticConfig(
        ppo_micro_batch_size_per_rank=micro, cliprange_value=0.2, optim=OptimConfig(lr=1e-2, weight_decay=0.0)
    )
    return FSDPCritic(
        ModelConfig(path=str(model_dir)), cfg, rollout_n=2, total_steps=4, ppo_mini_batch_size=4
    )


def with_targets(critic: FSDPCritic):
    batch = global_batch(critic.tokenizer)
    batch["values"] = critic.compute_values(batch)["values"]
    batch["returns"] = (batch["values"] + torch.linspace(-1, 1, 8)[:, None]) * batch["response_mask"]
    return batch


def test_values_shape_mask_and_padding_invariance(tiny_model_dir, gloo_world1):
    critic = make_critic(tiny_model_dir, micro=3)
    batch = global_batch(critic.tokenizer)
    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["response_mask"].shape and values.dtype == torch.float32
    assert (values[batch["response_mask"] == 0] == 0).all()
    alone = critic.compute_values(batch[[2]])["values"]  # a different piece width, same values
    torch.testing.assert_close(alone[0], values[2], atol=1e-5, rtol=1e-5)


def test_critic_update_is_split_invariant_and_clips(tiny_model_dir, gloo_world1):
    results = []
    for micro in (8, 3):
        critic = make_critic(tiny_model_dir, micro)
        batch = with_targets(critic)
        metrics = critic.update(batch)
        results.append((metrics, critic.compute_values(batch)["values"], batch))
    (m1, v1, batch), (m2, v2, _) = results
    assert {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
    } <= m1.keys()
    # values == old values at the first forward: loss is 0.5 * token-mean of (returns - values)^2
    mask = batch["response_mask"]
    expected = 0.5 * float(((batch["returns"] - batch["values"]) ** 2 * mask).sum() / mask.sum())
    assert m1["critic/vf_loss"] == pytest.approx(expected, rel=1e-4)
    assert m1["critic/vf_clipfrac"] == 0  # no clipping before any step
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5), key
    torch.testing.assert_close(v1, v2, atol=1e-4, rtol=0)
    assert not torch.allclose(v1, batch["values"])  # the update moved the values


def test_critic_checkpoint_round_trip(tiny_model_dir, gloo_world1, tmp_path):
    critic = make_critic(tiny_model_dir)
    batch = with_targets(critic)
    critic.update(batch)
    critic.save_checkpoint(tmp_path / "critic")
    saved = critic.compute_values(batch)["values"]
    critic.update(batch)
    other = make_critic(tiny_model_dir)
    other.load_checkpoint(tmp_path / "critic")
    torch.testing.assert_close(other.compute_values(batch)["values"], saved, atol=0, rtol=0)
    assert other.scheduler.state_dict() == critic.scheduler.state_dict() | {"last_epoch": 1, "_step_count": 2}


def test_ref_log_probs_equal_the_initial_policy(tiny_model_dir, gloo_world1):
    from rlkit.recipe.schema import ActorConfig
    from rlkit.workers.actor import FSDPActor

    ref = FSDPRef(ModelConfig(path=str(tiny_model_dir)), RefConfig(log_prob_micro_batch_size_per_rank=3))
    actor = FSDPActor(
        ModelConfig(path=str(tiny_model_dir)),
        ActorConfig(mixed_precision="fp32"),  # the ref computes in fp32 (its default): so does the actor
        resolved_policy_loss(ActorConfig()),
        rollout_n=2,
        total_steps=1,
    )
    batch = global_batch(ref.tokenizer)  # meta temperature 0.9
    ref_lp = ref.compute_ref_log_prob(batch)["ref_log_prob"]
    torch.testing.assert_close(ref_lp, actor.compute_log_prob(batch)["old_log_prob"], atol=1e-5, rtol=1e-5)
    assert not any(p.requires_grad for p in ref.module.parameters())


def test_reward_model_scores_ignore_padding(tiny_model_dir, gloo_world1):
    rm = FSDPRewardModel(ModelConfig(path=str(tiny_model_dir)), micro_batch_size=3)
    batch = global_batch(rm.tokenizer)
    scores = rm.compute_rm_score(batch)["rm_scores"]
    assert scores.shape == (8,) and torch.isfinite(scores).all()
    # sample 4 (one response token) alone has less padding on the right; same score
    alone = rm.compute_rm_score(batch[[4]])["rm_scores"]
    torch.testing.assert_close(alone[0], scores[4], atol=1e-5, rtol=1e-5)
    assert scores.unique().numel() > 1
