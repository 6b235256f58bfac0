"""Spike: one ONNX Runtime session per MLP (gate, up, SiLU, mul, down inside it) against three
``MlasLinear`` calls with torch's SiLU and product between them (what ``rollout.backend.linears=onnxruntime``
runs today), and against ``F.linear``; 30 SmolLM2-135M MLPs (distinct weights) at ``--rows`` rows, one
thread.

    OMP_NUM_THREADS=1 python benchmarks/mlas_mlp_spike.py --rows 16

Prints the sessions' build times, the largest |difference| from the torch MLP, and ms per step (median of reps
2–7). Writes ``benchmarks/results/<stamp>-mlas-mlp.{json,md}``. A measurement before building a fused MLP into
``rlkit.rollout.mlas_weights`` (docs/benchmarks.md, "ONNX Runtime's fp32 GEMM").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report, machine_line, matmul_peak_flops, memory_bandwidth, one_thread  # noqa: E402

H, F_, LAYERS = 576, 1536, 30


def mlp_model() -> bytes:
    """``y = Gemm(silu(Gemm(x, wg)) * Gemm(x, wu), wd)``, all transB=1, weights from memory."""
    from onnx import TensorProto, helper

    from rlkit.hardware.mlas import memory_initializer

    nodes = [
        helper.make_node("Gemm", ["x", "wg"], ["g"], transB=1),
        helper.make_node("Gemm", ["x", "wu"], ["u"], transB=1),
        helper.make_node("Sigmoid", ["g"], ["sg"]),
        helper.make_node("Mul", ["g", "sg"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["m"]),
        helper.make_node("Gemm", ["m", "wd"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", H])],
        [
            memory_initializer("wg", [F_, H]),
            memory_initializer("wu", [F_, H]),
            memory_initializer("wd", [H, F_]),
        ],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9
    ).SerializeToString()


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from rlkit.hardware.mlas import memory_session
    from rlkit.rollout.mlas_weights import MlasLinear

    torch.set_num_threads(1)
    report = Report("mlas-mlp")
    report(machine_line(matmul_peak_flops("fp32"), memory_bandwidth()))
    torch.manual_seed(0)
    weights = [
        tuple(torch.randn(*shape) * 0.02 for shape in ((F_, H), (F_, H), (H, F_))) for _ in range(LAYERS)
    ]
    model = mlp_model()

    def session(wg, wu, wd):
        return memory_session(model, {"wg": wg, "wu": wu, "wd": wd}, optimization="all")

    def linear(w):
        return MlasLinear(
            types.SimpleNamespace(weight=w, bias=None, in_features=w.shape[1], out_features=w.shape[0])
        )

    start = time.perf_counter()
    fused = [session(*w) for w in weights]
    fused_build = time.perf_counter() - start
    start = time.perf_counter()
    separate = [tuple(linear(w) for w in triple) for triple in weights]
    separate_build = time.perf_counter() - start
    report(f"build: one session per MLP {fused_build:.2f} s, one per linear {separate_build:.2f} s")
    x = torch.randn(args.rows, H)
    runs = {
        "one session per MLP": lambda: [torch.from_numpy(s.run(None, {"x": x.numpy()})[0]) for s in fused],
        "MlasLinear x 3 + torch SiLU, mul": lambda: [d(F.silu(g(x)) * u(x)) for g, u, d in separate],
        "F.linear x 3 + torch SiLU, mul": lambda: [
            F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c) for a, b, c in weights
        ],
    }
    with torch.no_grad():
        want = runs["F.linear x 3 + torch SiLU, mul"]()
        diff = max(
            float((p - q).abs().max()) for p, q in zip(runs["one session per MLP"](), want, strict=True)
        )
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    report(f"max |diff| one session per MLP vs torch: {diff:.1e}")
    for name, t in times.items():
        report(f"{name}: {statistics.median(t[1:]) * 1e3:.1f} ms for {LAYERS} MLPs at {args.rows} rows")
    report.save(
        {"args": vars(args), "times_s": times, "build_s": [fused_build, separate_build], "diff": diff}
    )


if __name__ == "__main__":
    main()
