"""One decode step of a Llama-family model over rlkit's slab cache, without transformers' forward plumbing.

``rlkit.rollout.decode`` runs the model's own forward for the prefill and, for every later token, this step
where :func:`lean_step_for` accepts the model (``DecodePlan.lean_step``, on by default). The step calls the
model's own modules (embedding, RMSNorms, q/k/v/o projections, MLP, LM head: an fp16 or bf16 decode copy's
linears included) and does the rest itself: the rotary cos/sin once per step, the token's K/V written into the
slab in place, SDPA over the filled prefix with ``enable_gqa`` (no repeated K/V) and a boolean padding mask
sliced from the loop's own — or, where the cache keeps a group's shared prompt and the step skips enough of
the K/V that way, attention that reads each prompt once for its rows (``rlkit.rollout.shared_prompt``).
What it leaves out is what transformers runs around the same ops at every token: per-module keyword
plumbing, the causal-mask builder, the cache API and the output containers.

Measured on SmolLM2-135M, one AVX2 core (docs/benchmarks.md, "A lean decode forward"): a whole ``generate``
0.87× as long with fp16 weights at 8 rows × 64 tokens and 0.95× in fp32 at 16 × 32 (``benchmarks/ab.py
--change lean``), single steps 0.93-0.95× with logits within 1e-4 (``benchmarks/lean_decode_spike.py``).
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

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2/3's, Mistral's: the same

from rlkit.rollout.shared_prompt import shared_prompt_attention, worth_sharing

__all__ = ["LeanStep", "lean_step_for"]

_ACCEPTED = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def lean_step_for(module: nn.Module) -> LeanStep | None:
    """The lean step for ``module``, or None where the model's own forward must run (module docstring)."""
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
    return LeanStep(module)


class LeanStep:
    """``step(cache, ids, positions, mask)``: the next-token logits of one decode step (module docstring)."""

    def __init__(self, module: nn.Module):
        config = module.config
        self.model, self.head = module.model, module.lm_head
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.qk_norms = hasattr(self.model.layers[0].self_attn, "q_norm")

    def __call__(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Write token ``ids [A, 1]`` at ``positions [A]`` into ``cache`` (a ``SlabCache`` holding ``L - 1``
        positions) and return its next-token logits ``[A, V]``; ``mask [A, L]``: 1 where a position is
        attended (0: left padding)."""
        a = ids.shape[0]
        x = self.model.embed_tokens(ids)  # [A, 1, h]
        cos, sin = self.model.rotary_emb(x, positions[:, None])  # [A, 1, D], once for every layer
        attend = mask.bool()[:, None, None, :]  # [A, 1, 1, L]
        shared = getattr(cache, "shared_prompt", None)
        if not (
            x.device.type == "cpu" and x.dtype == torch.float32 and worth_sharing(shared, a, mask.shape[1])
        ):
            shared = None
        else:  # additive masks: the group's prompt positions, each row's own
            bias = torch.zeros(mask.shape, dtype=x.dtype).masked_fill_(~mask.bool(), float("-inf"))
            prompt_bias = bias[:: shared.rows_per_group, None, None, : shared.length]  # [g, 1, 1, P]
            response_bias = bias[:, None, None, shared.length :]  # [A, 1, 1, L - P]
        for i, (layer, slab) in enumerate(zip(self.model.layers, cache.layers, strict=True)):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(a, 1, self.heads, self.dim)
            k = attn.k_proj(h).view(a, 1, self.kv_heads, self.dim)
            if self.qk_norms:  # Qwen3: RMSNorm over each head's D
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [A, H, 1, D], [A, Hkv, 1, D]
            v = attn.v_proj(h).view(a, 1, self.kv_heads, self.dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # cos/sin broadcast over the heads
            keys, values = slab.update(k, v)  # [A, Hkv, L, D] views of the filled prefix
            if shared is not None:  # the group's prompt K/V read once (rlkit.rollout.shared_prompt)
                o = shared_prompt_attention(
                    q,
                    keys,
                    values,
                    shared.keys[i],
                    shared.values[i],
                    prompt_bias,
                    response_bias,
                    attn.scaling,
                )
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=attend, scale=attn.scaling, enable_gqa=True
                )  # [A, H, 1, D]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(a, 1, self.heads * self.dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(self.model.norm(x))[:, -1]  # [A, V]
