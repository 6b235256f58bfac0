"""Eager attention over grouped query heads, in causal blocks, for the actor on a CPU.

On a CPU torch's SDPA backward is slow in bf16 (docs/benchmarks.md), and in fp32 it lost to this one at
every harness shape (measured on Zen 4 only). transformers' eager attention first copies every KV head to
each of the query heads that share it (``repeat_kv``: ``[B, Hkv, L, D] → [B, H, L, D]``), and its backward
sums those copies again.
This one multiplies each KV head with its group of query heads at once instead: the query ``[B, H, T, D]``
read as ``[B, Hkv, G·T, D]`` (query head ``h = kv·G + j``, the order ``repeat_kv`` gives), so the scores are
``[B, Hkv, G·T, L]`` and no key or value is copied. The products and sums are eager attention's; a GEMM
over G·T rows may add in another order than one over T, so outputs and gradients agree to the dtype's
rounding (``tests/unit/models/test_attention.py``; bitwise at SmolLM2's shapes on Zen 4). Where a causal
layer has many queries (a long prompt's own pass), they run in blocks that skip the masked keys
(:func:`causal_blocks`). Measured in docs/benchmarks.md ("Grouped eager attention for the bf16 actor",
"Causal blocks, and the fp32 actor on the grouped attention").

:func:`grouped_eager_name` registers it once with transformers (``AttentionInterface``, and eager's additive
mask under the same name) and returns the name to hand ``set_attn_implementation``; :func:`eager_kind` says
whether an attention implementation is one of the two eager ones (both take the additive float mask);
:func:`cpu_training_attention` picks the one an actor trains with.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "CAUSAL_BLOCK",
    "GROUPED_EAGER",
    "GROUPED_EAGER_MODELS",
    "causal_blocks",
    "cpu_training_attention",
    "eager_kind",
    "grouped_eager_attention",
    "grouped_eager_name",
]

GROUPED_EAGER = "rlkit_grouped_eager"
# model types whose attention calls the interface with a mask, a scaling and a dropout only (no soft-capping,
# no attention sinks): the grouped function is theirs to use; any other keeps transformers' eager
GROUPED_EAGER_MODELS = frozenset({"llama", "qwen2", "qwen3", "mistral"})
# queries per block where a causal layer's queries run in blocks (causal_blocks); measured in
# docs/benchmarks.md ("Causal blocks")
CAUSAL_BLOCK = 128
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature: query ``[B, H, T, D]``, key and value ``[B, Hkv, L, D]``,
    ``attention_mask`` additive ``[B, 1 or H, T, ≥ L]`` (or None). Returns the output ``[B, T, H, D]`` and the
    attention probabilities ``[B, Hkv, G·T, L]`` (G = H / Hkv query heads per KV head), or None for them where
    the queries ran in causal blocks (:func:`causal_blocks`)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    blocks = causal_blocks(module, query.shape[2], key.shape[2], attention_mask)
    if len(blocks) == 1:
        return _grouped(module, query, key, value, attention_mask, scaling, dropout)
    outs = [
        _grouped(
            module,
            query[:, :, lo:hi],
            key[:, :, :keys],
            value[:, :, :keys],
            attention_mask[:, :, lo:hi],
            scaling,
            dropout,
        )[0]
        for lo, hi, keys in blocks
    ]
    return torch.cat(outs, dim=1), None


def _grouped(module, query, key, value, attention_mask, scaling, dropout):
    b, heads, t, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
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


def causal_blocks(
    module: nn.Module, queries: int, keys: int, attention_mask: torch.Tensor | None
) -> list[tuple[int, int, int]]:
    """``(first query, end query, keys read)`` per block of ``CAUSAL_BLOCK`` query positions, or one block
    of everything.

    In a causal layer the ``T`` queries are the last ``T`` of the ``L`` positions: query ``i`` sees no key
    past ``L - T + i``, so a block of queries ending at ``e`` reads only the first ``L - T + e`` keys and
    skips the masked upper triangle (a prompt's own pass, ``T = L``, runs about 5/8 of the full score matrix
    in blocks of 128). Blocks only where the layer is causal (``module.is_causal``), the queries span at least
    two blocks, and the additive mask is the dtype's minimum (or -inf) wherever a block skips, checked here:
    a mask that lets a query see a later key gets the full matrix. A skipped key would have added
    ``exp(min - max) = 0`` to its query's softmax, so the sums are the same. A query that sees no key at all
    (left padding) comes out a uniform mix of the keys its block reads instead of all ``L``; nothing reads
    it."""
    if (
        not getattr(module, "is_causal", False)
        or attention_mask is None
        or not attention_mask.is_floating_point()
        or queries < 2 * CAUSAL_BLOCK
    ):
        return [(0, queries, keys)]
    offset = keys - queries
    blocks = []
    for lo in range(0, queries, CAUSAL_BLOCK):
        hi = min(lo + CAUSAL_BLOCK, queries)
        if queries - hi < CAUSAL_BLOCK // 2:  # a short tail joins the last block
            hi = queries
        blocks.append((lo, hi, offset + hi))
        if hi == queries:
            break
    low = torch.finfo(attention_mask.dtype).min
    for lo, hi, seen in blocks[:-1]:
        if not bool(attention_mask[:, :, lo:hi, seen:keys].le(low).all()):
            return [(0, queries, keys)]
    return blocks


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


def cpu_training_attention(module: nn.Module, bf16: bool) -> str | None:
    """The attention an actor trains with on a CPU: the grouped one where the model type is one of
    ``GROUPED_EAGER_MODELS``; else transformers' eager for bf16 (SDPA's bf16 backward is slow there) and
    None for fp32 (the model's own choice stays)."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type in GROUPED_EAGER_MODELS:
        return grouped_eager_name()
    return "eager" if bf16 else None
