"""Decoding through ONNX Runtime's fp32 GEMM on the CPU: ``rollout.backend: {name: hf, linears:
onnxruntime}``.

At the 8–64 rows of a decode step, MKL's fp32 sgemm (what ``F.linear`` runs) reaches a fraction of the
CPU's matmul peak: on an AMD EPYC Zen 3 it ran SmolLM2's linears at 10–33 GFLOP/s, against 50–97 GFLOP/s for a
1024² matmul. ONNX Runtime's MLAS GEMM, given a weight that stays constant, packs it once into the panels its
kernel streams. Through one session per linear it then ran the same linears 1.4–1.5x faster, in exact fp32
(docs/benchmarks.md, "ONNX Runtime's fp32 GEMM"): between MKL and fbgemm's fp16 weights
(``rlkit.rollout.fp16_weights``), without rounding the weights, so the rollout's log-probs stay those of the
fp32 actor, and with a cheaper repack than fbgemm's.

Each ``nn.Linear`` of the decode copy becomes an :class:`MlasLinear`: one ONNX Runtime session holding a
single ``Gemm(x, W, transB=1)`` node, whose weight (torch's own [out, in] layout, no transpose) is a constant
initializer that MLAS prepacks when the session is built. The copy is a :class:`PackedDecodeCopy`, so a weight
is repacked (its session rebuilt) only when it may have moved: every trainable one once per weight hand-over.
Packing costs 7–12 ns per weight (1.0–1.6 s for SmolLM2's 135 M on one thread), so it pays only for decodes
long enough: ``linears: auto`` weighs that with a probe (``rlkit.hardware.mlas``).

A model the lean step accepts (Llama, Qwen2, Qwen3, Mistral without a sliding window) decodes every token
after the prefill on one ONNX Runtime graph per step instead (``rlkit.rollout.ort_step``), which runs the same
GEMMs without a session call per linear; this copy serves every other model.

``onnxruntime`` and ``onnx`` are optional dependencies (``pip install onnxruntime onnx``); validation names
them when missing.
Shapes: ``[..., in]`` inputs, ``[out, in]`` weights, ``[..., out]`` outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware import onnxruntime_unavailable
from rlkit.hardware.mlas import gemm_session
from rlkit.rollout.packed_copy import PackedDecodeCopy

__all__ = ["MlasDecodeCopy", "MlasLinear"]

SETTING = "rollout.backend.linears=onnxruntime"


class MlasLinear(nn.Module):
    """``y = x @ W.T + b`` by ONNX Runtime's MLAS GEMM on ``W`` prepacked, all fp32; any leading shape
    ``[..., in_features] → [..., out_features]``."""

    def __init__(self, linear: nn.Linear, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pack(linear, name)

    def pack(self, linear: nn.Linear, name: str = "") -> None:
        """Build the session over ``linear`` 's current weight (and bias); MLAS packs the weight here.
        ``name`` is for errors."""
        with torch.no_grad():
            weight = linear.weight.detach().float().contiguous()  # [out, in]; the parameter itself when fp32
            bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        try:
            self.session = gemm_session(weight, bias)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types
            raise RlkitError(f"{SETTING}: onnxruntime could not build {name or 'a linear'}: {exc}") from exc
        self._sources = (weight, bias)  # the memory the initializers were read from stays alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.detach().reshape(-1, self.in_features)  # [M, in]; decoding runs without autograd
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        # the output array is ONNX Runtime's, shared by the tensor (no copy)
        (y,) = self.session.run(None, {"x": rows.numpy()})  # [M, out]
        return torch.from_numpy(y).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weight=fp32 (MLAS prepacked)"
        )


class MlasDecodeCopy(PackedDecodeCopy):
    """The decode copy whose linears run on ONNX Runtime (:class:`MlasLinear`)."""

    def __init__(self, source: nn.Module):
        reason = onnxruntime_unavailable()
        if reason:
            raise RlkitError(f"{SETTING}: {reason}. Or use rollout.backend.linears=torch.")
        super().__init__(source, MlasLinear, SETTING)
