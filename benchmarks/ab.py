"""In-process A/B of one speed change: the same phase with the change off (A) and on (B), interleaved.

    python benchmarks/ab.py --model DIR --change head --phase update [--dtype bf16] [--reps 3]

Changes (each toggled here by patching, never by a setting in rlkit):
  head   actor forward: LM head on response positions only (``logits_to_keep``) vs every position
  prefix actor forward/backward: one prompt pass per group (KV cache indexed to its rows) vs one per row
  fsdp   world size 1: the plain module vs an FSDP2-wrapped one
  prefill  rollout: one prefill per distinct prompt (KV cache shared by its n rows) vs one per row
  fused  fused AdamW vs the foreach implementation
  attn   eager attention vs SDPA (CPU flash attention's bf16 backward is slow)
  bf16w  rollout: a bf16 weight copy for decoding (rollout.backend.dtype) vs the fp32 weights
One actor per variant (same seed, same weights), world size 1 (gloo), one thread. Prints the median
seconds of A and B and B/A.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import one_thread  # noqa: E402


@contextmanager
def variant(change: str, on: bool):
    from rlkit.workers import actor as actor_mod
    from rlkit.workers import fsdp

    saved = []
    if change == "fused" and not on:
        import torch

        saved.append((torch.optim, "AdamW", torch.optim.AdamW))
        torch.optim.AdamW = lambda *a, fused=None, _cls=torch.optim.AdamW, **k: _cls(*a, **k)
    if change == "prefix" and not on:
        saved.append((actor_mod, "_share_prefix", actor_mod._share_prefix))
        actor_mod._share_prefix = False
    if change == "head" and not on:
        saved.append((actor_mod, "_accepts_logits_to_keep", actor_mod._accepts_logits_to_keep))
        actor_mod._accepts_logits_to_keep = lambda cls: False
    if change == "fsdp" and not on:
        saved.append((fsdp, "_plain_at_world_size_1", getattr(fsdp, "_plain_at_world_size_1", None)))
        fsdp._plain_at_world_size_1 = False
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--change", required=True)
    parser.add_argument("--phase", default="update")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    from rlkit.batch import Batch
    from rlkit.pipeline import resolve
    from rlkit.recipe.schema import ActorConfig, ModelConfig, RolloutConfig
    from rlkit.registry import build_registries
    from rlkit.workers.actor import FSDPActor
    from rlkit.workers.base import find_free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    mp = "bf16" if args.dtype == "bf16" else "fp32"
    registries = build_registries()
    built = {}
    for on in (False, True):
        with variant(args.change, on):
            cfg = ActorConfig(mixed_precision=mp, ppo_micro_batch_size_per_rank=args.samples, ppo_mini_batch_size=1)
            backend = {"name": "hf", "dtype": "bfloat16" if args.change == "bf16w" and on else "float32"}
            # components resolved as the driver resolves them (rlkit.pipeline), built as the worker builds them
            (loss, p1), (engine, p2) = (resolve("actor.policy_loss", "policy_losses", cfg.policy_loss, registries),
                                        resolve("rollout.backend", "rollout_backends", backend, registries))
            assert not p1 and not p2, p1 + p2
            actor = FSDPActor(ModelConfig(path=args.model), cfg, loss, rollout_n=args.samples, total_steps=10)
            rollout = engine.build(module=actor.module, tokenizer=actor.tokenizer, seed=1, max_response_length=args.tokens,
                                   rollout_config=RolloutConfig(ignore_eos=True, backend=backend))
            if args.change == "prefill":
                rollout._share_prefill = on
            if args.change == "attn" and on:
                actor.module.set_attn_implementation("eager")
            built[on] = (actor, rollout)
    tok = built[False][0].tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + 6? Answer with only the number."}],
                                     tokenize=False, add_generation_prompt=True) for a in (4, 17, 9, 23)]
    enc = tok(texts, return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    n = args.samples // len(texts)  # 4 prompts × n samples, as the benchmark's SmolLM2 workload
    batch = built[False][1].generate(prompts, n=n)
    batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["response_mask"]).contiguous()

    def run(on: bool) -> float:
        actor, rollout = built[on]
        with variant(args.change, on):
            start = time.perf_counter()
            if args.phase == "gen":
                rollout.generate(prompts, n=n)
            elif args.phase == "log_prob":
                actor.compute_log_prob(batch)
            else:
                actor.update(batch)
            return time.perf_counter() - start

    run(False), run(True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.reps):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            times[on].append(run(on))
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.change} {args.phase} {args.dtype}: A(off) {a:.3f} s  B(on) {b:.3f} s  B/A {b / a:.3f}  "
          f"(A {[round(x, 3) for x in times[False]]}, B {[round(x, 3) for x in times[True]]})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
