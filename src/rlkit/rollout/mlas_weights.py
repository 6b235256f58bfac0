"""Decoding through ONNX Runtime's fp32 GEMM on the CPU: ``rollout.backend: {name: hf, linears:
onnxruntime}``.

At the 8–64 rows of a decode step, MKL's fp32 sgemm (what ``F.linear`` runs) reaches a fraction of the
CPU's matmul peak; on an AMD EPYC Zen 3 it ran SmolLM2's linears at 16–21 GFLOP/s at 16 rows, against 60–97
GFLOP/s for a 1024² matmul. ONNX Runtime's MLAS GEMM, given a weight that stays constant, packs it once into
the panels its kernel streams, and then ran the same linears 1.9–2.2x faster, in exact fp32 (max |diff| 1e-6
on the outputs; docs/benchmarks.md, "ONNX Runtime's fp32 GEMM"). That is the fbgemm fp16 path's speed
(``rlkit.rollout.fp16_weights``) without rounding the weights to fp16: the rollout's log-probs stay those of
the fp32 actor.

Each ``nn.Linear`` of the decode copy becomes an :class:`MlasLinear`: one ONNX Runtime session holding a
single ``Gemm(x, W, transB=1)`` node, whose weight (torch's own [out, in] layout, no transpose) is a constant
initializer that MLAS prepacks when the session is built. The copy is a :class:`PackedDecodeCopy`, so a weight
is repacked (its session rebuilt) only when it may have moved: every trainable one once per weight hand-over.
Packing costs about 10 ns per weight, ~1.3 s for SmolLM2's 135 M on one thread, so it pays for decodes of
more than a few tokens (the measurement in docs/benchmarks.md).

``onnxruntime`` and ``onnx`` are optional dependencies (``pip install onnxruntime onnx``); validation names
them when missing.
Shapes: ``[..., in]`` inputs, ``[out, in]`` weights, ``[..., out]`` outputs.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware import onnxruntime_unavailable
from rlkit.rollout.fp16_weights import PackedDecodeCopy

__all__ = ["MlasDecodeCopy", "MlasLinear"]

SETTING = "rollout.backend.linears=onnxruntime"


@functools.cache
def _gemm_model(out_features: int, in_features: int, bias: bool) -> bytes:
    """A serialized ONNX model ``y = Gemm(x, w, b, transB=1)``, x [M, in] float, w [out, in] and b [out] as
    initializers whose data the session gets from memory (``add_external_initializers``)."""
    import onnx
    from onnx import TensorProto, helper

    def placeholder(name: str, dims: list[int]) -> onnx.TensorProto:
        tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "memory"), ("offset", "0"), ("length", str(4 * math.prod(dims)))):
            tensor.external_data.add(key=key, value=value)
        return tensor

    inputs = ["x", "w"] + (["b"] if bias else [])
    inits = [placeholder("w", [out_features, in_features])]
    if bias:
        inits.append(placeholder("b", [out_features]))
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
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    try:
        state.set_global_thread_pool_sizes(torch.get_num_threads(), 1)
    except Exception:  # noqa: BLE001 - the environment exists already (another onnxruntime user here)
        return False
    return True


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
        import onnxruntime as ort

        with torch.no_grad():
            weight = linear.weight.detach().float().contiguous()  # [out, in]; the parameter itself when fp32
            bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.log_severity_level = 3  # errors only
        if _threads_shared():
            options.use_per_session_threads = False
        else:
            options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        names, values = ["w"], [ort.OrtValue.ortvalue_from_numpy(weight.numpy())]
        if bias is not None:
            names.append("b")
            values.append(ort.OrtValue.ortvalue_from_numpy(bias.numpy()))
        options.add_external_initializers(names, values)
        try:
            self.session = ort.InferenceSession(
                _gemm_model(self.out_features, self.in_features, bias is not None),
                options,
                providers=["CPUExecutionProvider"],
            )
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types
            raise RlkitError(f"{SETTING}: onnxruntime could not build {name or 'a linear'}: {exc}") from exc
        self._sources = (weight, bias, values)  # the memory the initializers were read from stays alive

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
