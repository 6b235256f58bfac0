"""Eager attention over grouped query heads, for the bf16 actor on a CPU.

On a CPU the bf16 actor trains with eager attention (torch's SDPA backward is slow in bf16 there:
docs/benchmarks.md). transformers' eager attention first copies every KV head to each of the query heads
that share it (``repeat_kv``: ``[B, Hkv, L, D] → [B, H, L, D]``), and its backward sums those copies again.
This one multiplies each KV head with its group of query heads at once instead: the query ``[B, H, T, D]``
read as ``[B, Hkv, G·T, D]`` (query head ``h = kv·G + j``, the order ``repeat_kv`` gives), so the scores are
``[B, Hkv, G·T, L]`` and no key or value is copied. The products and sums are eager attention's; a GEMM
over G·T rows may add in another order than one over T, so outputs and gradients agree to the dtype's
rounding (``tests/unit/models/test_attention.py``; bitwise at SmolLM2's shapes on Zen 4). Measured in
docs/benchmarks.md ("Grouped eager attention for the bf16 actor").

:func:`grouped_eager_name` registers it once with transformers (``AttentionInterface``, and eager's additive
mask under the same name) and returns the name to hand ``set_attn_implementation``; :func:`eager_kind` says
whether an attention implementation is one of the two eager ones (both take the additive float mask);
:func:`cpu_bf16_attention` picks the one a model trains with.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "GROUPED_EAGER",
    "GROUPED_EAGER_MODELS",
    "cpu_bf16_attention",
    "eager_kind",
    "grouped_eager_attention",
    "grouped_eager_name",
]

GROUPED_EAGER = "rlkit_grouped_eager"
# model types whose attention calls the interface with a mask, a scaling and a dropout only (no soft-capping,
# no attention sinks): the grouped function is theirs to use; any other keeps transformers' eager
GROUPED_EAGER_MODELS = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_registered = False


def grouped_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-function signature: query ``[B, H, T, D]``, key and value ``[B, Hkv, L, D]``,
    ``attention_mask`` additive ``[B, 1 or H, T, ≥ L]`` (or None). Returns the output ``[B, T, H, D]`` and the
    attention probabilities ``[B, Hkv, G·T, L]`` (G = H / Hkv query heads per KV head)."""
    b, heads, t, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scaling = d**-0.5 if scaling is None else scaling
    q = query.reshape(b, kv_heads, group * t, d)  # [B, Hkv, G·T, D]
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling  # [B, Hkv, G·T, L]
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :length]
        # one mask for every head [B, 1, 1, T, L], or one per query head [B, Hkv, G, T, L]
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(b, kv_heads, group, t, length)
        scores = (scores.view(b, kv_heads, group, t, length) + mask).view(b, kv_heads, group * t, length)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # [B, Hkv, G·T, D]
    return out.view(b, heads, t, d).transpose(1, 2).contiguous(), probs


def grouped_eager_name() -> str:
    """Register :func:`grouped_eager_attention` (and eager's additive mask) with transformers under
    ``GROUPED_EAGER``, once per process; returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(GROUPED_EAGER, grouped_eager_attention)
        AttentionMaskInterface.register(GROUPED_EAGER, eager_mask)
        _registered = True
    return GROUPED_EAGER


def eager_kind(implementation: str | None) -> bool:
    """Whether ``implementation`` (a config's ``_attn_implementation``) is eager attention, transformers' or
    the grouped one: both add an additive float mask to the full score matrix."""
    return implementation in ("eager", GROUPED_EAGER)


def cpu_bf16_attention(module: nn.Module) -> str:
    """The attention a bf16 actor trains with on a CPU: the grouped one where the model type is one of
    ``GROUPED_EAGER_MODELS``, else transformers' eager."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return grouped_eager_name() if model_type in GROUPED_EAGER_MODELS else "eager"
