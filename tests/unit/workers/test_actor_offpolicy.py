"""What the off-policy wiring asks of the real actor (tiny Qwen2, FSDP2 world size 1, gloo): correction
weights multiply the per-token loss, ``sum_pi_squared`` comes from the log-prob pass, and the on-policy
fast path logs the same mismatch metrics a recomputed ``old_log_prob`` gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlkit.algos.token_baseline import sum_pi_squared_from_logits
from rlkit.batch import Batch
from rlkit.recipe.schema import ActorConfig, ModelConfig, OptimConfig
from rlkit.step.correction import correct_rollout
from rlkit.workers.actor import FSDPActor

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_ranks import global_batch, resolved_policy_loss  # noqa: E402

sys.path.pop(0)


def make_actor(model_dir, **overrides) -> FSDPActor:
    cfg = ActorConfig(
        **(
            {
                "ppo_mini_batch_size": 4,
                "ppo_micro_batch_size_per_rank": 3,
                "optim": OptimConfig(lr=1e-2, weight_decay=0.0),
            }
            | overrides
        )
    )
    return FSDPActor(
        ModelConfig(path=str(model_dir)), cfg, resolved_policy_loss(cfg), rollout_n=2, total_steps=10
    )


def test_correction_weights_scale_the_policy_loss(tiny_model_dir, gloo_world1):
    """Weight 2 on every token doubles a token-mean pg_loss and its gradient norm (same model, same batch)."""
    losses = []
    for weight in (None, 2.0):
        actor = make_actor(tiny_model_dir)
        batch = global_batch(actor.tokenizer)
        batch["old_log_prob"] = actor.compute_log_prob(batch)["old_log_prob"]
        if weight is not None:
            batch["rollout_is_weights"] = weight * batch["response_mask"].float()
        losses.append(actor.update(batch))
    plain, weighted = losses
    assert weighted["actor/pg_loss"] == pytest.approx(2 * plain["actor/pg_loss"], rel=1e-5)
    assert weighted["actor/grad_norm"] == pytest.approx(2 * plain["actor/grad_norm"], rel=1e-4)


def test_sum_pi_squared_from_the_log_prob_pass(tiny_model_dir, gloo_world1):
    actor = make_actor(tiny_model_dir)
    batch = global_batch(actor.tokenizer)  # meta temperature 0.9
    out = actor.compute_log_prob(batch, with_sum_pi_squared=True)
    assert set(out.keys()) == {"old_log_prob", "sum_pi_squared"}
    with torch.no_grad():
        logits = actor.module(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.float()
    t, width = batch["responses"].shape[1], batch["input_ids"].shape[1]
    response_logits = logits[:, width - t - 1 : width - 1] / 0.9  # position j predicts response token j
    expected = sum_pi_squared_from_logits(response_logits) * batch["response_mask"]
    torch.testing.assert_close(out["sum_pi_squared"], expected, atol=1e-5, rtol=1e-4)
    mask = batch["response_mask"] > 0
    assert (out["sum_pi_squared"][mask] > 0).all() and (out["sum_pi_squared"][mask] <= 1).all()


def test_fast_path_mismatch_equals_a_recomputed_pass(tiny_model_dir, gloo_world1):
    """No old_log_prob (one epoch, one mini-batch): the update's own log-probs give the mismatch metrics."""
    actor = make_actor(tiny_model_dir, ppo_mini_batch_size=4)
    batch = global_batch(actor.tokenizer)
    old = actor.compute_log_prob(batch)["old_log_prob"]
    g = torch.Generator().manual_seed(1)
    batch["rollout_log_probs"] = (old + 0.05 * torch.randn(old.shape, generator=g)).clamp(max=0) * batch[
        "response_mask"
    ]
    recomputed = Batch({k: batch.tensors[k] for k in batch.tensors.keys()} | {"old_log_prob": old})
    _, expected = correct_rollout(recomputed, None)
    metrics = actor.update(batch)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
