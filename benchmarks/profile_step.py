"""Profile rlkit's two heavy phases in one process (no Ray): the rollout's decode loop and the actor update.

    python benchmarks/profile_step.py --model benchmarks/.work/tiny-qwen2 --dtype fp32 [--rows 25]
    # smollm2-long's update, as the harness runs it (a worker's allocator settings; 2 prompts × 4 × 64):
    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647 \
      python benchmarks/profile_step.py --model ~/.cache/rlkit/models/SmolLM2-135M-Instruct --dtype bf16 \
      --prompt-file benchmarks/.work/arithmetic/train-long512.parquet --prompts 2 --samples 4 --tokens 64 \
      --phase update --shapes

Builds the FSDP2 actor (world size 1, gloo) and the HF rollout sharing its module, exactly as the
hybrid worker does, then runs ``generate`` once and ``update`` ``--warmup`` times to warm up, and each
phase once more under ``torch.profiler``; prints the top operators by self CPU time and each phase's wall
time (``--shapes``: also the GEMMs by shape and the other operators by input shapes).

The profiler's own allocations move the process's heap: an operator that allocates a large fresh tensor
(the embedding's [V, H] gradient) can read 5-60x slower under it than without (4 ms against 280 measured on
Zen 4). The wall time printed first is the one without the profiler.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import one_thread, parquet_chat_texts  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--samples", type=int, default=16, help="completions per prompt")
    parser.add_argument(
        "--prompt-file",
        help="parquet of chat prompts (run.py's rows, e.g. benchmarks/.work/arithmetic/"
        "train-long512.parquet); default: one short arithmetic question",
    )
    parser.add_argument("--prompts", type=int, default=1, help="with --prompt-file: its first N rows")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--phase", default="gen,update")
    parser.add_argument(
        "--warmup", type=int, default=3, help="updates before the measured one (memory settles)"
    )
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
    rows = args.samples * args.prompts
    # one mini-batch of every prompt, one micro-batch: as the harness's recipe (rlkit_grpo.py)
    cfg = ActorConfig(
        mixed_precision=mp, ppo_micro_batch_size_per_rank=rows, ppo_mini_batch_size=args.prompts
    )
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
    if args.prompt_file:
        texts = parquet_chat_texts(tok, args.prompt_file, args.prompts)
    else:
        chats = [[{"role": "user", "content": "What is 4 + 6? Answer with only the number."}]] * args.prompts
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})

    def gen():
        return rollout.generate(prompts, n=args.samples)

    def update(batch):
        batch["advantages"] = (
            torch.randn(batch["responses"].shape[0], 1).expand_as(batch["response_mask"]).contiguous()
        )
        return actor.update(batch)

    batch = gen()
    for _ in range(args.warmup):
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
    rows, others = [], []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"):
            others.append((event.self_cpu_time_total / 1e3, event.key, event.input_shapes, event.count))
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
    others.sort(key=lambda row: -row[0])
    print("other operators by input shapes, largest time first:")
    for ms, name, shapes, count in others[:40]:
        print(f"{ms:9.1f} ms  {count:5d}x  {name} {[s for s in shapes if s]}")


if __name__ == "__main__":
    main()
