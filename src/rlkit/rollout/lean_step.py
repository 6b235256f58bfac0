"""One decode step of a Llama-family model over rlkit's slab cache, without transformers' forward plumbing.

``rlkit.rollout.decode`` runs the model's own forward for the prefill and, for every later token, this step
where :func:`lean_step_for` accepts the model (``DecodePlan.lean_step``, on by default). The step calls the
model's own embedding, projections (an fp16 or bf16 decode copy's packed linears, a LoRA adapter's layers),
activation and LM head, and does the rest in as few ops as it can: each RMSNorm as one ``F.rms_norm`` (HF's
module runs eight), the q/k/v and gate/up projections as one GEMM each where a packed decode copy fused them
(``rlkit.rollout.packed_copy``; called directly, not through the three members), the rotary cos/sin once per
step and applied to q and k together (``roll`` with the sign of ``rotate_half`` folded into sin), the token's
K/V written into the slab in place, SDPA over the filled prefix with ``enable_gqa`` (no repeated K/V) and a
boolean padding mask sliced from the loop's own — or, where the cache keeps a group's shared prompt and the
step skips enough of the K/V that way, attention that reads each prompt once for its rows
(``rlkit.rollout.shared_prompt``); over a bf16 cache (``rlkit.rollout.bf16_kv``) both in bf16; over a cache
that keeps its keys transposed too (fp32 or bf16), the compiled kernel instead of SDPA
(``rlkit.rollout.attention_kernel``).
What it leaves out is what transformers runs around the same ops at every token: per-module keyword plumbing,
the causal-mask builder, the cache API and the output containers.
Where its layers fit (plain fp32 or oneDNN-packed bf16 linears on the CPU), the layer loop itself runs as one
TorchScript function with the same ops (``rlkit.rollout.scripted_step``, ``scripted=True``; the decode's
``DecodePlan.scripted_layers``), so Python is called once per step instead of once per operator.

Measured on SmolLM2-135M, one AVX2 core (docs/benchmarks.md, "A lean decode forward"): a whole ``generate``
0.87× as long with fp16 weights at 8 rows × 64 tokens and 0.95× in fp32 at 16 × 32 (``benchmarks/ab.py
--change lean``), single steps 0.93-0.95× with logits within 1e-4 (``benchmarks/lean_decode_spike.py``).
The fewer ops (session 21; 2,050 → 1,240 per SmolLM2 step): 0.93-0.95× the step before them over the bf16
decode copy at 8 and 16 rows on Zen 4 (``benchmarks/tight_step_spike.py``).
Not bit-identical (other op order, SDPA over GQA heads), so the rollout's log-probs agree with the model
forward's to float rounding (``tests/unit/rollout/test_lean_step.py``).

Accepted: transformers' ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` (its per-head q/k
RMSNorms run before the rotation, as in its attention) and ``MistralForCausalLM`` as plain modules (not
FSDP-sharded: a sharded layer gathers its weights in its own forward, which this step does not call), every
layer full attention (no sliding window), no tensor-parallel split of the Llama projections
(``pretraining_tp`` 1). Any other model decodes through its own forward.

Shapes: ``A`` rows in the batch, ``L`` filled cache positions after the step, ``H``/``Hkv`` query/KV heads,
``D`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlkit.rollout.attention_kernel import attends_with_kernel, decode_attention
from rlkit.rollout.bf16_kv import kv_attention, shared_prompt_sdpa
from rlkit.rollout.bf16_weights import Bf16Linear
from rlkit.rollout.packed_copy import FusedMember, FusedOutputs
from rlkit.rollout.scripted_step import ScriptedLayers
from rlkit.rollout.shared_prompt import shared_prompt_attention, worth_sharing

__all__ = ["LeanStep", "RMSNormCall", "lean_step_for"]

_ACCEPTED = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def lean_step_for(module: nn.Module, *, scripted: bool = False, fused_glue: bool = False) -> LeanStep | None:
    """The lean step for ``module``, or None where the model's own forward must run (module docstring);
    ``scripted``: its layers run as one TorchScript function where they can
    (``rlkit.rollout.scripted_step``); ``fused_glue``: that function with the compiled glue operators
    (``scripted_step.fused_layer_loop``; they must be loaded)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if cls.__name__ not in _ACCEPTED or not cls.__module__.startswith("transformers.models."):
        return None
    config = module.config
    if getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "use_sliding_window", False):
        return None
    if cls.__name__ == "MistralForCausalLM" and config.sliding_window is not None:  # every layer slides
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return None
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return None
    return LeanStep(module, scripted=scripted, fused_glue=fused_glue)


class LeanStep:
    """``step(cache, ids, positions, mask)``: the next-token logits of one decode step (module docstring)."""

    def __init__(self, module: nn.Module, *, scripted: bool = False, fused_glue: bool = False):
        config = module.config
        self.model, self.head = module.model, _head(module.lm_head)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = [_LeanLayer(layer, self.heads, self.kv_heads, self.dim) for layer in self.model.layers]
        self.final_norm = _rms_norm(self.model.norm)
        self.scripted = ScriptedLayers.of(self, fused_glue) if scripted else None  # None: the loop below
        self.kernel_steps = 0  # steps whose attention was rlkit.rollout.attention_kernel's
        self.fused_steps = 0  # steps through scripted_step.fused_layer_loop

    def __call__(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Write token ``ids [A, 1]`` at ``positions [A]`` into ``cache`` (a ``SlabCache`` holding ``L - 1``
        positions) and return its next-token logits ``[A, V]`` (bf16 from the bf16 decode copy's head:
        ``_head``); ``mask [A, L]``: 1 where a position is
        attended (0: left padding)."""
        a = ids.shape[0]
        x = self.model.embed_tokens(ids[:, 0])  # [A, h]
        cos, sin = self.model.rotary_emb(x[:, None], positions[:, None])  # [A, 1, D], once for every layer
        half = self.dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's signs folded in
        attend = mask.bool()[:, None, None, :]  # [A, 1, 1, L]
        kv_dtype = cache.layers[0].key_slab.dtype
        bf16_kv = kv_dtype == torch.bfloat16 and x.dtype == torch.float32  # rlkit.rollout.bf16_kv
        kernel = attends_with_kernel(cache) and x.dtype == torch.float32  # rlkit.rollout.attention_kernel
        shared, prompt_bias, response_bias = getattr(cache, "shared_prompt", None), None, None
        if not (
            x.device.type == "cpu" and x.dtype == torch.float32 and worth_sharing(shared, a, mask.shape[1])
        ):
            shared = None
        else:  # additive masks (in the K/V's dtype): the group's prompt positions, each row's own
            bias = torch.zeros(mask.shape, dtype=kv_dtype).masked_fill_(~mask.bool(), float("-inf"))
            prompt_bias = bias[:: shared.rows_per_group, None, None, : shared.length]  # [g, 1, 1, P]
            response_bias = bias[:, None, None, shared.length :]  # [A, 1, 1, L - P]
        self.kernel_steps += kernel and shared is None  # a step reading the shared prompt attends on its own
        if self.scripted is not None:
            self.fused_steps += self.scripted.fused
            x = self.scripted(x, cos, sin, attend, cache, shared, prompt_bias, response_bias, bf16_kv, kernel)
            return self.head(self.final_norm(x))
        for i, (layer, slab) in enumerate(zip(self.layers, cache.layers, strict=True)):
            qk, v = layer.project(layer.input_norm(x))  # [A, H + Hkv, D], [A, Hkv, D]
            # rotary on q and k at once: x·cos + rotate_half(x)·sin, rotate_half(x) = roll(x)·(−1 | +1)
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            q = qk[:, : self.heads, None]  # [A, H, 1, D]
            keys, values = slab.update(qk[:, self.heads :, None], v[:, :, None])  # [A, Hkv, L, D] views
            if shared is not None:  # the group's prompt K/V read once (rlkit.rollout.shared_prompt)
                o = (shared_prompt_sdpa if bf16_kv else shared_prompt_attention)(
                    q,
                    keys,
                    values,
                    shared.keys[i],
                    shared.values[i],
                    prompt_bias,
                    response_bias,
                    layer.scale,
                )
            elif kernel:  # over fp32 or bf16 K/V
                o = decode_attention(q, slab.key_slab_t, slab.value_slab, attend, keys.shape[2], layer.scale)
            elif bf16_kv:
                o = kv_attention(q, keys, values, attend, layer.scale)
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=attend, scale=layer.scale, enable_gqa=True
                )  # [A, H, 1, D]
            x = x + layer.o_proj(o.reshape(a, self.heads * self.dim))
            x = x + layer.mlp(layer.post_norm(x))
        return self.head(self.final_norm(x))  # [A, V]


class RMSNormCall:
    """``norm`` (the accepted models' RMSNorm: ``weight · x / sqrt(mean(x²) + eps)`` over the last dim) as one
    ``F.rms_norm`` call, where HF's module runs eight ops; the module itself for an input of another dtype
    than its weight (a bf16 module whose linears hand back fp32)."""

    def __init__(self, norm: nn.Module):
        self.norm, self.weight, self.eps = norm, norm.weight, norm.variance_epsilon
        self.shape = tuple(norm.weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (
            F.rms_norm(x, self.shape, self.weight, self.eps) if x.dtype == self.weight.dtype else self.norm(x)
        )


def _head(head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head as the step calls it: the bf16 decode copy's bias-free head hands back its GEMM's bf16
    logits as written (``Bf16Linear.bf16_product``; its forward widens them to fp32, exactly, a [A, V] copy
    per step that ``rlkit.rollout.sampling.sample_next`` does itself where it must: its compiled draw reads
    bf16 as it is), any other head its own output."""
    if isinstance(head, Bf16Linear) and head.bias is None:
        return head.bf16_product
    return head


def _rms_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm`` as an :class:`RMSNormCall` where it is that RMSNorm, else the module itself."""
    eps, weight = getattr(norm, "variance_epsilon", None), getattr(norm, "weight", None)
    if not type(norm).__name__.endswith("RMSNorm") or eps is None or weight is None or weight.dim() != 1:
        return norm
    return RMSNormCall(norm)


def _fused_group(members: list[nn.Module]) -> FusedOutputs | None:
    """The one GEMM behind sibling projections ``members`` where a packed decode copy fused exactly them, in
    order (``rlkit.rollout.packed_copy``), else None."""
    if not all(isinstance(m, FusedMember) for m in members):
        return None
    group = members[0].group
    in_order = all(m.group is group and m.index == i for i, m in enumerate(members))
    return group if in_order and len(group.splits) == len(members) else None


class _LeanLayer:
    """One decoder layer's parts as the lean step calls them: norms as ``F.rms_norm``, q/k/v as one GEMM where
    a decode copy fused them (else the three projections, a LoRA adapter's included), the MLP likewise."""

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.input_norm = _rms_norm(layer.input_layernorm)
        self.post_norm = _rms_norm(layer.post_attention_layernorm)
        self.scale, self.o_proj = attn.scaling, attn.o_proj
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.qkv = _fused_group([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qk_norms = None
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's D before the rotation
            self.qk_norms = (_rms_norm(attn.q_norm), _rms_norm(attn.k_norm))
        self.act, self.gate_proj, self.up_proj, self.down_proj = (
            mlp.act_fn,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        )
        self.gate_up = _fused_group([mlp.gate_proj, mlp.up_proj])

    def norm_weights(self) -> list[tuple[torch.Tensor, float]] | None:
        """``(weight, eps)`` of the input and post-attention norms, then Qwen3's q and k norms, where each
        runs as one fp32 ``F.rms_norm`` (:class:`RMSNormCall`); None where one does not
        (``rlkit.rollout.scripted_step`` reads them)."""
        norms = [self.input_norm, self.post_norm, *(self.qk_norms or ())]
        if not all(isinstance(n, RMSNormCall) and n.weight.dtype == torch.float32 for n in norms):
            return None
        return [(n.weight, float(n.eps)) for n in norms]

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [A, hidden]`` → the queries and keys as one ``[A, H + Hkv, D]`` (before the rotation) and the
        values ``[A, Hkv, D]``."""
        a, heads, kv_heads, d = h.shape[0], self.heads, self.kv_heads, self.dim
        if self.qkv is not None:
            y = self.qkv.run(h).reshape(a, heads + 2 * kv_heads, d)
            qk, v = y[:, : heads + kv_heads], y[:, heads + kv_heads :]
        else:
            q, k = self.q_proj(h).view(a, heads, d), self.k_proj(h).view(a, kv_heads, d)
            qk, v = torch.cat([q, k], dim=1), self.v_proj(h).view(a, kv_heads, d)
        if self.qk_norms is not None:
            q_norm, k_norm = self.qk_norms
            qk = torch.cat([q_norm(qk[:, :heads]), k_norm(qk[:, heads:])], dim=1)
        return qk, v

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(h)) · up(h))``, ``[A, hidden] → [A, hidden]``."""
        if self.gate_up is not None:
            gate, up = self.gate_up.run(h).split(self.gate_up.splits, dim=-1)
        else:
            gate, up = self.gate_proj(h), self.up_proj(h)
        return self.down_proj(self.act(gate) * up)
