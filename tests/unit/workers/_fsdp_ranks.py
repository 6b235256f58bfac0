"""Run one actor update on a fixed global batch with N gloo ranks; rank 0 saves loss, metrics and weights.

Usage: python _fsdp_ranks.py MODEL_DIR WORLD_SIZE OUT_FILE  (runs fixed, then dynamic micro-batches, then
Clip-Cov, whose random token selection is made over the global mini-batch: ``MODES``)
Each rank takes its contiguous 1/N of the global batch (as the driver's equal split does).
``update_once`` also runs in-process under a world-size-1 group.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def resolved_policy_loss(actor_config):
    """The actor config's policy loss as the driver resolves it (``rlkit.recipe.compose.resolve``): the
    function and its validated parameters, what ``FSDPActor`` receives."""
    from rlkit.errors import RecipeError
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve

    registries = build_registries(make_plugin_manager(entry_points=False))
    loss, problems = resolve("actor.policy_loss", "policy_losses", actor_config.policy_loss, registries)
    if problems:
        raise RecipeError(problems)
    return loss


def global_batch(tokenizer, n_prompts: int = 4, n: int = 2, width_t: int = 8):
    """A deterministic batch: chat prompts of different lengths, responses of different lengths."""
    from rlkit.batch import Batch

    g = torch.Generator().manual_seed(0)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 1 + 2?" * (i + 1)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n_prompts)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    prompts = enc["input_ids"].repeat_interleave(n, 0)  # [B, P]
    pmask = enc["attention_mask"].repeat_interleave(n, 0)
    b = prompts.shape[0]
    lengths = torch.tensor([8, 3, 5, 8, 1, 6, 2, 7])[:b]
    rmask = (torch.arange(width_t)[None, :] < lengths[:, None]).long()  # [B, T]
    responses = torch.randint(3, 300, (b, width_t), generator=g) * rmask
    ppos = (pmask.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([pmask, rmask], 1),
            "position_ids": torch.cat([ppos, ppos[:, -1:] + torch.arange(1, width_t + 1)], 1),
            "responses": responses,
            "response_mask": rmask,
            "advantages": torch.randn(b, 1, generator=g).expand(b, width_t).contiguous(),
            "ref_log_prob": -3.0 - torch.rand(b, width_t, generator=g),
        },
        meta={"temperature": 0.9},
    )


MODES = ("fixed", "dynamic", "clip_cov")
# Clip-Cov cutting 20% of the tokens, drawn among all valid ones: the draw must be the same whatever the split
CLIP_COV = {"name": "clip_cov", "clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}


def update_once(model_dir: str, mode: str) -> dict:
    """One actor on this rank: old log-probs, then one update; returns metrics, full state, old log-probs.
    Padded micro-batches on every rank and world size: a packed row (rlkit.model.packing, tested against the
    padded rows in test_fast_paths.py) sums its prompt's gradient in another order, and Adam at lr 1e-2 turns
    that float noise into steps above this comparison's 1e-4. One prompt pass per row too (FSDP ranks never
    share it; world size 1 would)."""
    from rlkit.model.forward import ForwardPlan
    from rlkit.recipe.schema import ActorConfig, ModelConfig, OptimConfig
    from rlkit.workers.actor import FSDPActor

    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_rank=2,
        ppo_epochs=2,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        use_dynamic_bsz=mode == "dynamic",
        ppo_max_token_len_per_rank=40,
        loss_agg_mode="token-mean",
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        mixed_precision="fp32",  # world sizes compared in fp32 on every machine (auto follows the CPU)
        **({"policy_loss": CLIP_COV} if mode == "clip_cov" else {}),
    )
    actor = FSDPActor(
        ModelConfig(path=model_dir),
        cfg,
        resolved_policy_loss(cfg),
        rollout_n=2,
        total_steps=4,
        log_prob_micro_batch_size=3,
        forward_plan=ForwardPlan(share_prefix=False, pack=False),
    )
    batch = global_batch(actor.tokenizer)
    local = batch.chunk(world_size)[rank]
    old = actor.compute_log_prob(local)["old_log_prob"]
    local["old_log_prob"] = old - 0.3 * local["response_mask"]  # ratios away from 1: clipping is exercised
    metrics = actor.update(local)
    olds = [torch.zeros_like(old) for _ in range(world_size)]
    dist.all_gather(olds, old)
    from rlkit.model.lm_head import plain_head

    return {
        "metrics": metrics,
        "state": actor.full_state_dict(),
        "old_log_prob": torch.cat(olds),
        "fused_head": plain_head(actor.module) is not None,
    }  # log-probs from hidden states, inside FSDP's forward


def assert_same_update(one: dict, two: dict, model_dir) -> None:
    """``update_once`` results of two world sizes agree: old log-probs, metrics, and every weight within
    1e-4, and the update really moved the weights (so agreement is not both staying put)."""
    from pathlib import Path

    import pytest
    from safetensors.torch import load_file

    assert one["fused_head"] and two["fused_head"]  # the chunked LM-head path ran, sharded (FSDP2) and plain
    torch.testing.assert_close(one["old_log_prob"], two["old_log_prob"], atol=1e-5, rtol=1e-5)
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/ppo_kl",
        "actor/pg_clipfrac",
    ):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-4, abs=1e-6), key
    assert one["metrics"]["actor/pg_clipfrac"] > 0  # the clipped branch was exercised
    # clip_cov (pg_clipfrac: the share cut): the same tokens were cut
    if "actor/ratio_clipfrac" in one["metrics"]:
        assert one["metrics"]["actor/pg_clipfrac"] == pytest.approx(
            two["metrics"]["actor/pg_clipfrac"], abs=1e-9
        )
        assert one["metrics"]["actor/pg_clipfrac"] > 0
    assert one["state"].keys() == two["state"].keys()
    initial = load_file(Path(model_dir) / "model.safetensors")
    moved = 0.0
    for name, value in one["state"].items():
        # Adam divides each element's step by its own gradient scale, so an element whose gradient is
        # ~0 can move a visible fraction of lr (1e-2) on float noise: allow 1% of lr per element.
        torch.testing.assert_close(value, two["state"][name], atol=1e-4, rtol=0, msg=name)
        if name in initial:  # lm_head is tied to the embedding and not stored separately
            moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-3  # the update changed the weights (lr 1e-2, two optimizer steps)


def run(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results = {mode: update_once(model_dir, mode) for mode in MODES}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlkit.workers.base import find_free_port

    model_dir, ws, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(run, args=(ws, find_free_port(), model_dir, out), nprocs=ws)
