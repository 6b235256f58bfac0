"""Profile rlkit's two heavy phases in one process (no Ray): the rollout's decode loop and the actor update.

    python benchmarks/profile_step.py --model benchmarks/.work/tiny-qwen2 --dtype fp32 [--rows 25]

Builds the FSDP2 actor (world size 1, gloo) and the HF rollout sharing its module, exactly as the
hybrid worker does, then runs ``generate`` and ``update`` once to warm up and once under
``torch.profiler``; prints the top operators by self CPU time and each phase's wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import one_thread  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--phase", default="gen,update")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from rlkit.batch import Batch
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.schema import ActorConfig, ModelConfig, RolloutConfig
    from rlkit.rollout.hf import HFRollout
    from rlkit.workers.actor import FSDPActor
    from rlkit.workers.base import find_free_port

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    mp = "bf16" if args.dtype == "bf16" else "fp32"
    cfg = ActorConfig(mixed_precision=mp, ppo_micro_batch_size_per_rank=args.samples, ppo_mini_batch_size=1)
    loss, problems = resolve("actor.policy_loss", "policy_losses", cfg.policy_loss, build_registries())
    assert not problems, problems
    actor = FSDPActor(ModelConfig(path=args.model), cfg, loss, rollout_n=args.samples, total_steps=10)
    rollout = HFRollout(
        module=actor.module,
        tokenizer=actor.tokenizer,
        rollout_config=RolloutConfig(ignore_eos=True),
        max_response_length=args.tokens,
        seed=1,
    )
    tok = actor.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 4 + 6? Answer with only the number."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    enc = tok([text], return_tensors="pt")
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})

    def gen():
        return rollout.generate(prompts, n=args.samples)

    def update(batch):
        batch["advantages"] = (
            torch.randn(batch["responses"].shape[0], 1).expand_as(batch["response_mask"]).contiguous()
        )
        return actor.update(batch)

    batch = gen()
    update(batch)
    for phase in args.phase.split(","):
        fn = gen if phase == "gen" else (lambda: update(batch))
        start = time.perf_counter()
        fn()
        plain = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\n=== {phase}: {plain:.3f} s without the profiler ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
