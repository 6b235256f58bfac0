"""torch.compile (inductor) on the actor's decoder layers: does the update's body get faster?

    OMP_NUM_THREADS=1 python benchmarks/update_compile.py --model ~/.cache/rlkit/models/SmolLM2-135M-Instruct

The update's GEMMs already run at 92-95 % of the matmul probe (``benchmarks/profile_step.py --shapes``); the
rest of it (norms, rotary, SiLU, softmax, casts, residual adds and their backward: about a quarter of a bf16
update)
is what a fuser could shorten, and torch.compile is the one torch offers. This measures the body alone
(``model.model``: embedding, decoder layers, final norm) forward and backward at full width (padded rows, no
KV cache, no shared prompt), with rlkit's grouped eager attention as the actor trains with it and a
stand-in loss (mean of the squared final hidden states), eager against every decoder layer compiled
(``layer.compile(dynamic=False)``: one graph serves all the layers; dynamo's recompile limit raised so none
falls back to eager). Each variant runs in its own process, one thread; the first call (compile included)
is reported apart from the best of ``--reps`` later ones (each shape compiles into a fresh inductor cache,
so the first call includes a cold compile).

``--dynamic`` asks what a real run would see, whose response lengths change every step: the layers compile
with ``dynamic=True`` and every timed call after the first two has a token width neither variant has run
before (``tokens`` plus :data:`WIDTH_OFFSETS`, in turn); it reports the sum over those calls as well as the
best, so a recompile on a new width shows up in the sum.

It is not rlkit's update path: that one runs the shared prompt's pass with a KV cache (whose per-layer
update makes dynamo recompile per layer) and the fused head; this is the part a compile could fuse. Writes
``benchmarks/results/<stamp>-update-compile.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH_OFFSETS = (-13, 7, -5, 11, 3, -9, 5)  # --dynamic: each timed call at tokens + the next offset
SHAPES = [("bf16", 16, 76), ("bf16", 8, 590), ("fp32", 8, 300)]  # (dtype, rows, tokens): the harness's widths


def child(
    model_dir: str, dtype: str, rows: int, tokens: int, compiled: bool, reps: int, dynamic: bool = False
) -> dict:
    """One variant: the first call's seconds, each timed call's and their best (and, with ``dynamic``, the
    token width of each timed call; ``reps`` at most ``len(WIDTH_OFFSETS)`` then). The caller sets the
    process up (one thread, the workers' allocator)."""
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from rlkit.model.attention import grouped_eager_name

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.set_attn_implementation(grouped_eager_name())
    model.train()
    if compiled:
        torch._dynamo.config.cache_size_limit = 64
        torch._dynamo.config.recompile_limit = 64
        for layer in model.model.layers:
            layer.compile(dynamic=dynamic)

    def step(width: int = tokens) -> float:
        ids = torch.randint(0, model.config.vocab_size, (rows, width))
        mask = torch.ones(rows, width, dtype=torch.long)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            loss = hidden.float().pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first = step()
    step()
    widths = [tokens + WIDTH_OFFSETS[i] if dynamic else tokens for i in range(reps)]
    times = [step(width) for width in widths]
    return {"first_s": first, "steps_s": times, "best_s": min(times), "sum_s": sum(times), "widths": widths}


def _run_child(cmd: list[str], env: dict[str, str]) -> dict:
    """The child's result, or ``{"error": the last error line of its stderr}`` where it failed (a compile that
    fails on a shape is a finding the report keeps, not a reason to lose the shapes measured before it)."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line.split(":")[0]]  # "XError: why", not a hint
        return {"error": (errors or lines or [f"exit status {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--dtypes",
        default="bf16,fp32",
        help="the shapes of these dtypes (machine_sweep.sh drops bf16 where the CPU has no native bf16)",
    )
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="compile with dynamic=True and time every call at a new token width (module docstring)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dynamic and args.reps > len(WIDTH_OFFSETS):
        parser.error(
            f"--dynamic times at most {len(WIDTH_OFFSETS)} calls (one per new width): --reps too large"
        )
    if args.child:
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import keep_freed_memory

        keep_freed_memory()  # as rlkit's workers run (rlkit.hardware.allocator); this process only
        torch.set_num_threads(1)
        dtype, rows, tokens, compiled = json.loads(args.child)
        print(json.dumps(child(args.model, dtype, rows, tokens, compiled, args.reps, args.dynamic)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Report, hardware_line, one_thread

    one_thread()  # the machine line's thread count is the children's
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    report = Report("update-compile")
    report(hardware_line())
    report(
        f"compile: dynamic={args.dynamic}"
        + (f", timed widths tokens + {WIDTH_OFFSETS}" if args.dynamic else "")
    )
    report(
        "| dtype | rows × tokens | eager s (best) | compiled s (best) | compiled / eager "
        "| eager / compiled s (sum of timed calls) | first call s eager / compiled |"
    )
    report("|---|---|---:|---:|---:|---:|---:|")
    results = []
    cache = tempfile.mkdtemp(prefix="rlkit-inductor-")  # a cold compile: no graph cached by an earlier run
    for dtype, rows, tokens in [shape for shape in SHAPES if shape[0] in args.dtypes.split(",")]:
        got = {}
        for compiled in (False, True):
            spec = json.dumps([dtype, rows, tokens, compiled])
            cmd = [sys.executable, __file__, "--model", args.model, "--reps", str(args.reps), "--child", spec]
            cmd += ["--dynamic"] if args.dynamic else []
            fresh = env | {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, f"{dtype}-{rows}x{tokens}")}
            got[compiled] = _run_child(cmd, fresh)
        eager, comp = got[False], got[True]
        results.append({"dtype": dtype, "rows": rows, "tokens": tokens, "eager": eager, "compiled": comp})
        if "error" in eager or "error" in comp:
            failed = eager.get("error") or comp.get("error")
            report(f"| {dtype} | {rows} × {tokens} | failed: {failed} ||||||")
            continue
        report(
            f"| {dtype} | {rows} × {tokens} | {eager['best_s']:.3f} | {comp['best_s']:.3f} | "
            f"{comp['best_s'] / eager['best_s']:.3f} | {eager['sum_s']:.2f} / {comp['sum_s']:.2f} | "
            f"{eager['first_s']:.1f} / {comp['first_s']:.1f} |"
        )
    report.save({"args": vars(args), "rows": results})


if __name__ == "__main__":
    main()
