"""One LoRA actor update on the fixed global batch of ``_fsdp_ranks`` with N gloo ranks; rank 0 saves the
result.

Usage: python _lora_ranks.py MODEL_DIR WORLD_SIZE OUT_FILE. ``lora_update_once`` also runs in-process under a
world-size-1 group (the module then stays plain; at 2 ranks FSDP2 shards frozen base and adapter together).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_ranks import global_batch, resolved_policy_loss  # noqa: E402


def lora_update_once(model_dir: str) -> dict:
    """Old log-probs, reference log-probs (adapter off), one update (2 epochs, KL loss); returns metrics and
    the adapter's tensors after it, gathered on rank 0. Padded rows, one prompt pass per row, on every world
    size (as in _fsdp_ranks.update_once)."""
    from rlkit.model.forward import ForwardPlan
    from rlkit.model.lora import LoraRef
    from rlkit.recipe.schema import ActorConfig, LoraConfig, ModelConfig, OptimConfig, RefConfig
    from rlkit.workers.actor import FSDPActor

    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_rank=2,
        ppo_epochs=2,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        loss_agg_mode="token-mean",
        lora=LoraConfig(rank=4, alpha=8),
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
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
    local = global_batch(actor.tokenizer).chunk(world_size)[rank]
    old = actor.compute_log_prob(local)["old_log_prob"]
    local["ref_log_prob"] = LoraRef(actor, RefConfig()).compute_ref_log_prob(local)["ref_log_prob"]
    local["old_log_prob"] = old - 0.3 * local["response_mask"]
    metrics = actor.update(local)
    return {"metrics": metrics, "adapter": actor.rollout_state_dict()}


def run(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    result = lora_update_once(model_dir)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlkit.workers.base import find_free_port

    model_dir, ws, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(run, args=(ws, find_free_port(), model_dir, out), nprocs=ws)
