"""Spike: the linears of one SmolLM2-135M decode step as ONE ONNX graph (MLAS fp32 GEMMs on weights prepacked
at session build; no per-call overhead), against torch's ``F.linear`` (MKL) chained the same way, 1 thread.

    OMP_NUM_THREADS=1 python benchmarks/mlas_graph_spike.py --rows 8,16,64

Per layer: q, k, v from x; o from q; x1 = x + o; gate and up from x1; down from gate * up; x = x1 + down (no
attention, no norms: only the GEMMs and two adds); then the LM head. Random weights (0.02 scale), distinct per
layer. Prints the session build time (load + prepack), the largest |difference| of the logits, and ms per step
and GFLOP/s of both (median of reps 2–7). Writes ``benchmarks/results/<stamp>-mlas-graph.{json,md}``. What was
built from it: ``rlkit.rollout.mlas_weights`` (one session per linear, so the decode's own torch ops can run
between them; docs/benchmarks.md, "ONNX Runtime's fp32 GEMM").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report, machine_line, matmul_peak_flops, memory_bandwidth, one_thread  # noqa: E402

H, KV, F_, LAYERS, V = 576, 192, 1536, 30, 49152
SHAPES = {"q": (H, H), "k": (H, KV), "v": (H, KV), "o": (H, H), "g": (H, F_), "u": (H, F_), "d": (F_, H)}


def build(folder: Path):
    """The ONNX model (weights [in, out] as external data) and the same weights for torch ([out, in])."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, outs, torch_weights, x = [], [], [], [], "x"
    for layer in range(LAYERS):
        name = {}
        for key, (k, n) in SHAPES.items():
            arr = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            name[key] = f"W{layer}{key}"
            inits.append(numpy_helper.from_array(arr, name[key]))
            torch_weights.append(arr.T.copy())
        p = f"l{layer}"
        nodes += [
            helper.make_node("MatMul", [x, name["q"]], [p + "q"]),
            helper.make_node("MatMul", [x, name["k"]], [p + "k"]),
            helper.make_node("MatMul", [x, name["v"]], [p + "v"]),
            helper.make_node("MatMul", [p + "q", name["o"]], [p + "o"]),
            helper.make_node("Add", [x, p + "o"], [p + "x1"]),
            helper.make_node("MatMul", [p + "x1", name["g"]], [p + "g"]),
            helper.make_node("MatMul", [p + "x1", name["u"]], [p + "u"]),
            helper.make_node("Mul", [p + "g", p + "u"], [p + "m"]),
            helper.make_node("MatMul", [p + "m", name["d"]], [p + "d"]),
            helper.make_node("Add", [p + "x1", p + "d"], [p + "x2"]),
        ]
        outs += [p + "k", p + "v"]
        x = p + "x2"
    head = (rng.standard_normal((H, V)) * 0.02).astype(np.float32)
    inits.append(numpy_helper.from_array(head, "Whead"))
    torch_weights.append(head.T.copy())
    nodes.append(helper.make_node("MatMul", [x, "Whead"], ["logits"]))
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "step",
        [value("x", TensorProto.FLOAT, ["M", H])],
        [value("logits", TensorProto.FLOAT, ["M", V])]
        + [value(o, TensorProto.FLOAT, ["M", KV]) for o in outs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = folder / "step.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="step.data")
    return path, torch_weights


def torch_step(x, weights):
    import torch.nn.functional as F

    i = 0
    for _ in range(LAYERS):
        q, _k, _v = (F.linear(x, weights[i + j]) for j in range(3))
        x1 = x + F.linear(q, weights[i + 3])
        x = x1 + F.linear(F.linear(x1, weights[i + 4]) * F.linear(x1, weights[i + 5]), weights[i + 6])
        i += 7
    return F.linear(x, weights[i])


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="8,16,64")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    import numpy as np
    import onnxruntime as ort
    import torch

    torch.set_num_threads(1)
    report = Report("mlas-graph")
    report(machine_line(matmul_peak_flops("fp32"), memory_bandwidth()))
    with tempfile.TemporaryDirectory() as tmp:
        path, arrays = build(Path(tmp))
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        start = time.perf_counter()
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        report(f"session build (load + prepack) {time.perf_counter() - start:.2f} s")
    weights = [torch.from_numpy(a) for a in arrays]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    record = {}
    for m in (int(r) for r in args.rows.split(",")):
        xs = (np.random.default_rng(1).standard_normal((m, H)) * 0.5).astype(np.float32)
        with torch.no_grad():
            want = torch_step(torch.from_numpy(xs), weights).numpy()
            diff = float(np.abs(session.run(["logits"], {"x": xs})[0] - want).max())
            onnx_s, torch_s = [], []
            for _ in range(args.reps):
                start = time.perf_counter()
                session.run(None, {"x": xs})
                onnx_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                torch_step(torch.from_numpy(xs), weights)
                torch_s.append(time.perf_counter() - start)
        a, b = statistics.median(onnx_s[1:]), statistics.median(torch_s[1:])
        flops = flops_per_row * m
        report(
            f"M={m}: one ONNX graph {a * 1e3:.1f} ms ({flops / a / 1e9:.1f} GFLOP/s), torch F.linear "
            f"{b * 1e3:.1f} ms ({flops / b / 1e9:.1f} GFLOP/s), graph/torch {a / b:.3f}; logits max |diff| "
            f"{diff:.1e}"
        )
        record[m] = {"onnx_s": onnx_s, "torch_s": torch_s, "max_abs_diff": diff}
    report.save({"args": vars(args), "rows": record})


if __name__ == "__main__":
    main()
