"""Decoding with bf16 weights on the CPU: ``rollout.backend: {name: hf, dtype: bfloat16}``.

A decode step multiplies a few rows (8–64) by every weight matrix. ``F.linear`` on bf16 tensors reaches
about half of what oneDNN's bf16 GEMM does at that shape when oneDNN gets the weight already in its own
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the packing torch's CPU compiler uses), and a
decode copy whose every parameter is bf16 also runs the attention in bf16, where torch's CPU SDPA is 5–8×
slower than in fp32 (SmolLM2 at 8 rows × 300 positions: 2.3 ms a layer against 0.29). The decode copy here
(:class:`Bf16DecodeCopy`, ``rlkit.rollout.packed_copy.PackedDecodeCopy`` 's machinery) therefore packs every
``nn.Linear`` 's weight for oneDNN in bf16 and keeps everything else fp32: each linear takes fp32 activations,
multiplies in bf16 with fp32 accumulation and hands back fp32 (:class:`Bf16Linear`), so the residual stream,
norms, rotary, KV cache, attention and sampling stay fp32 — what ``torch.autocast`` does for the actor's bf16
forward (a long decode's KV cache and attention excepted: ``rlkit.rollout.bf16_kv``). Sibling projections that
read one input (q/k/v, gate/up) are packed as one matrix (:class:`Bf16FusedLinear`): one GEMM, one cast in and
one out where there were three or two.
Measured in docs/benchmarks.md ("bf16 weights packed for oneDNN").

Numerics: each GEMM's output equals ``F.linear`` on the bf16-rounded input and weight (bitwise on the
machines measured); the rollout's log-probs are those of this model, and ``algorithm.rollout_correction``
corrects for the difference from the actor's. The trainable weights are repacked once per weight hand-over
(``PackedDecodeCopy.refresh``): SmolLM2-135M about 0.15 s on one core.

Only on the CPU, where torch has oneDNN and oneDNN packs bf16 on this CPU (:func:`bf16_weights_unavailable`:
not on AVX2-only CPUs); elsewhere (CUDA, a torch without oneDNN, AVX2) ``dtype: bfloat16`` decodes with a
plain bf16 copy of the module.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from rlkit.rollout.packed_copy import PackedDecodeCopy, PackedSiblings, stacked_bias

__all__ = ["Bf16DecodeCopy", "Bf16FusedLinear", "Bf16Linear", "bf16_weights_unavailable"]


@functools.cache
def bf16_weights_unavailable() -> str | None:
    """Why this torch build or CPU cannot decode with oneDNN-packed bf16 weights, or None. oneDNN packs bf16
    only on CPUs with avx512bw/vl/dq or avx_ne_convert (not on AVX2-only ones), so a tiny weight is packed
    and multiplied once to find out."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return "this torch build has no oneDNN packed linear (torch.ops.mkldnn._linear_pointwise)"
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16))
        _packed_linear(torch.ones(2, 16), packed, None)
    except RuntimeError as err:
        return f"oneDNN cannot pack bf16 weights on this CPU ({str(err).strip().splitlines()[0]})"
    return None


class Bf16Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed in bf16 for oneDNN; ``x``, ``b`` and ``y`` fp32, any leading
    shape ``[..., in_features] → [..., out_features]`` (the product rounded to bf16, as autocast's is)."""

    def __init__(self, linear: nn.Linear, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pack(linear, name)

    def pack(self, linear: nn.Linear, name: str = "") -> None:
        """Pack ``linear`` 's current weight (the bias kept fp32); ``name`` unused (no weight is out of
        bf16's range: it shares fp32's exponent)."""
        with torch.no_grad():
            weight = linear.weight.detach().to(torch.bfloat16).contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self.bias = None if linear.bias is None else linear.bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias)

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` as oneDNN writes it, ``[..., out_features]`` bf16: ``forward`` 's values before it
        widens them (exactly) and adds the bias. The lean step's head hands these logits to the sampler,
        whose compiled draw reads bf16 as it is (``rlkit.rollout.sampling``)."""
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weight=bf16 (oneDNN packed)"
        )


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
    return y.float() if bias is None else y.float() + bias


class Bf16FusedLinear(PackedSiblings):
    """Sibling linears ``linears`` (one input width) as one oneDNN-packed bf16 matrix, their output rows
    stacked: ``output(x, i)`` is linear ``i`` 's ``[..., out_i]`` as :class:`Bf16Linear` computes it (each
    output element the same sum over the same bf16-rounded operands), the GEMM run once for all of them
    (``rlkit.rollout.packed_copy.FusedMember``)."""

    packing = "bf16 (oneDNN packed)"

    def pack(self, linears: list[nn.Linear], names: tuple[str, ...] = ()) -> None:
        """Pack the linears' current weights as one matrix (their biases kept fp32, zero where one has
        none)."""
        with torch.no_grad():
            weight = torch.cat([linear.weight.detach().to(torch.bfloat16) for linear in linears])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.bias = stacked_bias(linears)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias)


class Bf16DecodeCopy(PackedDecodeCopy):
    """The CPU decode copy with oneDNN-packed bf16 weights (:class:`Bf16Linear`): ``rollout.backend.dtype:
    bfloat16`` on a CPU."""

    def __init__(self, source: nn.Module):
        super().__init__(source, Bf16Linear, "rollout.backend.dtype=bfloat16", fused_cls=Bf16FusedLinear)
