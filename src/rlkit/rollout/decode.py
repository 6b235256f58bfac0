"""The HF rollout's fast decode loop: a KV cache allocated once, finished rows dropped, lean sampling.

``rlkit.rollout.hf.HFRollout.generate`` runs :func:`decode` unless ``hf._fast_decode`` is off (tests turn
it off to compare with the plain loop: transformers' ``DynamicCache``, every row forwarded to the end).
Both give the same tokens and log-probs under one seed (``tests/unit/rollout/test_decode.py``):

- **Slab cache** (:class:`SlabCache`): each layer's keys/values live in one buffer ``[B, H, P + T, D]``
  allocated at the prefill; a step writes its token's K/V in place and attention reads a view of the
  filled prefix. ``DynamicCache`` instead concatenates, copying the whole cache every step (its bytes grow
  with the completion and, at 16 rows × 256 tokens of SmolLM2, rival the weights). transformers'
  ``StaticCache`` pre-allocates too but attends over its full length every step (fixed shapes for
  ``torch.compile``), reading the unfilled tail as well.
- **Row dropping**: once an eighth of the rows still in the batch have finished (eos, stop string), the
  batch is compacted to the live rows (cache, mask, positions): a finished row costs a full forward per
  step (2 · params FLOPs) until the loop ends. The random draws stay those of the full batch (one per
  row, finished or not), so a row samples the same tokens whichever rows run beside it. An FSDP-sharded
  module must run the same number of forwards on every rank: a rank whose rows are all done keeps one
  (finished) row forwarding until every rank is done (``HFRollout._all_done``).
- **Sampling** (``rlkit.rollout.hf.sample_next``): no copy of the ``[B, V]`` logits unless top-k/top-p
  truncates them, no division at temperature 1, top-k without a sort of the vocabulary.

Shapes: ``B`` rows (prompts × n), ``P`` prompt width, ``T`` response width, ``V`` vocabulary, ``H`` KV
heads, ``D`` head size, ``A`` rows still in the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from rlkit.errors import RlkitError

if TYPE_CHECKING:
    from torch import nn

    from rlkit.rollout.hf import HFRollout

__all__ = ["SlabCache", "SlabLayer", "decode", "slab_layers"]

_COMPACT_FRACTION = 8  # compact once 1/8 of the rows in the batch have finished


class SlabLayer(DynamicLayer):
    """One layer's keys and values in a buffer allocated once, ``[B, H, capacity, D]``; ``update`` writes
    the new positions in place and returns views ``[B, H, length, D]`` of the filled prefix."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, _ = key_states.shape
        self.key_slab = key_states.new_empty(b, h, self.capacity, key_states.shape[-1])
        self.value_slab = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states/value_states [B, H, q, D]`` at positions ``length .. length + q``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RlkitError(f"rollout decode: the KV cache holds {self.capacity} positions, a step needs {end}; "
                             "this is a bug in rlkit.rollout.decode (the cache is sized prompt + max_new_tokens).")
        self.key_slab[:, :, start:end].copy_(key_states)
        self.value_slab[:, :, start:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self.key_slab[:, :, :end], self.value_slab[:, :, :end]
        if start == 0:  # the prefill attends over its own (contiguous) states, as with DynamicCache
            return key_states, value_states
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (or repeat) rows ``indices [A]``: new buffers of ``A`` rows, filled prefix copied."""
        if not self.is_initialized:
            return
        for name in ("key_slab", "value_slab"):
            slab = getattr(self, name)
            new = slab.new_empty(len(indices), *slab.shape[1:])
            new[:, :, :self.length] = slab[indices, :, :self.length]
            setattr(self, name, new)
        self.keys, self.values = self.key_slab[:, :, :self.length], self.value_slab[:, :, :self.length]


class SlabCache(Cache):
    """A ``Cache`` of :class:`SlabLayer`, one per decoder layer, each ``capacity`` positions long."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[SlabLayer(capacity) for _ in range(num_layers)])


def slab_layers(module: nn.Module) -> int | None:
    """How many layers a :class:`SlabCache` for ``module`` needs, or None where it does not fit: the model's own
    cache would not be plain full-attention ``DynamicLayer`` s (sliding windows, shared or linear layers)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config transformers cannot type: use the model's own cache
        return None
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return len(layers)


def decode(rollout: HFRollout, module: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           responses: torch.Tensor, log_probs: torch.Tensor, response_mask: torch.Tensor, num_layers: int,
           sampling: dict, stop: list[str], ignore_eos: bool) -> None:
    """Prefill ``prompt_ids/prompt_mask [B, P]`` and sample up to ``T`` tokens per row into ``responses``,
    ``log_probs`` and ``response_mask [B, T]`` (filled in place, as the plain loop fills them)."""
    from rlkit.rollout.hf import sample_next

    b, width = prompt_ids.shape
    max_new = responses.shape[1]
    device = prompt_ids.device
    mask = torch.cat([prompt_mask, torch.ones((b, max_new), dtype=prompt_mask.dtype, device=device)], 1)  # [B, P+T]
    pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    cache = SlabCache(num_layers, width + max_new)
    _, logits = rollout._prefill(module, prompt_ids, prompt_mask, pos, cache=cache)  # [B, V]
    last_pos = pos[:, -1]  # [A]
    rows = torch.arange(b, device=device)  # [A]: each batch row's index among the B rows
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    draw = sampling["do_sample"] and sampling["temperature"] != 0
    for step in range(max_new):
        uniform = None
        if draw:  # one draw per row of the full batch, as the plain loop draws
            uniform = torch.rand(b, 1, generator=rollout.generator, dtype=torch.float64, device=device)[rows]
        tokens, lp = sample_next(logits, generator=rollout.generator, uniform=uniform, **sampling)  # [A]
        live = ~finished[rows]
        responses[rows, step] = torch.where(live, tokens, rollout.pad_token_id)
        log_probs[rows, step] = torch.where(live, lp, 0.0)
        response_mask[rows, step] = live.long()
        ended = live & torch.isin(tokens, rollout.eos_token_ids) if not ignore_eos else torch.zeros_like(live)
        if stop:
            candidates = torch.zeros(b, dtype=torch.bool, device=device)
            candidates[rows] = live & ~ended
            ended |= rollout._hits_stop(responses, step, candidates, stop)[rows]
        finished[rows] |= ended
        if step + 1 == max_new or rollout._all_done(finished):
            break
        keep = ~finished[rows]  # [A]
        dropped = len(rows) - int(keep.sum())
        if dropped and dropped >= max(1, len(rows) // _COMPACT_FRACTION):
            if not keep.any():  # every row here is done, other ranks are not: keep one row forwarding
                keep[0] = True
            index = keep.nonzero().flatten()
            cache.batch_select_indices(index)
            rows, last_pos = rows[index], last_pos[index]
        last_pos = last_pos + 1
        length = width + step + 1
        out = module(input_ids=responses[rows, step:step + 1], attention_mask=mask[rows, :length],
                     position_ids=last_pos[:, None], past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
