"""What ``auto`` precision and decode dtype become for a run (``rlkit.hardware.cpu`` decides bf16 or
fp32; ``rlkit.hardware.fp16`` whether fp16 decode weights pay where bf16 is not fast), the checks of explicit
values, and the warning where an explicit bf16 will be slow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkit.hardware.cpu import PrecisionDecision, cpu_info, device_type, precision_decision
from rlkit.hardware.fp16 import PROBE_LAYER, Layer, cached_fp16_probe, fp16_decode_pays

__all__ = [
    "MIXED_PRECISION",
    "DECODE_DTYPES",
    "concrete_mixed_precision",
    "concrete_decode_dtype",
    "auto_decode_dtype",
    "auto_decode_linears",
    "fp16_weights_unavailable",
    "ResolvedPrecision",
    "resolve_precision",
]

MIXED_PRECISION = ("fp32", "bf16")


DECODE_DTYPES = ("float32", "bfloat16", "float16")


def concrete_mixed_precision(value: str, device: Any = "cpu") -> str:
    """``auto`` → this device's decision; ``fp32`` / ``bf16`` unchanged."""
    if value == "auto":
        return precision_decision(device_type(device)).mixed_precision
    if value not in MIXED_PRECISION:
        from rlkit.errors import RlkitError

        raise RlkitError(f"mixed_precision={value!r}: valid values are auto, fp32, bf16.")
    return value


def auto_decode_dtype(
    decision: PrecisionDecision,
    max_new_tokens: int | None = None,
    layer: Callable[[], Layer | None] | None = None,
) -> tuple[str, str]:
    """(``auto``'s decode dtype, why) on ``decision``'s device for decodes of up to ``max_new_tokens``:
    bfloat16 where bf16 is fast; on a CPU where it is not, float16 (fbgemm fp16 weights) where the cached fp16
    probe of the model's decoder layer (``layer()``; a None answer: a generic layer) says packing pays back
    well within ``max_new_tokens`` (``rlkit.hardware.fp16``), else float32. ``max_new_tokens`` or ``layer``
    None (a backend without fbgemm fp16 weights: an engine decodes in its own dtype): the bf16-or-fp32
    decision."""
    if (
        decision.device != "cpu"
        or decision.decode_dtype != "float32"
        or max_new_tokens is None
        or layer is None
        or fp16_weights_unavailable()
    ):
        return decision.decode_dtype, ""
    shapes = layer() or PROBE_LAYER
    probe = cached_fp16_probe(decision.cpu or cpu_info(), layer=shapes)
    pays, why = fp16_decode_pays(probe, max_new_tokens)
    return ("float16" if pays else "float32"), why


def auto_decode_linears(
    decision: PrecisionDecision,
    decode_dtype: str | None,
    max_new_tokens: int | None = None,
    layer: Callable[[], Layer | None] | None = None,
) -> tuple[str, str]:
    """(``auto``'s decode linears, why): ``onnxruntime`` where the run decodes in float32 on a CPU,
    onnxruntime is installed and the cached probe of the model's decoder layer (``layer()``; None: a generic
    layer) says its prepacked GEMM pays back well within ``max_new_tokens`` (``rlkit.hardware.mlas``); else
    ``torch``, with an empty reason where nothing was weighed."""
    from rlkit.hardware.mlas import cached_mlas_probe, mlas_decode_pays, onnxruntime_unavailable

    if (
        decision.device != "cpu"
        or decode_dtype != "float32"
        or max_new_tokens is None
        or layer is None
        or onnxruntime_unavailable()
    ):
        return "torch", ""
    probe = cached_mlas_probe(decision.cpu or cpu_info(), layer=layer() or PROBE_LAYER)
    pays, why = mlas_decode_pays(probe, max_new_tokens)
    return ("onnxruntime" if pays else "torch"), why


def _mlas_or_fp16(
    decision: PrecisionDecision, max_new_tokens: int | None, layer: Callable[[], Layer | None] | None
) -> tuple[str, str]:
    """Where ``auto`` chose fp16 weights: ``onnxruntime`` (decoding in float32) if its cached probe says it
    costs less over ``max_new_tokens`` than fp16 weights (``rlkit.hardware.mlas.mlas_beats_fp16``), else
    ``torch``."""
    from rlkit.hardware.mlas import cached_mlas_probe, mlas_beats_fp16, onnxruntime_unavailable

    if max_new_tokens is None or layer is None or onnxruntime_unavailable():
        return "torch", ""
    cpu, shapes = decision.cpu or cpu_info(), layer() or PROBE_LAYER
    wins, why = mlas_beats_fp16(
        cached_mlas_probe(cpu, layer=shapes), cached_fp16_probe(cpu, layer=shapes), max_new_tokens
    )
    return ("onnxruntime" if wins else "torch"), why


def _graph_decides(
    decision: PrecisionDecision,
    decode_dtype: str | None,
    linears: str | None,
    max_new_tokens: int | None,
    graph: Callable[[int, bool], tuple[str, str, str] | None] | None,
) -> tuple[str, str, str] | None:
    """``graph`` 's (dtype, linears, why) where it decides (:func:`resolve_precision`), else None: on any CPU,
    whether it trains in bf16 or fp32 (the tiny test model decodes fastest as the fp32 graph even where bf16
    is fast; SmolLM2 with bf16 weights)."""
    if graph is None or linears != "auto" or not max_new_tokens or decision.device != "cpu":
        return None
    # auto: reduced-precision weights allowed (fp16, bf16: where the probe measured them)
    if decode_dtype == "auto":
        return graph(max_new_tokens, True)
    if decode_dtype == "float32":
        return graph(max_new_tokens, False)
    return None


def concrete_decode_dtype(
    value: str | None,
    device: Any = "cpu",
    max_new_tokens: int | None = None,
    layer: Callable[[], Layer | None] | None = None,
) -> str | None:
    """``auto`` → this device's decision for decodes of up to ``max_new_tokens`` by a model of decoder layer
    ``layer()`` (:func:`auto_decode_dtype`); ``float32`` / ``bfloat16`` / ``float16`` / None (the weights'
    own) unchanged."""
    if value == "auto":
        return auto_decode_dtype(precision_decision(device_type(device)), max_new_tokens, layer)[0]
    if value is not None and value not in DECODE_DTYPES:
        from rlkit.errors import RlkitError

        raise RlkitError(
            f"rollout.backend.dtype={value!r}: the hf backend decodes in auto, float32, bfloat16 "
            f"or float16 (auto: bfloat16 where this device's bf16 is fast, float16 where fp16 weights pay "
            f"for their packing, else float32)."
        )
    if value == "float16" and device_type(device) == "cpu" and (reason := fp16_weights_unavailable()):
        from rlkit.errors import RlkitError

        raise RlkitError(
            f"rollout.backend.dtype=float16: {reason}. Use rollout.backend.dtype=float32 (or auto)."
        )
    return value


def fp16_weights_unavailable() -> str | None:
    """Why this torch build cannot decode with fp16 weights on the CPU (``rlkit.rollout.fp16_weights``), or
    None."""
    import torch

    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines:
        return (
            f"this torch build has no fbgemm (quantized engines: {engines}); fbgemm's fp16-weight GEMM needs "
            "an x86-64 CPU with AVX2"
        )
    return None


@dataclass(frozen=True)
class ResolvedPrecision:
    mixed_precision: str  # what the actor, critic and reference use
    decode_dtype: str | None  # what the rollout decodes in (None: the backend has no such option)
    decision: PrecisionDecision
    warnings: tuple[str, ...] = ()
    explicit: tuple[str, ...] = ()  # which of the two the recipe set itself (not auto)
    decode_reason: str = ""  # why auto chose float16 or float32 on a CPU without fast bf16 ("" otherwise)
    # the hf backend's CPU decode linears (torch / onnxruntime; None: no such option) and why auto chose them
    decode_linears: str | None = None
    linears_reason: str = ""

    def params(self) -> dict[str, Any]:
        """Run parameters (logged under ``resolved.``)."""
        out: dict[str, Any] = {
            "mixed_precision": self.mixed_precision,
            "decode_dtype": self.decode_dtype or "n/a",
            "precision_reason": self.decision.reason,
        }
        if self.decode_reason:
            out["decode_reason"] = self.decode_reason
        if self.decode_linears:
            out["decode_linears"] = self.decode_linears
        if self.linears_reason:
            out["decode_linears_reason"] = self.linears_reason
        d = self.decision
        if d.cpu is not None and d.probe is not None:
            out |= {
                "cpu_model": d.cpu.model,
                "cpu_flags": " ".join(d.cpu.flags) or "-",
                "matmul_gflops_fp32": round(d.probe.fp32_flops / 1e9, 2),
                "matmul_gflops_bf16": round(d.probe.bf16_flops / 1e9, 2),
                "bf16_ratio": round(d.probe.ratio, 3),
                "precision_rule": d.rule,
                "bf16_ratios": " ".join(f"{r:.3f}" for r in d.probe.ratios) or "-",
            }
        return out


def resolve_precision(
    mixed_precision: str,
    decode_dtype: str | None,
    device: str,
    *,
    decision: PrecisionDecision | None = None,
    max_new_tokens: int | None = None,
    layer: Callable[[], Layer | None] | None = None,
    linears: str | None = None,
    graph: Callable[[int, bool], tuple[str, str, str] | None] | None = None,
) -> ResolvedPrecision:
    """Concrete actor precision, decode dtype and decode linears for a run; ``decode_dtype`` / ``linears``
    None = not applicable; ``max_new_tokens``: the run's longest decode (``data.max_response_length``) and
    ``layer``: the model's decoder layer (asked only where it matters), which ``auto`` weighs against the cost
    of packing fp16 weights (:func:`auto_decode_dtype`) or ONNX Runtime's (:func:`auto_decode_linears`).
    Explicit ``onnxruntime`` linears decode in float32, so they make an ``auto`` dtype float32.

    ``graph(max_new_tokens, reduced_allowed)``: for a model the one-graph decode step takes, ``(dtype,
    linears, why)`` from its probe of the whole step (``rlkit.rollout.graph_probe``: F.linear, the graph, or
    fp16 or bf16 weights where allowed and measured), or None; where given, it decides ``auto`` linears
    (and an ``auto`` or float32 dtype with them) on a CPU, in place of the per-linear probes and of the
    bf16-or-fp32 decision.

    An explicit bf16 on a CPU without native bf16 (or whose bf16 measured slower than fp32) is kept, with a
    warning naming the measured ratio."""
    d = decision or precision_decision(device_type(device))
    mp = d.mixed_precision if mixed_precision == "auto" else concrete_mixed_precision(mixed_precision)
    decode_reason = linears_reason = ""
    whole = _graph_decides(d, decode_dtype, linears, max_new_tokens, graph)
    if whole is not None:  # the probe of the whole decode step chose dtype and linears together
        dd, linears, linears_reason = whole
        decode_reason = (
            "chosen with the linears (the probe of the whole decode step)" if decode_dtype == "auto" else ""
        )
    elif decode_dtype == "auto" and linears == "onnxruntime":
        dd = "float32"
        decode_reason = "rollout.backend.linears=onnxruntime decodes with fp32 weights"
    elif decode_dtype == "auto":
        dd, decode_reason = auto_decode_dtype(d, max_new_tokens, layer)
    else:
        dd = concrete_decode_dtype(decode_dtype, d.device)
    if whole is None and linears == "auto" and decode_dtype == "auto" and dd == "float16":
        # fp16 paid: weigh MLAS against it
        linears, linears_reason = _mlas_or_fp16(d, max_new_tokens, layer)
        dd = "float32" if linears == "onnxruntime" else dd
    elif whole is None and linears == "auto":
        linears, linears_reason = auto_decode_linears(d, dd, max_new_tokens, layer)
    warnings = _slow_bf16_warnings(d, mp, mixed_precision, dd, decode_dtype)
    explicit = tuple(
        k
        for k, asked in (("mixed_precision", mixed_precision), ("decode_dtype", decode_dtype))
        if asked not in ("auto", None)
    )
    return ResolvedPrecision(mp, dd, d, tuple(warnings), explicit, decode_reason, linears, linears_reason)


def _slow_bf16_warnings(
    d: PrecisionDecision, mp: str, mixed_precision: str, dd: str | None, decode_dtype: str | None
) -> list[str]:
    """A warning for each bf16 the recipe asked for explicitly (``mp`` resolved from ``mixed_precision``,
    ``dd`` from ``decode_dtype``) on a CPU where bf16 is really slow: measured slower than fp32, or no native
    bf16 (not where it is only below 2x)."""
    slow = (
        d.device == "cpu"
        and not d.bf16_fast
        and ((d.ratio or 0.0) < 1.0 or not (d.cpu and d.cpu.native_bf16))
    )
    warnings = []
    for key, value, asked, fp32 in (
        ("actor.mixed_precision", mp, mixed_precision, "fp32"),
        ("rollout.backend.dtype", dd, decode_dtype, "float32"),
    ):
        if slow and asked != "auto" and value in ("bf16", "bfloat16"):
            warnings.append(
                f"{key}={value} on a CPU where bf16 is slow: {d.reason}. Expect a much slower run; "
                f"set {key}=auto (or {fp32})."
            )
    return warnings
