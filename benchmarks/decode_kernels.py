"""The linears of one SmolLM2-135M decode step, with each small-M GEMM kernel torch offers on this CPU.

    python benchmarks/decode_kernels.py --rows 1,8,16,32 --reps 5

The 30 decoder layers' weights (q 576², k and v 192×576, o 576², gate and up 1536×576, down 576×1536; 30 ×
14.2 MB = 425 MB, random values) are distinct tensors, so every step streams them from memory as a real
decode step does (a loop over one matrix would read it from cache and overstate every kernel). Kernels:

- ``linear``: ``F.linear`` (MKL sgemm, ``x @ W.T``), what the model runs;
- ``W@xT``: ``W @ x.T`` (the big matrix as the left operand: another MKL code path);
- ``mkl_packed``: MKL's packed sgemm with the weight packed once (``torch.ops.mkl._mkl_linear``, what
  inductor uses for frozen fp32 linears);
- ``onednn``: oneDNN's linear on mkldnn tensors (``torch._C._nn.mkldnn_linear``);
- ``fbgemm_fp16``: fbgemm's fp16-weight GEMM (``torch.ops.quantized.linear_dynamic_fp16``; fp32 activations),
  what ``rollout.backend.dtype=float16`` decodes with (``rlkit.rollout.fp16_weights``);
- ``fbgemm_fp16_fused``: the same with q/k/v packed as one matrix and gate/up as another (4 GEMMs per layer
  instead of 7; the outputs split), the "fewer ops per layer" idea of issue 30, measured before building it;
- ``int8_weight_only``: int8 weights with a per-row scale, fp32 activations (``torch._weight_int8pack_mm``,
  torchao's weight-only int8 path; no packing step);
- ``int8_weight_only_bf16``: the same weights with bf16 activations and scales (the product bf16), the form
  that kernel is fastest in on AVX-512 CPUs;
- ``mlas``: ONNX Runtime's MLAS fp32 GEMM on weights it prepacked (``rlkit.rollout.mlas_weights.MlasLinear``,
  what ``rollout.backend.linears=onnxruntime`` decodes with; needs onnxruntime);
- ``onednn_bf16``: oneDNN's linear on bf16 weights packed in its blocked layout, fp32 activations cast to bf16
  and the product back to fp32 (``rlkit.rollout.bf16_weights.Bf16Linear``, what ``rollout.backend.dtype=
  bfloat16`` decodes with on a CPU; needs oneDNN's packed linear).

Also prints the seconds fbgemm's fp16 packing and MLAS's prepacking take for all 210 weights, the cost a
decode with either pays once per weight sync.

``--kernels`` picks some (default: all).

Prints ms per step (the 210 layer linears, not the head), the weight bytes read per second (the bytes each
kernel's weights occupy: 2 per element for fp16 and bf16, 1 for int8, 4 else; results files before session 20
divided the fp32 bytes for every kernel) and the GFLOP/s,
beside the machine (CPU model, flags, matmul peak, read bandwidth); one torch thread unless ``--threads``.
Writes them to ``benchmarks/results/<stamp>-decode-kernels.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line, machine_record, memory_bandwidth, one_thread, save_results  # noqa: E402

LAYERS = 30
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in)


def _fused(weights: list) -> list:
    """Per layer: [q;k;v], o, [gate;up], down packed for fbgemm (``SHAPES`` order), with the split sizes."""
    import torch

    out = []
    for q, k, v, o, gate, up, down in weights:
        for parts in ([q, k, v], [o], [gate, up], [down]):
            packed = torch.ops.quantized.linear_prepack_fp16(torch.cat(parts), None)
            out.append((packed, parts[0].shape[1], [p.shape[0] for p in parts]))
    return out


def _int8(flat: list) -> list:
    """Each weight as int8 with a per-output-row scale (symmetric, absmax / 127), the scale in fp32 and
    bf16."""
    import torch

    out = []
    for w in flat:
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out.append((q, scale, scale.bfloat16()))
    return out


# bytes per weight element each kernel reads (default 4: fp32)
WEIGHT_BYTES = {
    "fbgemm_fp16": 2,
    "fbgemm_fp16_fused": 2,
    "int8_weight_only": 1,
    "int8_weight_only_bf16": 1,
    "onednn_bf16": 2,
}


def _kernels(
    flat: list, xs: dict, m: int, fp16: list, onednn: list, fused: list, int8: list, mlas: list, bf16: list
) -> dict:
    """Each kernel as a function running the step's linears on the rows ``xs`` (``{in_features: [m,
    in]}``)."""
    import torch
    import torch.nn.functional as F

    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in flat]  # packed for this M
    xs16 = {k: x.bfloat16() for k, x in xs.items()}
    return {
        "linear": lambda: [F.linear(xs[w.shape[1]], w) for w in flat],
        "W@xT": lambda: [w @ xs[w.shape[1]].T for w in flat],
        "mkl_packed": lambda: [
            torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m) for w, p in zip(flat, mkl, strict=True)
        ],
        "onednn": lambda: [
            torch._C._nn.mkldnn_linear(xs[w.shape[1]].to_mkldnn(), d).to_dense()
            for w, d in zip(flat, onednn, strict=True)
        ],
        "fbgemm_fp16": lambda: [
            torch.ops.quantized.linear_dynamic_fp16(xs[w.shape[1]], p)
            for w, p in zip(flat, fp16, strict=True)
        ],
        "fbgemm_fp16_fused": lambda: [
            torch.ops.quantized.linear_dynamic_fp16(xs[k], p).split(sizes, -1) for p, k, sizes in fused
        ],
        "int8_weight_only": lambda: [torch._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s, _ in int8],
        "int8_weight_only_bf16": lambda: [
            torch._weight_int8pack_mm(xs16[q.shape[1]], q, s16) for q, _, s16 in int8
        ],
        "mlas": lambda: [lin(xs[lin.in_features]) for lin in mlas],
        "onednn_bf16": lambda: [lin(xs[lin.in_features]) for lin in bf16],
    }


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,16,32", help="M: rows decoded at once, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernels", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    flat = [w for layer in weights for w in layer]
    nbytes = sum(w.numel() * 4 for w in flat)
    start = time.perf_counter()
    fp16 = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in flat]
    packing = {"fbgemm_fp16": time.perf_counter() - start}
    onednn = [w.to_mkldnn() for w in flat]
    wanted = set(args.kernels.split(",")) if args.kernels else None  # None: every kernel
    mlas = []
    if wanted is None or "mlas" in wanted:
        from types import SimpleNamespace

        from rlkit.rollout.mlas_weights import MlasLinear

        start = time.perf_counter()
        for w in flat:
            view = SimpleNamespace(weight=w, bias=None, out_features=w.shape[0], in_features=w.shape[1])
            mlas.append(MlasLinear(view))
        packing["mlas"] = time.perf_counter() - start
    bf16, skipped = [], {}
    if wanted is None or "onednn_bf16" in wanted:
        from rlkit.rollout.bf16_weights import Bf16Linear, bf16_weights_unavailable

        why = bf16_weights_unavailable()  # an AVX2-only CPU: oneDNN does not pack bf16
        if why:
            skipped["onednn_bf16"] = why
        else:
            start = time.perf_counter()
            for w in flat:
                linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight.data = w
                bf16.append(Bf16Linear(linear))
            packing["onednn_bf16"] = time.perf_counter() - start
    fused = _fused(weights) if wanted is None or "fbgemm_fp16_fused" in wanted else []
    int8 = _int8(flat) if wanted is None or wanted & {"int8_weight_only", "int8_weight_only_bf16"} else []
    machine = machine_record(args.threads) | {"bandwidth": memory_bandwidth()}
    head = (
        f"{hardware_line(machine)}; {args.threads} torch thread(s); read bandwidth "
        f"{machine['bandwidth'] / 1e9:.1f} GB/s; {len(flat)} linears, {nbytes / 1e6:.0f} MB fp32"
    )
    packed = "packing all weights once: " + ", ".join(f"{k} {v:.2f} s" for k, v in packing.items())
    packed += "".join(f"; {name} not measured: {why}" for name, why in skipped.items())
    print(head, packed, sep="\n", flush=True)
    lines, medians = [head, packed], {}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        kernels = _kernels(flat, xs, m, fp16, onednn, fused, int8, mlas, bf16)
        if args.kernels:
            kernels = {name: kernels[name] for name in args.kernels.split(",")}
        kernels = {name: fn for name, fn in kernels.items() if name not in skipped}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for fn in kernels.values():
            fn()  # warm-up
        for rep in range(args.reps):  # interleaved, order reversed every other rep
            for name in list(kernels) if rep % 2 == 0 else list(kernels)[::-1]:
                start = time.perf_counter()
                kernels[name]()
                times[name].append(time.perf_counter() - start)
        flops = 2.0 * m * nbytes / 4
        cells = [
            f"{name} {statistics.median(t) * 1e3:.1f} ms "
            f"({nbytes * WEIGHT_BYTES.get(name, 4) / 4 / statistics.median(t) / 1e9:.1f} GB/s, "
            f"{flops / statistics.median(t) / 1e9:.0f} GFLOP/s)"
            for name, t in times.items()
        ]
        print(f"M={m}: " + " | ".join(cells), flush=True)
        lines.append(f"M={m}: " + " | ".join(cells))
        medians[m] = {name: statistics.median(t) for name, t in times.items()}
    print(
        "results:",
        save_results(
            "decode-kernels",
            {"args": vars(args), "weight_bytes": nbytes, "median_s": medians, "packing_s": packing},
            "\n\n".join(lines),
            machine=machine,
        ),
    )


if __name__ == "__main__":
    main()
