"""Decode attention that reads a group's shared prompt keys and values once for all of its rows.

After the shared prefill (``DecodePlan.share_prefill``) every row of a group holds a copy of its prompt's
K/V in the slab cache, and SDPA streams each copy at every decode step: ``n`` samples of one 500-token prompt
read its K/V ``n`` times per layer. Where the rows are the prompts in order, each repeated ``n`` times
(``repeat_interleave``, as a GRPO batch comes), :meth:`rlkit.rollout.decode.SlabCache.repeat_rows` keeps the
prefill's own per-prompt K/V as a :class:`SharedPrompt`, and the lean step
(``rlkit.rollout.lean_step``) attends in two parts: the group's ``n`` × query heads against its prompt
(one GEMM per group and KV head, its K/V read once), each row against its own response positions, one
softmax over both. Dropping finished rows ends it for the rest of the ``generate`` (the groups no longer
line up); so does a step where it would save too little (:func:`worth_sharing`).

Measured per layer on an AMD EPYC Zen 4, one thread, the caches of 30 layers cold (``python
benchmarks/shared_prompt_attention.py``, docs/benchmarks.md "A group's prompt read once in the decode"):
0.47× SDPA's time at 2 prompts × 8 rows of 526 prompt tokens, 0.62× at 2 × 4; 0.86× at 4 × 4 rows of 44
tokens at the first response tokens; 1.1-1.2× once the rows' own positions dominate, hence the rule. In a
whole generate (``benchmarks/ab.py --change sharedattn``): 0.905× at smollm2-long's 2 × 4 × 64 tokens. Not
bitwise SDPA's (another summation order): float rounding, tested against the SDPA path
(``tests/unit/rollout/test_lean_step.py``).

Shapes: ``A`` rows (``g`` groups × ``n``), ``H``/``Hkv`` query/KV heads, ``D`` head size, ``P`` prompt
width, ``L`` filled positions (``P`` + the responses so far).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MIN_SAVED_FRACTION", "SharedPrompt", "shared_prompt_attention", "worth_sharing"]

# the share of the K/V bytes of a step that sharing saves, (A - g) · P / (A · L), from which it is used
# (benchmarks/results/20261129-083619-shared-prompt-attention.*): 0.47-0.76x SDPA's time at 0.54-0.82 with
# 526-token prompts, 0.86-1.03x at 0.55 with 44-token ones, 0.94-1.09x at 0.36-0.39, 1.16-1.23x at 0.13-0.31.
# A rule on bytes (cold-cache attention is bound by its reads); measured on Zen 4 only (AVX2/AMX: re-measure)
MIN_SAVED_FRACTION = 0.5


@dataclass
class SharedPrompt:
    """The prompts' own K/V of every layer (``keys[i]``, ``values[i]`` [g, Hkv, P, D]) for ``groups`` ×
    ``rows_per_group`` rows in group order."""

    groups: int
    rows_per_group: int
    length: int  # P
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def of(
        cls, inverse: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> SharedPrompt | None:
        """For rows ``inverse [A]`` (row → prompt: ``torch.unique`` numbers the prompts in sorted order) and
        the prompts' K/V, in the rows' group order; None unless each prompt's rows are consecutive, as many
        for every prompt, and more than one."""
        groups = len(keys[0]) if keys else 0
        if groups == 0 or len(inverse) % groups or len(inverse) // groups < 2:
            return None
        n = len(inverse) // groups
        order = inverse[::n]  # [g]: the prompt of each group of rows
        if len(order.unique()) != groups or not torch.equal(inverse, order.repeat_interleave(n)):
            return None
        if not torch.equal(order, torch.arange(groups, device=order.device)):
            keys, values = [k[order] for k in keys], [v[order] for v in values]
        return cls(groups, n, keys[0].shape[2], keys, values)


def worth_sharing(shared: SharedPrompt | None, rows: int, length: int) -> bool:
    """Attend through ``shared`` at a step over ``length`` positions of ``rows`` rows (MIN_SAVED_FRACTION)."""
    if shared is None or rows != shared.groups * shared.rows_per_group:
        return False
    return (rows - shared.groups) * shared.length >= MIN_SAVED_FRACTION * rows * length


def shared_prompt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    prompt_bias: torch.Tensor,
    response_bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """SDPA's output ``[A, H, 1, D]`` for queries ``q [A, H, 1, D]`` over a group's prompt (``prompt_keys``,
    ``prompt_values [g, Hkv, P, D]``, additive mask ``prompt_bias [g, 1, 1, P]``) and each row's own positions
    ``P..L`` of ``keys``, ``values [A, Hkv, L, D]`` (additive mask ``response_bias [A, 1, 1, L - P]``); query
    head ``h`` reads KV head ``h // (H / Hkv)``."""
    a, heads, _, d = q.shape
    g, kv_heads, p, _ = prompt_keys.shape
    n, per = a // g, heads // kv_heads
    by_row = q.reshape(a, kv_heads, per, d)  # [A, Hkv, per, D]
    by_group = by_row.view(g, n, kv_heads, per, d).transpose(1, 2).reshape(g, kv_heads, n * per, d)
    prompt_scores = torch.matmul(by_group, prompt_keys.transpose(-1, -2)).mul_(scale).add_(prompt_bias)
    prompt_scores = prompt_scores.view(g, kv_heads, n, per, p).transpose(1, 2).reshape(a, kv_heads, per, p)
    own_scores = torch.matmul(by_row, keys[:, :, p:].transpose(-1, -2)).mul_(scale).add_(response_bias)
    probs = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)  # [A, Hkv, per, L]
    prompt_probs = (
        probs[..., :p].reshape(g, n, kv_heads, per, p).transpose(1, 2).reshape(g, kv_heads, n * per, p)
    )
    out = torch.matmul(prompt_probs, prompt_values)  # [g, Hkv, n · per, D]
    out = out.view(g, kv_heads, n, per, d).transpose(1, 2).reshape(a, kv_heads, per, d)
    return torch.matmul(probs[..., p:], values[:, :, p:]).add_(out).view(a, heads, 1, d)
