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
    parser.add_argument("--shapes", action="store_true", help="also print each GEMM shape's time and GFLOP/s")
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
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
            fn()
        print(f"\n=== {phase}: {plain:.3f} s without the profiler ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if args.shapes:
            print_gemm_shapes(prof)
    dist.destroy_process_group()


def gemm_flops(name: str, shapes: list) -> float:
    """FLOPs of one ``aten::mm``/``addmm``/``bmm`` call from its recorded input shapes."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2.0 * m * k * n
    if name in ("aten::addmm", "aten::addmm_"):
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2.0 * m * k * n
    (b, m, k), (_, _, n) = shapes[0], shapes[1]
    return 2.0 * b * m * k * n


def print_gemm_shapes(prof) -> None:
    """One line per GEMM op and input shapes: calls, self ms, GFLOP and GFLOP/s, largest time first."""
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"):
            continue
        flop = gemm_flops(event.key, event.input_shapes) * event.count
        ms = event.self_cpu_time_total / 1e3
        rows.append((ms, event.key, event.input_shapes, event.count, flop))
    rows.sort(key=lambda row: -row[0])
    total_ms = sum(row[0] for row in rows)
    total_flop = sum(row[4] for row in rows)
    rate = total_flop / total_ms / 1e6
    print(f"GEMMs: {total_ms:.0f} ms, {total_flop / 1e9:.1f} GFLOP, {rate:.1f} GFLOP/s")
    for ms, name, shapes, count, flop in rows:
        shown = [s for s in shapes if s]
        line = f"{ms:9.1f} ms  {count:5d}x  {flop / 1e9:8.2f} GFLOP  {flop / ms / 1e6:6.1f} GFLOP/s"
        print(f"{line}  {name} {shown}")


if __name__ == "__main__":
    main()
