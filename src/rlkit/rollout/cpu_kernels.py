"""rlkit's compiled CPU operators for the lean decode step: their schemas, and their one library built for
this CPU on first use.

Three C++ files under ``kernels/`` implement them: ``decode_attention.cpp`` the step's attention over the
slab cache (``rlkit::decode_attention``; when the step uses it: ``rlkit.rollout.attention_kernel``),
``decode_glue.cpp`` the elementwise work between its GEMMs, fused per row (``rlkit::rms_norm_cast``,
``add_rms_norm_cast``, ``rotary_write``, ``silu_mul_cast``; called by
``rlkit.rollout.scripted_step.fused_layer_loop``) and ``sampling.cpp`` the next-token draw over the whole
vocabulary (``rlkit::sample_rows``; called by ``rlkit.rollout.sampling.sample_next``), all on the vector types
and functions of ``vector_math.h``. The schemas are defined here, at import, so TorchScript's layer loops
(``rlkit.rollout.scripted_step``) compile against them everywhere; the files only implement them
(``TORCH_LIBRARY_IMPL``).

They are compiled together on first use for this CPU — AVX-512 (16 floats a vector) where the CPU has
avx512f/bw/dq/vl, else AVX2 and FMA (8) — by the machine's ``g++`` against the installed torch (~15-25 s),
cached under ``$RLKIT_CACHE/kernels/`` by a hash of the sources and header, the compiler, the flags and the
torch version, and loaded into the process (:func:`kernel_unavailable`). Where that cannot be (no x86-64
Linux CPU with AVX2 and FMA, no ``g++``, a failed compile or load) the step runs its torch operators as
before and says why once. Only what the CPU reports picks the flags, never ``-march=native``'s tuning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import torch

__all__ = ["HEADERS", "SOURCES", "build_flags", "kernel_library", "kernel_unavailable"]

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).resolve().parent / "kernels" / name
    for name in ("decode_attention.cpp", "decode_glue.cpp", "sampling.cpp")
)
HEADERS = (Path(__file__).resolve().parent / "kernels" / "vector_math.h",)  # included by the sources
SCHEMAS = (
    "decode_attention(Tensor q, Tensor keys_t, Tensor values, Tensor attend, int length, float scale,"
    " Tensor? keys=None, bool bf16_out=False) -> Tensor",
    "rms_norm_cast(Tensor x, Tensor weight, float eps, bool bf16) -> Tensor",
    "add_rms_norm_cast(Tensor x, Tensor y, Tensor? bias, Tensor weight, float eps, bool bf16)"
    " -> (Tensor, Tensor)",
    "silu_mul_cast(Tensor gate_up, Tensor? bias, bool bf16) -> Tensor",
    "rotary_write(Tensor y, Tensor? bias, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps,"
    " Tensor(a!) key_slab, Tensor(b!) value_slab, Tensor(c!)? key_slab_t, int start, int heads, int kv_heads)"
    " -> Tensor",
    "sample_rows(Tensor logits, Tensor? uniform, float temperature, int block) -> (Tensor, Tensor)",
)
_LIBRARY = torch.library.Library("rlkit", "DEF")  # kept alive: the schemas live as long as the process
for _schema in SCHEMAS:
    _LIBRARY.define(_schema)

_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")


def build_flags(flags: set[str] | frozenset[str]) -> tuple[list[str], int] | None:
    """The compiler's target flags and the kernels' vector width (floats) for a CPU with ``flags``, or None
    where it has no AVX2 and FMA. Only what the CPU reports: never ``-march=native``'s tuning."""
    if {"avx2", "fma", *_AVX512} <= flags:
        return [*(f"-m{f}" for f in _AVX512), "-mavx2", "-mfma"], 16
    if {"avx2", "fma"} <= flags:
        return ["-mavx2", "-mfma"], 8
    return None


def _compiler() -> str | None:
    return shutil.which("g++")


def _compile_command(compiler: str, target: list[str], width: int, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).resolve().parent / "lib"
    return [
        compiler,
        "-O3",
        "-std=gnu++20",  # GNU mode: GCC contracts a * b + c into FMAs (ISO mode does not)
        "-fno-math-errno",
        "-shared",
        "-fPIC",
        "-w",
        *target,
        f"-DRLKIT_VEC={width}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in include_paths()),
        *(str(source) for source in SOURCES),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{lib}",
        "-o",
        str(out),
    ]


def kernel_library(
    cache_dir: Path | None = None, cpu_flags: set[str] | None = None
) -> tuple[Path | None, str | None]:
    """The compiled library for this CPU (``cpu_flags``: for one with these flags instead; tests build the
    AVX2 library on an AVX-512 CPU) and torch, compiled now where the cache (``cache_dir``, default
    ``$RLKIT_CACHE/kernels``) lacks it; or None and why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the kernels are for x86-64 Linux (this is {platform.system()} on {platform.machine()})"
    from rlkit.hardware import cpu_flags as reported
    from rlkit.hardware import default_cache_path

    target = build_flags(reported() if cpu_flags is None else cpu_flags)
    if target is None:
        return None, "this CPU has no AVX2 and FMA"
    compiler = _compiler()
    if compiler is None:
        return None, "no g++ on PATH to compile them"
    flags, width = target
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        str(version).encode(),
        " ".join(flags).encode(),
        torch.__version__.encode(),
    ):
        digest.update(part)
    directory = cache_dir or default_cache_path().parent / "kernels"
    path = directory / f"decode_kernels-{width}-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path, None
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    command = _compile_command(compiler, flags, width, tmp)
    started = time.perf_counter()
    log.info("compiling rlkit's decode kernels for this CPU (once; cached as %s)", path)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
        return None, f"compiling {', '.join(s.name for s in SOURCES)} failed ({first})"
    os.replace(tmp, path)  # another process may have compiled it too: either file is the same library
    log.info("compiled rlkit's decode kernels in %.1f s: %s", time.perf_counter() - started, path)
    return path, None


@functools.cache
def kernel_unavailable() -> str | None:
    """Why this process cannot use the compiled operators, or None once they are loaded. Said once as a
    warning where they could have run (an x86-64 Linux CPU with AVX2 and FMA: no ``g++``, a failed compile or
    load); logged elsewhere."""
    fixable = False
    try:
        path, why = kernel_library()
        fixable = path is None and why is not None and ("g++" in why or why.startswith("compiling"))
        if path is not None:
            torch.ops.load_library(str(path))
    except Exception as err:  # noqa: BLE001 - any failure: the torch operators, as before
        path, why, fixable = None, f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}", True
    if why is not None:
        message = (
            f"rlkit: the compiled decode kernels are not used ({why}); the lean step runs torch's operators"
        )
        if fixable:
            warnings.warn(f"{message} (slower, same tokens to float rounding).", stacklevel=2)
        else:
            log.info(message)
    return why
