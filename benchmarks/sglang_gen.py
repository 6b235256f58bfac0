"""Generation throughput: rlkit's HF backend vs the sglang backend (a real SGLang server) on SmolLM2-135M
fp32.

    python benchmarks/sglang_gen.py --sglang-python /work/engines/sglang/bin/python [--threads 1] [--rounds 3]

The same ``B`` chat prompts × ``n`` samples × ``T`` new tokens (sampling at temperature 1 with eos
disabled for both — HF: no stop id; SGLang: ``ignore_eos`` — so every row decodes exactly ``T`` tokens)
through each backend's ``generate``; one torch thread for HF and ``OMP_NUM_THREADS`` = ``--threads`` for the
server. The server is launched once (its start-up is reported apart); rounds alternate HF, SGLang, SGLang, HF,
... and tok/s = B·n·T / wall seconds of one ``generate``. Prints a Markdown table and the machine line; the
numbers go into docs/sglang.md with the load (``uptime``) at the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Report, hardware_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sglang-python", default=os.environ.get("RLKIT_SGLANG_PYTHON", "/work/engines/sglang/bin/python")
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    report = Report("sglang-gen")  # printed lines, written to benchmarks/results/ at the end
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from rlkit_sglang.backend import SglangRollout
    from rlkit_sglang.params import SglangParams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.model.smollm2 import smollm2_dir
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.hf import HFRollout
    from rlkit.testing.rollout import chat_prompts

    torch.set_num_threads(args.threads)
    path = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(path)
    module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    questions = tuple(f"What is {i} + {i % 7}?" for i in range(args.prompts))
    prompts = chat_prompts(tok, questions)
    config = RolloutConfig(n=args.n, temperature=1.0)
    no_eos = [-1]  # a stop id that never occurs: every row decodes exactly --tokens tokens
    hf = HFRollout(
        module=module,
        tokenizer=tok,
        rollout_config=config,
        max_response_length=args.tokens,
        eos_token_ids=no_eos,
    )
    start = time.perf_counter()
    sg = SglangRollout(
        module=module,
        tokenizer=tok,
        rollout_config=config,
        max_response_length=args.tokens,
        params=SglangParams(
            model_path=path,
            launch={
                "python": args.sglang_python,
                "device": "cpu",
                "threads": args.threads,
                "log_dir": str(HERE / ".work"),
            },
        ),
    )
    startup = time.perf_counter() - start
    sg.stop_token_ids = []
    plain = sg.sampling_params
    # SGLang also stops at the model's eos
    sg.sampling_params = lambda **kw: {**plain(**kw), "ignore_eos": True}
    try:
        for backend in (hf, sg):  # warm-up (first-call allocations, the server's first batch)
            backend.generate(prompts, max_new_tokens=4)
        times: dict[str, list[float]] = {"hf": [], "sglang": []}
        order = ["hf", "sglang", "sglang", "hf"] * args.rounds
        for name in order[: 2 * args.rounds]:
            backend = hf if name == "hf" else sg
            t0 = time.perf_counter()
            out = backend.generate(prompts)
            seconds = time.perf_counter() - t0
            assert int(out["response_mask"].sum()) == args.prompts * args.n * args.tokens
            times[name].append(seconds)
    finally:
        sg.shutdown()
    tokens = args.prompts * args.n * args.tokens
    report(hardware_line())
    report(
        f"{args.prompts} prompts x n={args.n} x {args.tokens} tokens, {args.threads} thread(s); "
        f"SGLang start-up {startup:.0f} s; load {os.getloadavg()[0]:.1f}"
    )
    report("| backend | tok/s (median) | runs (s) |\n|---|---|---|")
    for name, secs in times.items():
        report(f"| {name} | {tokens / statistics.median(secs):.1f} | {', '.join(f'{s:.2f}' for s in secs)} |")
    report.save({"args": vars(args)})


if __name__ == "__main__":
    main()
