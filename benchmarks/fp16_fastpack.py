"""The fp16 decode copy's weights packed in fbgemm's layout by torch's own vectorized ops, against fbgemm's
packing (``torch.ops.quantized.linear_prepack_fp16``); measured in session 35, not built (docs/benchmarks.md).

    OMP_NUM_THREADS=1 python benchmarks/fp16_fastpack.py --model ~/.cache/rlkit/models/SmolLM2-135M-Instruct

A full fine-tune repacks every linear once per step, and fbgemm's packing of one weight is a scalar loop over
its elements (an address computed and a value rounded each: 13-15 ns per weight on a Zen 3, where
``weight.half()`` takes 0.2 ns), 1.6-1.9 s of a SmolLM2 harness step. fbgemm's packed matrix is a plain
blocked layout (``fbgemm/FbgemmPackMatrixB.h``, shipped with torch): the weight as ``[K, N]`` in blocks of
512 rows (the last one shorter) by ``bcol`` columns (``bcol`` = 2 × the vector width in floats: 16 with
AVX2, 32 with AVX-512), each block row-major, N padded to whole blocks. B builds that buffer with one
rounding, transposing ``copy_`` per block row, and multiplies with fbgemm's own kernel
(``fbgemm::cblas_gemm_compute``, exported by libtorch_cpu) through a 20-line C++ operator compiled here (g++,
torch's headers), wrapping the buffer without a copy. A packs with torch's ``linear_prepack_fp16`` and
multiplies with ``linear_dynamic_fp16``.

Per weight shape of the model (every distinct ``[N, K]`` of its linears, q/k/v and gate/up fused as the fp16
copy packs them): both packings timed interleaved (median of ``--reps``), and A's and B's GEMM outputs at 1,
8 and 16 rows compared bit for bit. Then the whole model's packing time each way. One torch thread. Writes
``benchmarks/results/<stamp>-fp16-fastpack.*``. Needs g++ and fbgemm (x86-64 torch).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line, machine_record, one_thread, save_results  # noqa: E402

BLOCK_ROWS = 512  # fbgemm's brow for fp16 (PackedGemmMatrixB's default)
KERNEL_COL_BLOCKS = 2  # fbgemm's kernel_ncol_blocks on x86
_LOADED: list = []  # the library this process loaded (build_operator)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>
#include <fbgemm/FbgemmFP16.h>

// x [M, K] fp32 times the packed fp16 weight (fbgemm's layout, built by the caller) -> [M, N] fp32
at::Tensor fp16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t k, int64_t n, int64_t bcol) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() && x.scalar_type() == at::kFloat);
  const int brow = 512, nbrow = (k + brow - 1) / brow, last = k % brow == 0 ? brow : k % brow;
  const int nbcol = (n + bcol - 1) / bcol;
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == int64_t(brow) * nbrow * bcol * nbcol);
  fbgemm::PackedGemmMatrixFP16 weight(k, n, brow, last, bcol, nbrow, nbcol, packed.numel(), 2,
                                      packed.data_ptr());
  auto out = at::empty({x.size(0), n}, x.options());
  fbgemm::cblas_gemm_compute(fbgemm::matrix_op_t::NoTranspose, x.size(0), x.data_ptr<float>(), weight, 0.0f,
                             out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY(rlkit_fp16_spike, m) {
  m.def("fp16_gemm(Tensor x, Tensor packed, int k, int n, int bcol) -> Tensor");
  m.impl("fp16_gemm", c10::DispatchKey::CPU, TORCH_FN(fp16_gemm));
}
"""


# fbgemm's SimdUtils.h includes asmjit (its JIT's register types); torch ships no asmjit headers, and nothing
# here JIT-compiles, so two stand-ins declare the three register types the header names
_ASMJIT_STUBS = {
    "core.h": "#pragma once\n#define ASMJIT_LIBRARY_MAKE_VERSION(a, b, c) (((a) << 16) | ((b) << 8) | (c))\n"
    "#define ASMJIT_LIBRARY_VERSION 0\n",
    "x86.h": "#pragma once\n"
    "namespace asmjit { namespace x86 { struct Xmm {}; struct Ymm {}; struct Zmm {}; } }\n",
}


def build_operator(directory: Path) -> None:
    """Compile ``_SOURCE`` into ``directory`` and load it (``torch.ops.rlkit_fp16_spike.fp16_gemm``), once per
    process (a second library defining the operator would abort)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    if _LOADED:
        return

    (directory / "asmjit").mkdir(parents=True, exist_ok=True)
    for name, text in _ASMJIT_STUBS.items():
        (directory / "asmjit" / name).write_text(text)
    source, library = directory / "fp16_spike.cpp", directory / "fp16_spike.so"
    source.write_text(_SOURCE)
    lib = Path(torch.__file__).resolve().parent / "lib"
    command = [
        "g++",
        "-O2",
        "-std=gnu++20",
        "-shared",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in include_paths()),
        f"-I{directory}",
        str(source),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{lib}",
        "-o",
        str(library),
    ]
    subprocess.run(command, check=True)
    torch.ops.load_library(str(library))
    _LOADED.append(library)


def column_block(flags: set[str]) -> int:
    """fbgemm's ``bcol`` here: 2 × the floats in a vector register (AVX-512: 16, else 8)."""
    wide = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
    return KERNEL_COL_BLOCKS * (16 if wide else 8)


def fast_pack(weight, bcol: int):
    """``weight [N, K]`` (fp32) in fbgemm's packed fp16 layout (module docstring), as one flat fp16 tensor:
    each block row one ``copy_`` that rounds and transposes in one pass, the padded columns zero."""
    import torch

    n, k = weight.shape
    nbrow, nbcol = -(-k // BLOCK_ROWS), -(-n // bcol)
    full, rest = divmod(n, bcol)
    out = torch.empty(BLOCK_ROWS * nbrow * bcol * nbcol, dtype=torch.float16)
    start = 0
    for b in range(nbrow):
        rows = min(BLOCK_ROWS, k - b * BLOCK_ROWS)
        block = out[start : start + nbcol * rows * bcol].view(nbcol, rows, bcol)
        columns = weight[:, b * BLOCK_ROWS : b * BLOCK_ROWS + rows]  # [N, rows]
        block[:full].copy_(columns[: full * bcol].view(full, bcol, rows).transpose(1, 2))
        if rest:
            block[full, :, :rest].copy_(columns[full * bcol :].t())
            block[full, :, rest:].zero_()
        start += nbcol * rows * bcol
    out[start:].zero_()  # fbgemm allocates whole block rows; the last one's unused tail
    return out


def shapes(model_dir: str) -> dict[tuple[int, int], int]:
    """Each distinct packed ``(N, K)`` of the model's linears as the fp16 copy packs them (q/k/v, gate/up
    fused) and how many of it."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, i, heads = c.hidden_size, c.intermediate_size, c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // heads
    q, kv = heads * d, c.num_key_value_heads * d
    layers = c.num_hidden_layers
    return {(q + 2 * kv, h): layers, (h, q): layers, (2 * i, h): layers, (h, i): layers, (c.vocab_size, h): 1}


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="an HF folder (its config gives the weight shapes)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--build-dir", default=str(Path(__file__).resolve().parent / ".work" / "fp16-spike"))
    args = parser.parse_args()
    import torch

    from rlkit.hardware import cpu_flags

    build_operator(Path(args.build_dir))
    bcol = column_block(set(cpu_flags()))
    print(hardware_line())
    rows, total = [], {"fbgemm": 0.0, "fast": 0.0}
    gen = torch.Generator().manual_seed(0)
    for (n, k), count in shapes(args.model).items():
        weight = torch.randn(n, k, generator=gen) * 0.05
        prepack = lambda w=weight: torch.ops.quantized.linear_prepack_fp16(w, None)  # noqa: E731
        fast = lambda w=weight: fast_pack(w, bcol)  # noqa: E731
        a_s, b_s = [], []
        for _ in range(args.reps):  # interleaved A B B A
            a_s.append(median_time(prepack, 1))
            b_s.append(median_time(fast, 1))
            b_s.append(median_time(fast, 1))
            a_s.append(median_time(prepack, 1))
        a, b = statistics.median(a_s), statistics.median(b_s)
        packed_a, packed_b = prepack(), fast()
        same = all(
            torch.equal(
                torch.ops.quantized.linear_dynamic_fp16(x, packed_a),
                torch.ops.rlkit_fp16_spike.fp16_gemm(x, packed_b, k, n, bcol),
            )
            for x in (torch.randn(m, k, generator=gen) for m in (1, 8, 16))
        )
        total["fbgemm"] += a * count
        total["fast"] += b * count
        rows.append(
            {
                "shape": f"{n} × {k}",
                "count": count,
                "fbgemm_ms": a * 1e3,
                "fast_ms": b * 1e3,
                "fast_over_fbgemm": b / a,
                "fbgemm_ns_per_weight": a / (n * k) * 1e9,
                "fast_ns_per_weight": b / (n * k) * 1e9,
                "gemm_outputs_identical": same,
            }
        )
        print(f"{n} × {k} (× {count}): fbgemm {a * 1e3:.2f} ms, fast {b * 1e3:.2f} ms, identical {same}")
    lines = [
        f"`{' '.join(['python', *sys.argv])}`",
        "",
        hardware_line(),
        "",
        f"bcol {bcol} (fbgemm's column block here); median of {args.reps * 2} interleaved packings per shape",
        "",
        "| weight [N × K] | in the model | fbgemm pack ms | fast pack ms | fast / fbgemm | ns per weight "
        "fbgemm / fast | GEMM outputs bit-identical (1, 8, 16 rows) |",
        "|---|---:|---:|---:|---:|---|---|",
        *(
            f"| {r['shape']} | {r['count']} | {r['fbgemm_ms']:.2f} | {r['fast_ms']:.2f} | "
            f"{r['fast_over_fbgemm']:.3f} | "
            f"{r['fbgemm_ns_per_weight']:.1f} / {r['fast_ns_per_weight']:.2f} | "
            f"{r['gemm_outputs_identical']} |"
            for r in rows
        ),
        "",
        f"The whole model's packing: fbgemm {total['fbgemm']:.3f} s, fast {total['fast']:.3f} s "
        f"({total['fast'] / total['fbgemm']:.3f}×)",
    ]
    print("\n".join(lines[-1:]))
    record = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_record(),
        "bcol": bcol,
        "shapes": rows,
        "model_pack_s": total,
    }
    print("results:", save_results("fp16-fastpack", record, "\n".join(lines)))


if __name__ == "__main__":
    main()
