"""What this machine computes fast and where a run computes: CPU facts, the ``auto`` precision, threads per
worker, the device and process-group backend.

``auto`` precision (``actor.mixed_precision``, ``rollout.backend.dtype``) is decided once per run on the
driver (``rlkit.runtime.build``), and the concrete value goes to the workers. The parts:

- ``rlkit.hardware.cpu``: CPU model and flags, the timed bf16/fp32 matmul probe and its cache, the decision
  (the rule is in its docstring). Standard library and torch only: ``benchmarks/common.py`` loads it by file
  path in TRL's environment, which has no rlkit.
- ``rlkit.hardware.fp16``: whether fp16 decode weights pay for their packing on this CPU (a timed probe,
  cached beside the matmul probe, and the rule ``auto`` applies to it).
- ``rlkit.hardware.mlas``: ONNX Runtime's fp32 GEMM session for one decode linear, and whether it pays for its
  packing on this CPU (a timed probe, cached the same way, and the rule ``rollout.backend.linears: auto``
  applies to it).
- ``rlkit.hardware.precision``: ``auto`` and explicit values made concrete, with their checks and warnings.
- ``rlkit.hardware.threads``: threads per worker, crowding, and one run's plan (``plan_run``).
- ``rlkit.hardware.devices``: device, torch.distributed backend, GPU memory metrics.

Everything public is importable from ``rlkit.hardware``.
"""

from __future__ import annotations

from rlkit.hardware.cpu import (
    BF16_BAND,
    BF16_MIN_SPEEDUP,
    NATIVE_BF16_FLAGS,
    PROBE_ROUNDS,
    RELEVANT_FLAGS,
    CpuInfo,
    MatmulProbe,
    PrecisionDecision,
    bf16_rule,
    cached_entry,
    cached_probe,
    cpu_flags,
    cpu_info,
    decide_cpu,
    decide_cuda,
    default_cache_path,
    device_type,
    hardware_summary,
    matmul_flops,
    precision_decision,
    probe_matmul,
    usable_cpus,
)
from rlkit.hardware.devices import (
    DevicePlan,
    cuda_missing,
    device_plan,
    dist_backend,
    gpu_memory_metrics,
)
from rlkit.hardware.fp16 import (
    FP16_PAYBACK_MARGIN,
    Fp16Probe,
    cached_fp16_probe,
    fp16_decode_pays,
    layer_shapes,
    probe_fp16_decode,
)
from rlkit.hardware.mlas import (
    MLAS_PAYBACK_MARGIN,
    MlasProbe,
    cached_mlas_probe,
    mlas_beats_fp16,
    mlas_decode_pays,
    onnxruntime_unavailable,
    probe_mlas_decode,
)
from rlkit.hardware.precision import (
    DECODE_DTYPES,
    MIXED_PRECISION,
    ResolvedPrecision,
    auto_decode_dtype,
    auto_decode_linears,
    concrete_decode_dtype,
    concrete_mixed_precision,
    fp16_weights_unavailable,
    resolve_precision,
)
from rlkit.hardware.threads import (
    RunHardware,
    oversubscription,
    plan_run,
    warn_once,
    worker_threads,
)

__all__ = [
    "BF16_MIN_SPEEDUP",
    "BF16_BAND",
    "PROBE_ROUNDS",
    "NATIVE_BF16_FLAGS",
    "RELEVANT_FLAGS",
    "CpuInfo",
    "cpu_flags",
    "cpu_info",
    "MatmulProbe",
    "matmul_flops",
    "probe_matmul",
    "default_cache_path",
    "cached_entry",
    "cached_probe",
    "FP16_PAYBACK_MARGIN",
    "Fp16Probe",
    "cached_fp16_probe",
    "fp16_decode_pays",
    "layer_shapes",
    "probe_fp16_decode",
    "PrecisionDecision",
    "bf16_rule",
    "decide_cpu",
    "decide_cuda",
    "precision_decision",
    "hardware_summary",
    "usable_cpus",
    "device_type",
    "MIXED_PRECISION",
    "DECODE_DTYPES",
    "concrete_mixed_precision",
    "concrete_decode_dtype",
    "auto_decode_dtype",
    "fp16_weights_unavailable",
    "auto_decode_linears",
    "onnxruntime_unavailable",
    "MLAS_PAYBACK_MARGIN",
    "MlasProbe",
    "cached_mlas_probe",
    "mlas_beats_fp16",
    "mlas_decode_pays",
    "probe_mlas_decode",
    "ResolvedPrecision",
    "resolve_precision",
    "worker_threads",
    "oversubscription",
    "RunHardware",
    "plan_run",
    "warn_once",
    "DevicePlan",
    "dist_backend",
    "cuda_missing",
    "device_plan",
    "gpu_memory_metrics",
]
