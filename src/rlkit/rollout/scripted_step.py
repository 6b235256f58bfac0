"""The lean decode step's layers as one TorchScript function (``DecodePlan.scripted_layers``, default on).

A lean step (``rlkit.rollout.lean_step``) of SmolLM2 runs ~1,240 small operators, and on a CPU at 8-16 rows
each one costs Python as well as its kernel: the interpreter's bytecode between the calls, the module and
wrapper calls around them. :func:`layer_loop` is the same loop — each layer's RMSNorm, q/k/v projection,
rotary, K/V written into the slab, attention (SDPA, or the group's shared prompt read once:
``rlkit.rollout.shared_prompt``; over a bf16 cache ``rlkit.rollout.bf16_kv``'s; the compiled kernel where the
slab keeps its keys transposed: ``rlkit.rollout.attention_kernel``), output projection, residual,
RMSNorm, gate/up, SiLU, down and residual — compiled once per process by ``torch.jit.script`` and run by
TorchScript's interpreter, so a step calls into Python once for the whole stack instead of for every operator
(a CUDA-graph-like replay on the CPU, without capturing shapes: the cache length grows every step). The
operators and their order are the lean step's, so the tokens and log-probs are the same bit for bit
(``tests/unit/rollout/test_scripted_step.py``).

Measured on SmolLM2-135M on an Intel Xeon with AMX, one thread, 2 prompts × 4 samples × 64 tokens
(``benchmarks/ab.py --change scripted --phase gen``; docs/benchmarks.md, "the lean step's layers under
TorchScript"): a whole generate 0.84× the Python loop's with the bf16 decode copy, 0.96× in fp32, where the
GEMMs are most of the step.

**The glue fused** (``DecodePlan.fused_glue``, default on; ``rollout/fused_glue``): :func:`fused_layer_loop`
is the same loop with the work between the GEMMs done by compiled operators (``kernels/decode_glue.cpp``,
built with the attention kernel by ``rlkit.rollout.cpu_kernels``): the residual add fused with the next
RMSNorm and the cast to the GEMM's input dtype, the q/k/v bias with Qwen3's head norms, the rotation and the
K/V writes into the slab (its transposed keys a whole block of positions at a time, the attention kernel
reading the positions after the last whole block from the slab), SiLU times up with its cast — each one pass
over the rows in place of 3-9 torch operators, and the bf16 copy's packed GEMM outputs read as bf16 with their
biases added on the way in. The same arithmetic to float rounding: the same tokens, log-probs within 1e-5 in
fp32 and within the bf16 copy's rounding (``tests/unit/rollout/test_cpu_kernels.py``). Measured on the same
machine (``benchmarks/ab.py --change glue --phase gen``; docs/benchmarks.md, "the decode's glue fused"): a
whole generate 0.87× the unfused loop's with the bf16 copy at 8 rows, 0.76× at 4, 0.95× in fp32 at 8.

Accepted (:meth:`ScriptedLayers.of`): a :class:`~rlkit.rollout.lean_step.LeanStep` on the CPU whose every
layer's projections are all plain ``nn.Linear`` s (fp32 weights, ``F.linear``), all the bf16 decode copy's
oneDNN-packed ones (``rlkit.rollout.bf16_weights``) or all the fp16 copy's fbgemm ones
(``rlkit.rollout.fp16_weights``; TorchScript calls ``quantized::linear_dynamic_fp16`` on their packed
matrices) — q/k/v and gate/up fused or not —, whose norms are RMSNorms with one epsilon run as
``F.rms_norm`` and whose activation is SiLU. Anything else — MLAS weights, a LoRA adapter's layers, another
activation, a GPU — runs the lean step's Python loop.

Shapes: ``A`` rows, ``L`` filled cache positions after the step, ``H``/``Hkv`` query/KV heads, ``D`` head
size, ``P`` the shared prompt's width.
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Tuple, Union  # noqa: UP035  (TorchScript reads these)

import torch
import torch.nn.functional as F
from torch import nn

from rlkit.rollout import cpu_kernels  # noqa: F401  (defines the rlkit:: operators the loops call)
from rlkit.rollout.bf16_kv import kv_attention, shared_prompt_sdpa  # compiled into the script with it
from rlkit.rollout.shared_prompt import shared_prompt_attention  # (likewise)

__all__ = ["ScriptedLayers", "layer_loop"]

# fbgemm's packed fp16 matrix (``torch.ops.quantized.linear_prepack_fp16``; rlkit.rollout.fp16_weights)
HalfWeight = torch.classes.quantized.LinearPackedParamsBase


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    packed: bool,
) -> torch.Tensor:
    """``x @ W.T + b``: ``F.linear`` (plain weights) or the bf16 decode copy's oneDNN-packed GEMM with fp32
    activations in and out (``rlkit.rollout.bf16_weights._packed_linear``, the same ops)."""
    if not packed:
        return F.linear(x, weight, bias)
    scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045
    y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, None, "none", scalars, "").float()
    return y if bias is None else y + bias


def _project(
    x: torch.Tensor,
    weights: List[torch.Tensor],  # noqa: UP006
    biases: List[Optional[torch.Tensor]],  # noqa: UP006, UP045
    packed: bool,
    half: List[HalfWeight],  # noqa: UP006
) -> torch.Tensor:
    """Sibling projections of ``x``, their outputs side by side on the last dim (one fused GEMM, or each):
    ``half`` 's fbgemm fp16 matrices (their biases inside, fp32 in and out) where it holds any, else
    ``weights`` with ``biases`` (:func:`_linear`)."""
    if len(half) > 0:
        if len(half) == 1:
            return torch.ops.quantized.linear_dynamic_fp16(x, half[0])
        return torch.cat([torch.ops.quantized.linear_dynamic_fp16(x, m) for m in half], dim=-1)
    if len(weights) == 1:
        return _linear(x, weights[0], biases[0], packed)
    return torch.cat([_linear(x, weights[i], biases[i], packed) for i in range(len(weights))], dim=-1)


def layer_loop(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: torch.Tensor,
    norms: List[torch.Tensor],  # noqa: UP006
    head_norms: List[torch.Tensor],  # noqa: UP006
    weights: List[List[torch.Tensor]],  # noqa: UP006
    biases: List[List[Optional[torch.Tensor]]],  # noqa: UP006, UP045
    half: List[List[HalfWeight]],  # noqa: UP006
    key_slabs: List[torch.Tensor],  # noqa: UP006
    value_slabs: List[torch.Tensor],  # noqa: UP006
    key_slabs_t: List[torch.Tensor],  # noqa: UP006
    prompt_keys: List[torch.Tensor],  # noqa: UP006
    prompt_values: List[torch.Tensor],  # noqa: UP006
    prompt_bias: Optional[torch.Tensor],  # noqa: UP045
    response_bias: Optional[torch.Tensor],  # noqa: UP045
    start: int,
    eps: float,
    heads: int,
    kv_heads: int,
    dim: int,
    intermediate: int,
    scale: float,
    packed: bool,
    bf16_kv: bool,
    kernel: bool,
) -> torch.Tensor:
    """Every decoder layer of one lean step (``LeanStep.__call__``'s loop, the same ops in the same order):
    ``x [A, hidden]`` the token's embedding, ``cos``/``sin [A, 1, D]`` its rotary tables (``sin`` with
    ``rotate_half``'s signs folded in), ``attend [A, 1, 1, L]`` the padding mask; per layer ``i``:
    ``norms[2i]``/``norms[2i+1]`` the input/post-attention RMSNorm weights, ``head_norms[2i]``/``[2i+1]``
    Qwen3's q/k norms (empty: none), the layer's four GEMMs at ``4i`` (q/k/v: one fused matrix or three),
    ``4i + 1`` (the output projection), ``4i + 2`` (gate/up: fused or two) and ``4i + 3`` (down), each as
    ``weights`` (plain, or bf16-packed where ``packed``) with ``biases`` (None: none), or as fbgemm fp16
    matrices ``half`` (their biases inside; ``weights`` and ``biases`` then empty there), and
    ``key_slabs``/``value_slabs [A, Hkv, capacity, D]`` written at position ``start`` (``L = start + 1``).
    With ``prompt_keys`` (a group's shared prompt K/V ``[g, Hkv, P, D]`` per layer) attention reads it once
    per group, under ``prompt_bias [g, 1, 1, P]``/``response_bias [A, 1, 1, L - P]``; else SDPA.
    ``bf16_kv``: the slabs hold bf16 K/V, attended by ``rlkit.rollout.bf16_kv``'s functions. ``kernel``:
    ``key_slabs_t [A, Hkv, D, C]`` hold the keys transposed too (written at ``start``, in the slabs' dtype),
    attended by ``rlkit::decode_attention`` (``rlkit.rollout.attention_kernel``; over fp32 or bf16 K/V)
    instead of SDPA or the bf16 cache's SDPA. Returns ``[A, hidden]``."""
    a, hidden, turn = x.shape[0], x.shape[1], dim // 2
    for i in range(len(norms) // 2):
        h = F.rms_norm(x, [hidden], norms[2 * i], eps)
        y = _project(h, weights[4 * i], biases[4 * i], packed, half[4 * i]).reshape(
            a, heads + 2 * kv_heads, dim
        )
        qk, v = y[:, : heads + kv_heads], y[:, heads + kv_heads :]
        if len(head_norms) > 0:
            qk = torch.cat(
                [
                    F.rms_norm(qk[:, :heads], [dim], head_norms[2 * i], eps),
                    F.rms_norm(qk[:, heads:], [dim], head_norms[2 * i + 1], eps),
                ],
                dim=1,
            )
        qk = torch.addcmul(qk * cos, qk.roll(turn, dims=-1), sin)
        q = qk[:, :heads, None]
        key_slab, value_slab = key_slabs[i], value_slabs[i]
        key_slab[:, :, start : start + 1].copy_(qk[:, heads:, None])
        value_slab[:, :, start : start + 1].copy_(v[:, :, None])
        if kernel:
            key_slabs_t[i][:, :, :, start : start + 1].copy_(qk[:, heads:, :, None])
        o = _attend(
            q,
            i,
            key_slabs,
            value_slabs,
            key_slabs_t,
            prompt_keys,
            prompt_values,
            prompt_bias,
            response_bias,
            attend,
            start,
            scale,
            bf16_kv,
            kernel,
            False,  # every position's transposed key written above
            False,  # fp32 out: the output projection rounds it (bit for bit as the kernel would)
        )
        x = x + _project(
            o.reshape(a, heads * dim), weights[4 * i + 1], biases[4 * i + 1], packed, half[4 * i + 1]
        )
        h = F.rms_norm(x, [hidden], norms[2 * i + 1], eps)
        gu = _project(h, weights[4 * i + 2], biases[4 * i + 2], packed, half[4 * i + 2])
        gate, up = gu[..., :intermediate], gu[..., intermediate:]
        x = x + _project(F.silu(gate) * up, weights[4 * i + 3], biases[4 * i + 3], packed, half[4 * i + 3])
    return x


def _attend(
    q: torch.Tensor,
    i: int,
    key_slabs: List[torch.Tensor],  # noqa: UP006
    value_slabs: List[torch.Tensor],  # noqa: UP006
    key_slabs_t: List[torch.Tensor],  # noqa: UP006
    prompt_keys: List[torch.Tensor],  # noqa: UP006
    prompt_values: List[torch.Tensor],  # noqa: UP006
    prompt_bias: Optional[torch.Tensor],  # noqa: UP045
    response_bias: Optional[torch.Tensor],  # noqa: UP045
    attend: torch.Tensor,
    start: int,
    scale: float,
    bf16_kv: bool,
    kernel: bool,
    blocked_keys: bool,
    bf16_out: bool,
) -> torch.Tensor:
    """Layer ``i`` 's attention for queries ``q [A, H, 1, D]`` over its slabs' first ``start + 1`` positions
    (the new token's K/V already written): a group's shared prompt read once, the bf16 cache's, the compiled
    kernel's or SDPA (:func:`layer_loop`'s docstring). ``blocked_keys``: the transposed keys hold whole
    blocks only (``rlkit::rotary_write``'s), so the kernel reads the positions after them from the key slab;
    ``bf16_out``: the kernel's output rounded to bf16, the packed output projection's input, by the kernel
    itself (the other paths give fp32, which the projection rounds the same way). ``[A, H, 1, D]``."""
    shared = prompt_bias is not None and response_bias is not None and len(prompt_keys) > 0
    if kernel and not shared:  # over fp32 or bf16 K/V, read in place (no slices of the slabs)
        keys: Optional[torch.Tensor] = key_slabs[i] if blocked_keys else None  # noqa: UP045
        return torch.ops.rlkit.decode_attention(
            q, key_slabs_t[i], value_slabs[i], attend, start + 1, scale, keys, bf16_out
        )
    key_view, values = key_slabs[i][:, :, : start + 1], value_slabs[i][:, :, : start + 1]
    if (
        prompt_bias is not None and response_bias is not None and shared
    ):  # (TorchScript refines the Optionals)
        if bf16_kv:
            return shared_prompt_sdpa(
                q, key_view, values, prompt_keys[i], prompt_values[i], prompt_bias, response_bias, scale
            )
        return shared_prompt_attention(
            q, key_view, values, prompt_keys[i], prompt_values[i], prompt_bias, response_bias, scale
        )
    if bf16_kv:
        return kv_attention(q, key_view, values, attend, scale)
    return F.scaled_dot_product_attention(q, key_view, values, attn_mask=attend, scale=scale, enable_gqa=True)


def _gemm(
    x: torch.Tensor,
    weights: List[torch.Tensor],  # noqa: UP006
    biases: List[Optional[torch.Tensor]],  # noqa: UP006, UP045
    packed: bool,
    half: List[HalfWeight],  # noqa: UP006
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # noqa: UP006, UP045
    """:func:`_project` for the fused loop: ``(output, bias still to add)``. One bf16-packed matrix gives its
    bf16 output as it is, its bias left to the fused operator that reads it; plain linears, fp16 ones and
    several packed ones give fp32 with their biases added (``None``)."""
    if packed and len(weights) == 1 and len(half) == 0:
        scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weights[0], None, "none", scalars, "")
        return y, biases[0]
    return _project(x, weights, biases, packed, half), None


def fused_layer_loop(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: torch.Tensor,
    norms: List[torch.Tensor],  # noqa: UP006
    head_norms: List[torch.Tensor],  # noqa: UP006
    weights: List[List[torch.Tensor]],  # noqa: UP006
    biases: List[List[Optional[torch.Tensor]]],  # noqa: UP006, UP045
    half: List[List[HalfWeight]],  # noqa: UP006
    key_slabs: List[torch.Tensor],  # noqa: UP006
    value_slabs: List[torch.Tensor],  # noqa: UP006
    key_slabs_t: List[torch.Tensor],  # noqa: UP006
    prompt_keys: List[torch.Tensor],  # noqa: UP006
    prompt_values: List[torch.Tensor],  # noqa: UP006
    prompt_bias: Optional[torch.Tensor],  # noqa: UP045
    response_bias: Optional[torch.Tensor],  # noqa: UP045
    start: int,
    eps: float,
    heads: int,
    kv_heads: int,
    dim: int,
    intermediate: int,
    scale: float,
    packed: bool,
    bf16_kv: bool,
    kernel: bool,
) -> torch.Tensor:
    """:func:`layer_loop` (the same arguments, the same arithmetic to float rounding) with the work between
    the GEMMs done by the compiled operators of ``kernels/decode_glue.cpp`` (``rlkit.rollout.cpu_kernels``),
    one pass each: the residual add fused with the next RMSNorm and its cast to the GEMM's input dtype
    (``add_rms_norm_cast``), the q/k/v bias, Qwen3's head norms, the rotation and the K/V writes
    (``rotary_write``; the transposed keys a whole block at a time), SiLU times up (``silu_mul_cast``). A
    packed GEMM's bf16 output goes to them as it is, and the attention kernel writes the packed output
    projection's bf16 input itself."""
    a = x.shape[0]
    layers = len(norms) // 2
    h = torch.ops.rlkit.rms_norm_cast(x, norms[0], eps, packed)
    for i in range(layers):
        y, y_bias = _gemm(h, weights[4 * i], biases[4 * i], packed, half[4 * i])
        q_norm: Optional[torch.Tensor] = None  # noqa: UP045
        k_norm: Optional[torch.Tensor] = None  # noqa: UP045
        if len(head_norms) > 0:
            q_norm, k_norm = head_norms[2 * i], head_norms[2 * i + 1]
        key_slab_t: Optional[torch.Tensor] = None  # noqa: UP045
        if kernel:
            key_slab_t = key_slabs_t[i]
        q = torch.ops.rlkit.rotary_write(
            y,
            y_bias,
            cos,
            sin,
            q_norm,
            k_norm,
            eps,
            key_slabs[i],
            value_slabs[i],
            key_slab_t,
            start,
            heads,
            kv_heads,
        )
        o = _attend(
            q,
            i,
            key_slabs,
            value_slabs,
            key_slabs_t,
            prompt_keys,
            prompt_values,
            prompt_bias,
            response_bias,
            attend,
            start,
            scale,
            bf16_kv,
            kernel,
            True,  # rotary_write fills the transposed keys a whole block at a time
            packed,  # the packed output projection's bf16 input written by the kernel (no cast op)
        )
        o = o.reshape(a, heads * dim)
        attended, attended_bias = _gemm(o, weights[4 * i + 1], biases[4 * i + 1], packed, half[4 * i + 1])
        x, h = torch.ops.rlkit.add_rms_norm_cast(x, attended, attended_bias, norms[2 * i + 1], eps, packed)
        gu, gu_bias = _gemm(h, weights[4 * i + 2], biases[4 * i + 2], packed, half[4 * i + 2])
        m = torch.ops.rlkit.silu_mul_cast(gu, gu_bias, packed)
        d, d_bias = _gemm(m, weights[4 * i + 3], biases[4 * i + 3], packed, half[4 * i + 3])
        if i + 1 < layers:
            x, h = torch.ops.rlkit.add_rms_norm_cast(x, d, d_bias, norms[2 * i + 2], eps, packed)
        else:
            x = x + (d.float() if d_bias is None else d.float() + d_bias)
    return x


@functools.cache
def scripted_layer_loop(fused: bool = False) -> torch.jit.ScriptFunction | None:
    """:func:`layer_loop` (``fused``: :func:`fused_layer_loop`) compiled by TorchScript, once per process;
    None (with a warning) where it cannot be: TorchScript reads the function's source, which an install
    without ``.py`` files lacks."""
    try:
        return torch.jit.script(fused_layer_loop if fused else layer_loop)
    except Exception as err:  # noqa: BLE001  (any failure: the Python loop runs instead)
        warnings.warn(
            "rlkit: the lean decode step's layers could not be compiled by TorchScript "
            f"({type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}); they run in Python "
            "(slower, same tokens).",
            stacklevel=2,
        )
        return None


class ScriptedLayers:
    """A lean step's layers as :func:`layer_loop`'s arguments, gathered once per ``generate``; calling it runs
    every layer of one step, each slab advanced as ``SlabLayer.update`` advances it."""

    def __init__(self, lean, parts: dict, kind: str, eps: float, intermediate: int, fused: bool = False):
        # kind: the GEMMs' weights, "plain", "bf16" (oneDNN-packed: the loops' ``packed``) or "fp16" (fbgemm)
        self.lean, self.parts, self.kind, self.packed = lean, parts, kind, kind == "bf16"
        self.eps, self.intermediate = eps, intermediate
        self.fused = fused and scripted_layer_loop(True) is not None
        self.loop = scripted_layer_loop(self.fused)

    @classmethod
    def of(cls, lean, fused: bool = False) -> ScriptedLayers | None:
        """The scripted loop for ``lean`` (a ``rlkit.rollout.lean_step.LeanStep``), or None where the Python
        loop must run (module docstring); ``fused``: :func:`fused_layer_loop` (the compiled operators must be
        loaded: ``rlkit.rollout.cpu_kernels.kernel_unavailable()`` None)."""
        gathered = [_layer_parts(layer) for layer in lean.layers]
        if scripted_layer_loop() is None or not gathered or any(parts is None for parts in gathered):
            return None
        kinds = {parts["kind"] for parts in gathered}
        eps = {e for parts in gathered for e in parts["eps"]}
        widths = {parts["intermediate"] for parts in gathered}
        if len(kinds) != 1 or len(eps) != 1 or len(widths) != 1:
            return None
        if any(p.device.type != "cpu" for parts in gathered for p in parts["norms"]):
            return None
        merged = {name: [] for name in ("norms", "head_norms", "weights", "biases", "half")}
        for parts in gathered:
            for name in merged:
                merged[name].extend(parts[name])
        return cls(lean, merged, kinds.pop(), eps.pop(), widths.pop(), fused)

    def __call__(
        self,
        x,
        cos,
        sin,
        attend,
        cache,
        shared,
        prompt_bias,
        response_bias,
        bf16_kv: bool = False,
        kernel: bool = False,
    ) -> torch.Tensor:
        """Every layer of one step for ``x [A, hidden]`` (``LeanStep.__call__``'s arguments): the new K/V
        written into each slab (its ``length`` advanced) and the last layer's output returned."""
        slabs = cache.layers
        start = slabs[0].length
        for slab in slabs:
            slab.advance(start + 1)  # (SlabLayer.advance) the loop below writes position ``start``
        lean = self.lean
        return self.loop(
            x,
            cos,
            sin,
            attend,
            **self.parts,
            key_slabs=[slab.key_slab for slab in slabs],
            value_slabs=[slab.value_slab for slab in slabs],
            key_slabs_t=[slab.key_slab_t for slab in slabs] if kernel else [],
            prompt_keys=shared.keys if shared is not None else [],
            prompt_values=shared.values if shared is not None else [],
            prompt_bias=prompt_bias,
            response_bias=response_bias,
            start=start,
            eps=self.eps,
            heads=lean.heads,
            kv_heads=lean.kv_heads,
            dim=lean.dim,
            intermediate=self.intermediate,
            scale=float(lean.layers[0].scale),
            packed=self.packed,
            bf16_kv=bf16_kv,
            kernel=kernel,
        )


def _weights(linears: list[nn.Module], fused) -> tuple[list, list, list, str] | None:
    """``(weights, biases, half, kind)`` of sibling projections ``linears`` (``fused``: the packed group that
    holds them as one matrix, or None), ``kind`` ``"plain"``, ``"bf16"`` (oneDNN-packed) or ``"fp16"``
    (fbgemm: ``half`` holds the matrices, biases inside); None where one is none of these."""
    from rlkit.rollout.bf16_weights import Bf16FusedLinear, Bf16Linear
    from rlkit.rollout.fp16_weights import Fp16FusedLinear, Fp16Linear

    if fused is not None:
        if type(fused) is Bf16FusedLinear:
            return [fused.packed], [fused.bias], [], "bf16"
        if type(fused) is Fp16FusedLinear:
            return [], [], [fused.packed], "fp16"
        return None
    for cls, kind in ((nn.Linear, "plain"), (Bf16Linear, "bf16"), (Fp16Linear, "fp16")):
        if all(type(m) is cls for m in linears):
            if kind == "fp16":
                return [], [], [m.packed for m in linears], kind
            return (
                [m.weight if kind == "plain" else m.packed for m in linears],
                [m.bias for m in linears],
                [],
                kind,
            )
    return None


def _layer_parts(layer) -> dict | None:
    """One lean layer's (``rlkit.rollout.lean_step._LeanLayer``) weights as :func:`layer_loop` takes them, or
    None where it cannot run there."""
    weighed = layer.norm_weights()
    if weighed is None:
        return None
    norms, head_norms = weighed[:2], weighed[2:]
    if type(layer.act) is not nn.SiLU and type(layer.act).__name__ != "SiLUActivation":
        return None
    gemms = (  # the loop's order: q/k/v, the output projection, gate/up, down
        _weights([layer.q_proj, layer.k_proj, layer.v_proj], layer.qkv),
        _weights([layer.o_proj], None),
        _weights([layer.gate_proj, layer.up_proj], layer.gate_up),
        _weights([layer.down_proj], None),
    )
    if any(g is None for g in gemms) or len({g[3] for g in gemms}) != 1:
        return None
    return {
        "kind": gemms[0][3],
        "eps": [n[1] for n in (*norms, *head_norms)],
        "intermediate": layer.gate_proj.out_features,
        "norms": [n[0] for n in norms],
        "head_norms": [n[0] for n in head_norms],
        "weights": [g[0] for g in gemms],
        "biases": [g[1] for g in gemms],
        "half": [g[2] for g in gemms],
    }
