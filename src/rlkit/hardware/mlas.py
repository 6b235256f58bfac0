"""ONNX Runtime's MLAS fp32 GEMM for the CPU decode: the session one linear runs in, and whether it pays for
its packing on this CPU (a timed probe, cached per machine and layer shape, and the rule
``rollout.backend.linears: auto`` applies to it).

``rlkit.rollout.mlas_weights`` decodes with each linear in its own ONNX Runtime session
(:func:`gemm_session`): one ``Gemm(x, W, transB=1)`` whose weight MLAS prepacks when the session is built.
Where MKL's sgemm is weak at a decode step's few rows (AMD CPUs: docs/benchmarks.md, "ONNX Runtime's fp32
GEMM") the step is faster, in exact fp32; but every weight sync rebuilds every trainable linear's session, and
each call costs ~30 µs more than ``F.linear``, which tiny layers never earn back. So where the run decodes in
float32 on the CPU and onnxruntime is installed, ``auto`` picks ``onnxruntime`` when

    max_response_length >= MLAS_PAYBACK_MARGIN × break-even tokens

and ``torch`` otherwise. Where ``auto`` chose fp16 weights (they pay too), :func:`mlas_beats_fp16` weighs the
two and an ``onnxruntime`` win makes the decode float32. The probe times one decoder layer of the run's model
(q, k, v, o, gate, up, down at its shapes; ``rlkit.hardware.packed_probe``, shared with
``rlkit.hardware.fp16``) at ``MLAS_PROBE_ROWS`` rows on one thread: ``F.linear`` against the layer's sessions,
and building them; the best of ``MLAS_PROBE_ROUNDS`` rounds each. Its numbers go into the run's
``resolved.decode_linears_reason``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlkit.hardware.cpu import CpuInfo, cached_entry
from rlkit.hardware.fp16 import FP16_PAYBACK_MARGIN, Fp16Probe
from rlkit.hardware.packed_probe import PROBE_LAYER, Layer, PackedProbe, payback_choice, time_packed_layer

__all__ = [
    "MLAS_PAYBACK_MARGIN",
    "MLAS_PROBE_ROWS",
    "MLAS_PROBE_ROUNDS",
    "MlasProbe",
    "cached_mlas_probe",
    "gemm_session",
    "memory_initializer",
    "memory_session",
    "mlas_beats_fp16",
    "mlas_decode_pays",
    "onnxruntime_unavailable",
    "probe_mlas_decode",
]

MLAS_PAYBACK_MARGIN = (
    FP16_PAYBACK_MARGIN  # the same reasons: rows that end early, the prefill, the probe's noise
)


MLAS_PROBE_ROWS = 16


MLAS_PROBE_ROUNDS = 3


def onnxruntime_unavailable() -> str | None:
    """Why ONNX Runtime's linears (``rlkit.rollout.mlas_weights``) cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return "the onnxruntime and onnx packages are not both installed (pip install onnxruntime onnx)"
    return None


def memory_initializer(name: str, dims: list[int]):
    """An ONNX float32 initializer ``name`` of shape ``dims`` whose data the session gets from memory at
    build time (:func:`memory_session`: ``add_external_initializers``), so the model carries no weights."""
    import onnx

    tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=dims)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "memory"), ("offset", "0"), ("length", str(4 * math.prod(dims)))):
        tensor.external_data.add(key=key, value=value)
    return tensor


@functools.cache
def _gemm_model(out_features: int, in_features: int, bias: bool) -> bytes:
    """A serialized ONNX model ``y = Gemm(x, w, b, transB=1)``, x [M, in] float, w [out, in] and b [out] as
    initializers whose data the session gets from memory (:func:`memory_initializer`)."""
    from onnx import TensorProto, helper

    inputs = ["x", "w"] + (["b"] if bias else [])
    inits = [memory_initializer("w", [out_features, in_features])]
    if bias:
        inits.append(memory_initializer("b", [out_features]))
    graph = helper.make_graph(
        [helper.make_node("Gemm", inputs, ["y"], transB=1)],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", out_features])],
        inits,
    )
    # IR version 9: what onnxruntime releases from 1.17 on read
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return model.SerializeToString()


@functools.cache
def _threads_shared() -> bool:
    """Sessions share one process-wide thread pool of torch's intra-op size (a pool per session would start
    threads for each of a model's hundreds of linears); False where the runtime already started without."""
    import torch
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    try:
        state.set_global_thread_pool_sizes(torch.get_num_threads(), 1)
    except Exception:  # noqa: BLE001 - the environment exists already (another onnxruntime user here)
        return False
    return True


def memory_session(
    model: bytes, initializers: Mapping[str, Any], *, optimization: str = "basic", profile: str | None = None
):
    """An ONNX Runtime CPU session of the serialized ``model`` whose :func:`memory_initializer` s read the
    float32 contiguous CPU tensors of ``initializers`` (name → tensor; they must stay alive as long as the
    session), on the process-wide thread pool where it can share it; ``optimization`` is ONNX Runtime's graph
    optimization level ("basic" or "all"); ``profile``: a file prefix for ONNX Runtime's per-node profile
    (``session.end_profiling()`` writes it; ``benchmarks/ort_step_profile.py``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization]
    options.log_severity_level = 3  # errors only
    if profile is not None:
        options.enable_profiling, options.profile_file_prefix = True, profile
    if _threads_shared():
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    values = [ort.OrtValue.ortvalue_from_numpy(t.numpy()) for t in initializers.values()]
    options.add_external_initializers(list(initializers), values)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def gemm_session(weight, bias=None):
    """An ONNX Runtime session computing ``x @ weight.T + bias`` for x [M, in] float32 (``session.run(None,
    {"x": x})[0]``), ``weight`` [out, in] and ``bias`` [out] float32 contiguous CPU tensors that must stay
    alive as long as the session (it reads them at build time: MLAS prepacks the weight)."""
    initializers = {"w": weight} | ({} if bias is None else {"b": bias})
    out_features, in_features = weight.shape
    return memory_session(_gemm_model(out_features, in_features, bias is not None), initializers)


@dataclass(frozen=True)
class MlasProbe(PackedProbe):
    PACKED_FIELD = "mlas_s"

    fp32_s: float  # one decode step of the probe layer's linears with F.linear (best round)
    mlas_s: float  # the same through their ONNX Runtime sessions
    pack_s: float  # building the layer's sessions (MLAS packs the weights) once
    rows: int = MLAS_PROBE_ROWS
    params: int = 0  # the probe layer's weights


def _session_linear(x, session):
    """``x`` through one :func:`gemm_session`, as ``MlasLinear`` calls it."""
    import torch

    return torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def probe_mlas_decode(
    layer: Layer = PROBE_LAYER, rounds: int = MLAS_PROBE_ROUNDS, rows: int = MLAS_PROBE_ROWS, reps: int = 3
) -> MlasProbe:
    """Time ``layer`` 's linears at ``rows`` rows with ``F.linear`` and through their sessions (``reps``
    steps a round, the mean; a call as ``MlasLinear`` makes it), and building the sessions, on one thread; the
    best round of each."""
    timed = time_packed_layer(layer, gemm_session, _session_linear, rounds=rounds, rows=rows, reps=reps)
    return MlasProbe(
        fp32_s=timed["fp32_s"],
        mlas_s=timed["packed_s"],
        pack_s=timed["pack_s"],
        rows=rows,
        params=int(timed["params"]),
    )


def cached_mlas_probe(
    cpu: CpuInfo, cache_path: Path | None = None, *, layer: Layer = PROBE_LAYER, probe=probe_mlas_decode
) -> MlasProbe:
    """The MLAS probe of ``layer`` for this CPU and torch version from the cache
    (``$RLKIT_CACHE/hardware.json``), or measured now (``probe(layer)``) and added to it."""
    kind = "mlas-decode-" + ",".join(f"{n}x{k}" for n, k in layer)
    return cached_entry(kind, cpu, lambda: asdict(probe(layer)), MlasProbe.from_entry, cache_path)


def mlas_decode_pays(probe: MlasProbe, max_new_tokens: int) -> tuple[bool, str]:
    """(ONNX Runtime's linears?, why in one line) for fp32 decodes of up to ``max_new_tokens`` tokens (module
    docstring)."""
    return payback_choice(
        probe,
        max_new_tokens,
        margin=MLAS_PAYBACK_MARGIN,
        kernel="onnxruntime linears",
        baseline="F.linear",
        choices=("onnxruntime", "torch"),
    )


def mlas_beats_fp16(mlas: MlasProbe, fp16: Fp16Probe, max_new_tokens: int) -> tuple[bool, str]:
    """(ONNX Runtime's fp32 linears rather than fbgemm's fp16 weights?, why) for decodes of up to
    ``max_new_tokens`` tokens, where fp16 weights already pay against ``F.linear``: each path's cost is
    ``margin × packing + tokens × step``, over its own probe's ``F.linear`` step (the two probes ran apart, so
    each is read against its own fp32 baseline); the cheaper one wins, a tie goes to fp16."""
    tokens = max_new_tokens

    def cost(pack_s: float, step_s: float, fp32_s: float) -> float:
        return (MLAS_PAYBACK_MARGIN * pack_s + tokens * step_s) / fp32_s

    mine = cost(mlas.pack_s, mlas.mlas_s, mlas.fp32_s)
    theirs = cost(fp16.pack_s, fp16.fp16_s, fp16.fp32_s)
    wins = mine < theirs
    return wins, (
        f"for {tokens} tokens, onnxruntime linears ({mlas.speedup:.2f}x F.linear, packing "
        f"{mlas.pack_s * 1e3:.0f} ms) cost {mine:.1f} fp32 steps, fp16 weights ({fp16.speedup:.2f}x, packing "
        f"{fp16.pack_s * 1e3:.0f} ms) {theirs:.1f} -> {'float32 on onnxruntime' if wins else 'float16'}"
    )
