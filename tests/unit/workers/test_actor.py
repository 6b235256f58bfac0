"""The FSDP2 actor in one process (world size 1, real gloo): split invariance, schedule, safety,
checkpoints."""

from __future__ import annotations

import math
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkit.errors import WorkerError
from rlkit.model import fsdp
from rlkit.model.forward import ForwardPlan
from rlkit.recipe.schema import ActorConfig, ModelConfig, OptimConfig
from rlkit.workers.actor import FSDPActor

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_ranks import global_batch, resolved_policy_loss  # noqa: E402

sys.path.pop(0)


def make_actor(model_dir, forward_plan: ForwardPlan = ForwardPlan(), **overrides) -> FSDPActor:
    optim = OptimConfig(lr=1e-2, weight_decay=0.0, **overrides.pop("optim", {}))
    cfg = ActorConfig(
        **(
            {
                "ppo_mini_batch_size": 4,
                "ppo_micro_batch_size_per_rank": 8,
                "optim": optim,
                "mixed_precision": "fp32",  # the algebra in fp32 on every machine (auto follows the CPU)
            }
            | overrides
        )
    )
    return FSDPActor(
        ModelConfig(path=str(model_dir)),
        cfg,
        resolved_policy_loss(cfg),
        rollout_n=2,
        total_steps=10,
        forward_plan=forward_plan,
    )


def prepared(actor: FSDPActor):
    batch = global_batch(actor.tokenizer)  # 8 samples, response lengths 1..8
    batch["old_log_prob"] = actor.compute_log_prob(batch)["old_log_prob"] - 0.3 * batch["response_mask"]
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_split_does_not_change_the_update(tiny_model_dir, gloo_world1, mode):
    """8 samples in one micro-batch vs micro-batches of 3 (3+3+2): same loss, grad norm and gradient.

    The gradient is read as the optimizer receives it (before its step), not from the weights after it: Adam's
    first step moves every weight by about ±lr whatever its gradient's size, so float noise in a near-zero
    gradient (micro-batches sum in another order) would show as a full-lr difference (seen on an AVX-512 CPU).
    One prompt pass per row and padded rows in both splits (the other paths: test_fast_paths.py)."""
    results = []
    for micro in (8, 3):
        actor = make_actor(
            tiny_model_dir,
            loss_agg_mode=mode,
            ppo_micro_batch_size_per_rank=micro,
            entropy_coeff=0.01,
            forward_plan=ForwardPlan(share_prefix=False, pack=False),
        )
        grads: list[list[torch.Tensor]] = []
        step = actor.optimizer.step

        def recorded_step(*args, _step=step, _grads=grads, _actor=actor, **kwargs):
            _grads.append([p.grad.clone() for p in _actor.module.parameters() if p.grad is not None])
            return _step(*args, **kwargs)

        actor.optimizer.step = recorded_step
        metrics = actor.update(prepared(actor))
        results.append((metrics, grads))
    (m1, g1), (m2, g2) = results
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    # one mini-batch, real grads
    assert len(g1) == len(g2) == 1 and any(bool(g.abs().sum() > 0) for g in g1[0])
    for mini1, mini2 in zip(g1, g2, strict=True):
        for a, b in zip(mini1, mini2, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_metrics_on_policy_and_lr_schedule(tiny_model_dir, gloo_world1):
    actor = make_actor(tiny_model_dir, optim={"warmup_steps": 2})
    batch = global_batch(actor.tokenizer)  # no old_log_prob: on-policy, ratio 1
    metrics = actor.update(batch)
    assert {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/nonfinite_skips",
    } <= metrics.keys()
    assert metrics["actor/ppo_kl"] == 0 and metrics["actor/pg_clipfrac"] == 0
    # token-mean of -A over valid tokens when the ratio is 1
    adv, mask = batch["advantages"], batch["response_mask"]
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(adv * mask).sum() / mask.sum()), rel=1e-5)
    # the lr used was 1/2 * lr; after step it is 2/2
    assert metrics["actor/lr"] == pytest.approx(1e-2 * 2 / 2)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_lr_scheduler_warmup_and_cosine():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = fsdp.build_lr_scheduler(
        opt, OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1), total_steps=6
    )
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warm-up 1/2, 2/2; then cosine over 4 steps from 1 to 0.1: 1, 0.1 + 0.9 * (1 + cos(pi/4)) / 2, ...
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[6] == pytest.approx(0.1)
    opt2 = torch.optim.AdamW([param], lr=1.0)
    ratio = fsdp.build_lr_scheduler(opt2, OptimConfig(lr=1.0, warmup_ratio=0.5), total_steps=4)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.5) and ratio.get_last_lr() == pytest.approx([0.5])


def test_nonfinite_advantages_skip_the_step_then_stop(tiny_model_dir, gloo_world1):
    actor = make_actor(tiny_model_dir, max_nonfinite_in_row=2)
    batch = prepared(actor)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][0, 0] = float("nan")
    before = actor.full_state_dict()
    metrics = actor.update(batch)
    assert metrics["actor/nonfinite_skips"] == 1
    after = actor.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(WorkerError, match="non-finite"):
        actor.update(batch)


def test_kl_loss_bf16_and_gradient_checkpointing(tiny_model_dir, gloo_world1):
    ref = make_actor(tiny_model_dir, use_kl_loss=True, kl_loss_coef=0.5)
    fast = make_actor(
        tiny_model_dir,
        use_kl_loss=True,
        kl_loss_coef=0.5,
        mixed_precision="bf16",
        gradient_checkpointing=True,
    )
    batch = prepared(ref)
    # a CPU actor, bf16 or fp32, trains with eager attention over grouped query heads (the tiny Qwen2: 4
    # over 2)
    assert fast.module.config._attn_implementation == "rlkit_grouped_eager"
    assert ref.module.config._attn_implementation == "rlkit_grouped_eager"
    m_ref, m_fast = ref.update(batch), fast.update(batch)
    assert m_ref["actor/kl_loss"] > 0
    for key in ("actor/pg_loss", "actor/kl_loss"):
        assert m_fast[key] == pytest.approx(m_ref[key], rel=0.05, abs=0.02), key  # bf16 is close, not equal


class WeightCasts(TorchDispatchMode):
    """Counts, per parameter, the fp32 → bf16 casts made of it (autocast's ``_to_copy`` of a weight)."""

    def __init__(self, module):
        super().__init__()
        self.names = {p.data_ptr(): name for name, p in module.named_parameters()}
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.bfloat16:
            name = self.names.get(args[0].data_ptr())
            if name is not None and args[0].dtype is torch.float32:
                self.counts[name] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("micro", [3, 4])
def test_bf16_weights_are_cast_once_per_optimizer_step(tiny_model_dir, gloo_world1, micro):
    """bf16 autocast, 2 mini-batches of 4 samples (2 optimizer steps per update) in micro-batches of 3 + 1 or
    4: each weight is cast once per mini-batch with ``ForwardPlan.cast_weights_once``
    (rlkit.model.forward.casts_kept) and once per micro-batch without it, and the updates are the same
    bitwise (a cast kept past an optimizer step would be of the old weights). The no-grad log-prob pass casts
    once in all."""
    actors = {
        once: make_actor(
            tiny_model_dir,
            mixed_precision="bf16",
            ppo_micro_batch_size_per_rank=micro,
            ppo_mini_batch_size=2,  # × rollout.n 2 = 4 of the 8 samples
            forward_plan=ForwardPlan(cast_weights_once=once),
        )
        for once in (True, False)
    }
    for actor in actors.values():
        actor.log_prob_micro_batch_size = micro  # rollout.log_prob_micro_batch_size_per_rank
    batch = prepared(actors[False])
    linear = "model.layers.0.mlp.gate_proj.weight"
    with WeightCasts(actors[True].module) as counted:  # the no-grad pass over 8 samples: 3 + 3 + 2 or 4 + 4
        old = actors[True].compute_log_prob(batch)["old_log_prob"]
    assert counted.counts[linear] == 1
    assert torch.equal(old, actors[False].compute_log_prob(batch)["old_log_prob"])
    casts, metrics = {}, {}
    for once, actor in actors.items():
        for update in range(2):
            with WeightCasts(actor.module) as counted:
                metrics[once, update] = actor.update(batch)
            casts[once, update] = dict(counted.counts)
    micro_batches = 2 * (2 if micro == 3 else 1)
    for update in range(2):
        assert casts[True, update][linear] == 2
        assert casts[False, update][linear] == micro_batches
        assert metrics[True, update] == metrics[False, update]
        assert metrics[True, update]["actor/grad_norm"] > 0
    for a, b in zip(actors[True].module.parameters(), actors[False].module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mini_batch_must_divide_the_rank_batch(tiny_model_dir, gloo_world1):
    actor = make_actor(tiny_model_dir)
    with pytest.raises(WorkerError, match="ppo_mini_batch_size"):
        actor.update(prepared(actor)[:6])


def test_checkpoint_round_trip(tiny_model_dir, gloo_world1, tmp_path):
    actor = make_actor(tiny_model_dir, optim={"warmup_steps": 3})
    batch = prepared(actor)
    actor.update(batch)
    actor.save_checkpoint(tmp_path / "ckpt")
    saved = actor.full_state_dict()
    expected_rng = (torch.rand(3), np.random.rand(), random.random())
    m_first = actor.update(batch)  # moves weights, optimizer, scheduler

    other = make_actor(tiny_model_dir, optim={"warmup_steps": 3})
    other.load_checkpoint(tmp_path / "ckpt")
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == (
        expected_rng[0].tolist(),
        *expected_rng[1:],
    )
    restored = other.full_state_dict()
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    m_again = other.update(batch)  # same optimizer moments and lr: the same second step
    assert m_again["actor/lr"] == m_first["actor/lr"]
    assert m_again["actor/grad_norm"] == pytest.approx(m_first["actor/grad_norm"], rel=1e-5)
    now_a, now_b = actor.full_state_dict(), other.full_state_dict()
    for name in now_a:
        torch.testing.assert_close(now_a[name], now_b[name], atol=1e-6, rtol=0)
