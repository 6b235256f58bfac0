"""Padding-free micro-batches for the actor's forward/backward: one packed row per prompt group.

A micro-batch ``[prompt P (left-padded) | response T (right-padded)]`` runs padding in both parts; the
shared-prefix path (``actor._shared_prefix_logits``) runs each prompt once but still pads every response to
the longest. Packed, each group of rows with the same prompt becomes one sequence
``[prompt | response 1 | response 2 | ...]`` of real tokens only, with position ids restarting after the
prompt for every response and a 4-D attention mask in which a response token sees the prompt and the earlier
tokens of its own response (``seg`` below): the same attention as the padded rows, so the same log-probs and
gradients. Rows are right-padded to the longest group (pad tokens see themselves only).

Attention over a dense mask costs every query × key pair of a row (no block skipping on CPU), so packing
loses when one group's responses are long; ``plan`` estimates the forward FLOPs of the padded, shared-prefix
and packed layouts of a micro-batch and the actor runs the cheapest.

Shapes: ``b`` rows, ``W`` = p_keep + t trimmed width, ``G`` groups (packed rows), ``L`` packed row length,
``N`` response tokens with outputs, ``H`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Packed", "pack_groups", "plan"]


@dataclass
class Packed:
    input_ids: torch.Tensor  # [G, L]
    position_ids: torch.Tensor  # [G, L]
    attention_mask: torch.Tensor  # [G, 1, L, L]: bool (True = attend) for sdpa, additive float for eager
    # [b, t] long: flat index into [G * L] of the hidden state predicting token (r, j); -1 if none
    source: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def _groups(ids: torch.Tensor, mask: torch.Tensor, p_keep: int) -> list[list[int]]:
    """Row indices of each distinct prompt, in first-appearance order."""
    prompt_rows = torch.cat([ids[:, :p_keep], mask[:, :p_keep]], dim=1)
    _, inverse = torch.unique(prompt_rows, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(inverse.tolist()):
        groups.setdefault(g, []).append(row)
    return list(groups.values())


def _response_lengths(mask: torch.Tensor, p_keep: int) -> list[int] | None:
    """Real response tokens per row, or None when a response's attention mask is not a prefix of ones."""
    resp = mask[:, p_keep:]
    lengths = resp.sum(-1)
    prefix = torch.arange(resp.shape[1], device=resp.device)[None, :] < lengths[:, None]
    return lengths.tolist() if bool((prefix == resp.bool()).all()) else None


def pack_groups(
    ids: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    p_keep: int,
    t: int,
    *,
    additive: torch.dtype | None = None,
) -> Packed | None:
    """The packed layout of a trimmed micro-batch (ids, mask, pos [b, W]; ``trim_padding``'s p_keep, t), or
    None where it does not apply (a response with holes in its attention mask). ``additive``: a float dtype
    for an additive mask (eager attention); None gives a bool mask (sdpa)."""
    lengths = _response_lengths(mask, p_keep)
    if lengths is None:
        return None
    seq_ids: list[torch.Tensor] = []
    seq_pos: list[torch.Tensor] = []
    segs: list[torch.Tensor] = []
    source = torch.full((ids.shape[0], t), -1, dtype=torch.long)
    groups = _groups(ids, mask, p_keep)
    width = 0
    for rows in groups:
        first = rows[0]
        keep = mask[first, :p_keep].bool()
        parts_ids, parts_pos, parts_seg = [ids[first, :p_keep][keep]], [pos[first, :p_keep][keep]], []
        n_prompt = int(keep.sum())
        if n_prompt == 0:  # nothing predicts the first response token
            return None
        parts_seg.append(torch.zeros(n_prompt, dtype=torch.long))
        offset = n_prompt
        for k, row in enumerate(rows, start=1):
            n = lengths[row]
            parts_ids.append(ids[row, p_keep : p_keep + n])
            parts_pos.append(pos[row, p_keep : p_keep + n])
            parts_seg.append(torch.full((n,), k, dtype=torch.long))
            # token j is predicted by the last prompt token (j = 0) or by this response's token j - 1
            if n:
                source[row, 0] = n_prompt - 1
                source[row, 1:n] = torch.arange(offset, offset + n - 1)
            offset += n
        seq_ids.append(torch.cat(parts_ids))
        seq_pos.append(torch.cat(parts_pos))
        segs.append(torch.cat(parts_seg))
        width = max(width, offset)
    for g, rows in enumerate(groups):
        hit = source[rows] >= 0
        source[rows] = torch.where(hit, source[rows] + g * width, source[rows])
    pad = [width - len(s) for s in seq_ids]
    input_ids = torch.stack([torch.nn.functional.pad(s, (0, p)) for s, p in zip(seq_ids, pad, strict=True)])
    position_ids = torch.stack(
        [torch.nn.functional.pad(s, (0, p)) for s, p in zip(seq_pos, pad, strict=True)]
    )
    seg = torch.stack([torch.nn.functional.pad(s, (0, p), value=-1) for s, p in zip(segs, pad, strict=True)])
    allowed = _mask(seg)
    if additive is not None:
        allowed = torch.zeros(allowed.shape, dtype=additive).masked_fill_(~allowed, torch.finfo(additive).min)
    return Packed(
        input_ids.to(ids.device), position_ids.to(ids.device), allowed.to(ids.device), source.to(ids.device)
    )


def _mask(seg: torch.Tensor) -> torch.Tensor:
    """[G, 1, L, L] bool from segment ids [G, L] (0 prompt, k response k, -1 pad): query q sees key k when k ≤
    q and k is in the prompt or in q's own response; a pad query sees itself (no empty softmax row)."""
    width = seg.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    sq, sk = seg[:, :, None], seg[:, None, :]
    allowed = causal & (sk >= 0) & ((sk == 0) | (sk == sq)) & (sq >= 0)
    allowed |= torch.eye(width, dtype=torch.bool)
    return allowed[:, None]


def plan(
    ids: torch.Tensor,
    mask: torch.Tensor,
    p_keep: int,
    t: int,
    *,
    body_params: int,
    pair_flops: float,
    shared_ok: bool,
) -> str:
    """``"packed"``, ``"shared"`` or ``"padded"``: the layout whose forward FLOPs are smallest —
    2 · body_params per token the decoder layers run + ``pair_flops`` per query × key pair attention computes
    (4 · hidden · layers). ``shared_ok``: the shared-prefix path can run (plain module, groups present)."""
    b = ids.shape[0]
    lengths = _response_lengths(mask, p_keep)
    groups = _groups(ids, mask, p_keep)
    width = p_keep + t
    cost = {"padded": 2 * body_params * b * width + pair_flops * b * width * width}
    if shared_ok and len(groups) < b:
        u = len(groups)
        cost["shared"] = 2 * body_params * (u * p_keep + b * t) + pair_flops * (u * p_keep**2 + b * t * width)
    if lengths is not None:
        rows = [int(mask[g[0], :p_keep].sum()) + sum(lengths[r] for r in g) for g in groups]
        tokens = len(rows) * max(rows)
        cost["packed"] = 2 * body_params * tokens + pair_flops * len(rows) * max(rows) ** 2
    return min(cost, key=cost.get)
