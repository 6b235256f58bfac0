"""Decoding with fp16 weights on an x86 CPU: ``rollout.backend: {name: hf, dtype: float16}``.

On a CPU without fast bf16 (AVX2 only), a decode step multiplies 8–64 rows by every weight matrix, and
MKL's fp32 sgemm at that shape reaches neither the matmul peak nor the read bandwidth. fbgemm (PyTorch's x86
quantized backend) has a GEMM made for this shape: the weights packed once in fp16 (half the bytes to read),
the activations and the accumulation in fp32 (the packed fp16 values are widened with F16C on the fly). The
measurements (``benchmarks/decode_kernels.py``, ``benchmarks/decode.py --ab fp16``) are in
docs/benchmarks.md, "fp16 decode weights".

The decode copy (:class:`Fp16DecodeCopy`, ``rlkit.rollout.packed_copy.PackedDecodeCopy``'s machinery) is a
deep copy of the actor's module whose ``nn.Linear`` s are :class:`Fp16Linear` (the packed weight, bias kept
fp32) — a decoder layer's q/k/v and gate/up siblings one :class:`Fp16FusedLinear` each (one GEMM where three
or two ran, each member's outputs the same bit for bit) — and whose other parameters (embeddings, norms,
LoRA adapters) stay fp32 and are copied at every refresh; a weight is repacked only when it may have moved
(that module's docstring). The lean step's scripted layers call the packed matrices themselves
(``rlkit.rollout.scripted_step``).

Numerics: fp16 keeps 11 significant bits (bf16: 8), so each weight is rounded by at most 2^-11
relative; one forward of SmolLM2-135M moved no log-prob over its whole vocabulary by more than 0.02, and the
sampled tokens' probabilities moved by ~3e-4 on the tiny model (the offpolicy smoke run). A weight beyond
fp16's range (|w| > 65504) is an error, never an inf. The rollout's log-probs are those of the fp16-weight
model, as with any decode copy; ``algorithm.rollout_correction`` corrects for the difference.
"""

from __future__ import annotations

import torch
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware import fp16_weights_unavailable
from rlkit.rollout.packed_copy import PackedDecodeCopy, PackedSiblings, stacked_bias

__all__ = ["Fp16DecodeCopy", "Fp16FusedLinear", "Fp16Linear"]

_FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504


class Fp16Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed in fp16 by fbgemm; ``x``, ``b`` and ``y`` fp32, any leading
    shape ``[..., in_features] → [..., out_features]``."""

    def __init__(self, linear: nn.Linear, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pack(linear, name)

    def pack(self, linear: nn.Linear, name: str = "") -> None:
        """Pack ``linear`` 's current weight (and bias); ``name`` for the error where a weight exceeds
        fp16."""
        self.packed = _prepack([linear], (name,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16 (fbgemm packed)"
        )


def _prepack(linears: list[nn.Linear], names: tuple[str, ...]):
    """fbgemm's packed fp16 matrix of ``linears`` ' weights, their output rows stacked, with their fp32 biases
    (zero where one of several has none; None where none has one). A weight beyond fp16's range is an error
    naming its linear."""
    with torch.no_grad():
        weights = [linear.weight.detach().float() for linear in linears]
        for weight, name in zip(weights, names, strict=True):
            largest = float(weight.abs().max())
            if not largest <= _FP16_MAX:
                raise RlkitError(
                    f"rollout.backend.dtype=float16: {name or 'a linear'}'s weight holds {largest:g}, "
                    f"beyond fp16's range ({_FP16_MAX:g}); decode in float32 (or bfloat16) instead."
                )
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return torch.ops.quantized.linear_prepack_fp16(weight.contiguous(), stacked_bias(linears))


class Fp16FusedLinear(PackedSiblings):
    """Sibling linears ``linears`` (one input width) as one fbgemm fp16 matrix, their output rows stacked:
    ``output(x, i)`` is linear ``i`` 's ``[..., out_i]`` as :class:`Fp16Linear` computes it (each output
    element the same fp32 sum over the same fp16-rounded weights), the GEMM run once for all of them
    (``rlkit.rollout.packed_copy.FusedMember``)."""

    packing = "fp16 (fbgemm packed)"

    def pack(self, linears: list[nn.Linear], names: tuple[str, ...] = ()) -> None:
        """Pack the linears' current weights (and biases) as one matrix."""
        self.packed = _prepack(linears, names or ("",) * len(linears))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)


class Fp16DecodeCopy(PackedDecodeCopy):
    """The decode copy with fbgemm fp16 weights (:class:`Fp16Linear`): ``rollout.backend.dtype: float16``."""

    def __init__(self, source: nn.Module):
        reason = fp16_weights_unavailable()
        if reason:
            raise RlkitError(f"rollout.backend.dtype=float16: {reason}. Use rollout.backend.dtype=float32.")
        super().__init__(source, Fp16Linear, "rollout.backend.dtype=float16", fused_cls=Fp16FusedLinear)
