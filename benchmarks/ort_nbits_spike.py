"""Issue 30 item 2 spike on a CPU without VNNI: ONNX Runtime's block-quantised weights (``MatMulNBits``,
com.microsoft) against the fp32 ``Gemm`` the one-graph decode step runs (``rlkit.rollout.ort_step``).

    OMP_NUM_THREADS=1 python benchmarks/ort_nbits_spike.py --model ~/.cache/rlkit/models/SmolLM2-135M-Instruct

Two questions, one invocation, one thread:

1. **Speed.** A decode step's 210 layer linears of SmolLM2-135M's shapes (distinct weights, so every call
   streams its weight from memory as in a real step), in one ONNX Runtime session per variant: fp32 ``Gemm``
   over a prepacked constant weight (what the graph runs), and ``MatMulNBits`` with 8- and 4-bit weights in
   blocks of ``--block`` along the input, one fp32 scale per block (symmetric), at ``accuracy_level`` 0 (the
   weights dequantised to fp32 in the kernel) and 4 (the activations quantised to int8 per block as well,
   int8 products). Interleaved, the median of ``--reps``.
2. **How far the weights move.** The model's real layer weights quantised the same way, against fp16
   rounding (what ``rollout.backend.dtype: float16`` decodes with): the relative Frobenius error of the
   dequantised weights, over all 210 linears. That is a floor on the rollout/actor mismatch; level 4 adds
   the activations' int8 rounding on top.

Writes ``benchmarks/results/<stamp>-ort-nbits.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from common import Report, one_thread  # noqa: E402


def layer_weights(model_dir: str) -> list[np.ndarray]:
    """The 210 layer linears' fp32 weights [out, in] of the model at ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [
        m.weight.detach().numpy().copy()
        for name, m in model.model.layers.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]


def quantise(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric block quantisation of ``w`` [out, in]: (MatMulNBits' packed uint8 blob [out, in / block,
    block * bits / 8], its scales [out * in / block], the dequantised weight [out, in])."""
    out, k = w.shape
    qmax = 2 ** (bits - 1) - 1
    blocks = w.reshape(out, k // block, block)
    scale = np.abs(blocks).max(-1) / qmax
    scale[scale == 0] = 1.0
    q = np.clip(np.round(blocks / scale[..., None]), -qmax - 1, qmax)
    dequant = (q * scale[..., None]).reshape(out, k).astype(np.float32)
    stored = (q + 2 ** (bits - 1)).astype(np.uint8)  # no zero-point input: MatMulNBits subtracts 2^(bits-1)
    if bits == 4:
        stored = stored[..., 0::2] | (stored[..., 1::2] << 4)
    return stored, scale.reshape(-1).astype(np.float32), dequant


def session(weights: list[np.ndarray], variant: str, block: int):
    """One ONNX Runtime session running every weight of ``weights`` on its input width (``x576``/``x1536``
    feeds) as ``variant``: ``gemm`` or ``nbits{bits}-acc{level}``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, outs = [], [], []
    for i, w in enumerate(weights):
        out, k = w.shape
        if variant == "gemm":
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("Gemm", [f"x{k}", f"w{i}"], [f"y{i}"], transB=1))
        else:
            bits, level = (int(p) for p in variant.removeprefix("nbits").split("-acc"))
            blob, scale, _ = quantise(w, bits, block)
            inits += [numpy_helper.from_array(blob, f"w{i}"), numpy_helper.from_array(scale, f"s{i}")]
            nodes.append(
                helper.make_node(
                    "MatMulNBits",
                    [f"x{k}", f"w{i}", f"s{i}"],
                    [f"y{i}"],
                    domain="com.microsoft",
                    K=k,
                    N=out,
                    bits=bits,
                    block_size=block,
                    accuracy_level=level,
                )
            )
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    widths = sorted({w.shape[1] for w in weights})
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [None, k]) for k in widths]
    graph = helper.make_graph(nodes, "linears", inputs, outs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    from rlkit.hardware.mlas import _threads_shared

    options = ort.SessionOptions()
    if _threads_shared():  # the process-wide pool rlkit's sessions run on (one per process once made)
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a SmolLM2-135M folder (its layer weights)")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    report = Report("ort-nbits")
    weights = layer_weights(args.model)
    variants = ["gemm", "nbits8-acc0", "nbits8-acc4", "nbits4-acc0", "nbits4-acc4"]
    sessions = {v: session(weights, v, args.block) for v in variants}
    streamed = sum(w.nbytes for w in weights) / 1e6
    flops_per_row = 2 * sum(w.size for w in weights)
    report(
        f"{len(weights)} layer linears ({streamed:.0f} MB fp32), blocks of {args.block}, one thread; "
        f"median ms of {args.reps} interleaved reps (the first of each dropped)"
    )
    report("| rows | " + " | ".join(variants) + " | best nbits / gemm |")
    report("|---:|" + "---:|" * (len(variants) + 1))
    timings = {}
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in args.rows.split(",")):
        feeds = {f"x{k}": rng.standard_normal((rows, k)).astype(np.float32) for k in (576, 1536)}
        runs = {v: [] for v in variants}
        for _ in range(args.reps + 1):
            for v, s in sessions.items():
                start = time.perf_counter()
                s.run(None, feeds)
                runs[v].append(time.perf_counter() - start)
        ms = {v: 1e3 * statistics.median(t[1:]) for v, t in runs.items()}
        timings[rows] = ms
        best = min(t for v, t in ms.items() if v != "gemm")
        gflops = flops_per_row * rows / (ms["gemm"] / 1e3) / 1e9
        report(
            f"| {rows} | {ms['gemm']:.1f} ({gflops:.0f} GFLOP/s) | "
            + " | ".join(f"{ms[v]:.1f}" for v in variants[1:])
            + f" | {best / ms['gemm']:.2f} |"
        )
    norm = sum(float(np.square(w).sum()) for w in weights)

    def relative_error(approx) -> float:  # approx(w) -> the weight as that format stores it
        return (sum(float(np.square(approx(w) - w).sum()) for w in weights) / norm) ** 0.5

    errors = {
        f"int{bits} blocks of {args.block}": relative_error(lambda w, b=bits: quantise(w, b, args.block)[2])
        for bits in (8, 4)
    }
    errors["fp16"] = relative_error(lambda w: w.astype(np.float16).astype(np.float32))
    report(
        "relative Frobenius error of the dequantised layer weights: "
        + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    )
    report.save({"args": vars(args), "ms": timings, "weight_error": errors})  # save adds the machine


if __name__ == "__main__":
    main()
