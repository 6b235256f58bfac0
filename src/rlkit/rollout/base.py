"""The rollout backend contract and the batch layout every backend returns (veRL's).

A backend is registered in ``rollout_backends`` (``RolloutBackendSpec.cls``); its contract is
``rlkit.plugin.protocols.RolloutBackend`` (optional capabilities: ``rlkit.plugin.protocols.CAPABILITIES``,
declared on the spec). It is constructed as::

    cls(module=..., tokenizer=..., rollout_config=RolloutConfig, max_response_length=int,
        device=torch.device, seed=int)

``module`` is the actor's (possibly FSDP-sharded) causal LM when the backend lives in the actor's
process (the hybrid engine); a backend with its own engine (SGLang) may ignore it.

``generate(prompts, *, n, temperature, top_p, top_k, max_new_tokens, do_sample, stop)`` reads
``prompts["input_ids"] [B, P]`` and ``prompts["attention_mask"] [B, P]`` (left-padded; any None keyword
falls back to the rollout config) and returns a Batch of ``B * n`` samples, sample ``i * n + j`` being
response ``j`` of prompt ``i`` (``Batch.repeat(n, interleave=True)`` order), with tensors:

- ``prompts [B*n, P]`` left-padded prompt ids;
- ``responses [B*n, T]`` right-padded response ids (pad id after the end), ``T = max_new_tokens``;
- ``input_ids [B*n, P+T]`` = prompts ‖ responses;
- ``attention_mask [B*n, P+T]`` = prompt mask ‖ response_mask;
- ``position_ids [B*n, P+T]``: ``cumsum(mask) - 1`` over the prompt, then counting on by one per
  response column (padding columns included, as veRL);
- ``response_mask [B*n, T]``: 1 up to and including the token that ended the response (eos, or the
  token that completed a stop string), 0 after;
- ``rollout_log_probs [B*n, T]`` (float32, 0 where masked): ``log_softmax(logits / temperature)`` of the
  sampled token — the **untruncated** temperature-scaled distribution, before top-k / top-p (the
  veRL / SGLang convention). That is exactly what the actor recomputes with the same temperature, so
  the two agree up to numerics. Greedy decoding (``do_sample=False`` or ``temperature == 0``) reports
  log-probs at temperature 1.

and meta ``temperature`` (the one the log-probs used; the actor reads it), ``do_sample``.

Batches generated separately (DAPO's refills) have their own ``P`` (the longest prompt of each) and,
with another ``max_new_tokens``, their own ``T``. ``concat_rollouts`` pads them to one layout before
concatenating: prompt-side columns on the left, response-side columns on the right, each with its
field's pad value (``ROLLOUT_PADDING``); ``position_ids`` gain zeros on the left (a left pad's position)
and keep counting on by one on the right.

Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import torch

from rlkit.batch import Batch
from rlkit.errors import BatchError
from rlkit.plugin.protocols import RolloutBackend  # the contract (re-exported here, where the layout is)

__all__ = [
    "RolloutBackend",
    "assemble_rollout",
    "concat_rollouts",
    "pad_rollout",
    "rollout_inputs",
    "ROLLOUT_PADDING",
]

PAD_ID = "pad_token_id"  # marks a pad value that is the tokenizer's pad id

# field -> (side, pad value): "prompt" fields are [N, P] and padded on the left, "response" fields
# [N, T] on the right, "joint" fields [N, P+T] on both sides of the prompt/response boundary. Any other
# 2-D field is classified by its width (P → prompt, T → response, P+T → joint) and padded with 0.
ROLLOUT_PADDING: dict[str, tuple[str, float | str]] = {
    "prompts": ("prompt", PAD_ID),
    "responses": ("response", PAD_ID),
    "response_mask": ("response", 0),
    "rollout_log_probs": ("response", 0.0),
    "token_level_scores": ("response", 0.0),
    "token_level_rewards": ("response", 0.0),
    "input_ids": ("joint", PAD_ID),
    "attention_mask": ("joint", 0),
    "position_ids": ("joint", "count"),
}


def assemble_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    meta: dict,
) -> Batch:
    """Build the rollout Batch (layout in the module docstring) from its parts."""
    prompt_mask = prompt_mask.to(torch.long)
    response_mask = response_mask.to(torch.long)
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    steps = torch.arange(1, responses.shape[1] + 1, device=responses.device)
    response_pos = prompt_pos[:, -1:] + steps  # [B, T]
    return Batch(
        {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
            "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs.float() * response_mask,
        },
        meta=meta,
    )


def _side(key: str, width: int, p: int, t: int) -> tuple[str, float | str]:
    if key in ROLLOUT_PADDING:
        return ROLLOUT_PADDING[key]
    sides = [side for side, w in (("prompt", p), ("response", t), ("joint", p + t)) if w == width]
    if len(sides) != 1:
        raise BatchError(
            f"cannot pad rollout field '{key}' of width {width}: it matches {sides or 'none'} of prompt "
            f"width {p}, response width {t}, prompt+response {p + t}. Add it to "
            "rlkit.rollout.base.ROLLOUT_PADDING."
        )
    return sides[0], 0


def _pad(x: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
    """``x`` [N, W] with ``left`` / ``right`` columns of ``value`` added: [N, left + W + right]."""
    n = x.shape[0]
    parts = [x.new_full((n, left), value), x, x.new_full((n, right), value)]
    return torch.cat(parts, dim=1)


def pad_rollout(batch: Batch, prompt_width: int, response_width: int, pad_token_id: int) -> Batch:
    """``batch`` (the rollout layout) re-padded to ``P' = prompt_width`` and ``T' = response_width``
    (each at least the batch's own width): [N, P] → [N, P'], [N, T] → [N, T'], [N, P+T] → [N, P'+T']."""
    p, t = batch["prompts"].shape[1], batch["responses"].shape[1]
    dp, dt = prompt_width - p, response_width - t
    if dp < 0 or dt < 0:
        raise BatchError(
            f"pad_rollout: cannot shrink a rollout of widths P={p}, T={t} to P={prompt_width}, "
            f"T={response_width}."
        )
    if dp == 0 and dt == 0:
        return batch
    tensors = {}
    for key, x in batch.tensors.items():
        if x.dim() < 2:
            tensors[key] = x
            continue
        side, value = _side(key, x.shape[1], p, t)
        value = pad_token_id if value == PAD_ID else value
        if side == "prompt":
            tensors[key] = _pad(x, dp, 0, value)
        elif side == "response":
            tensors[key] = _pad(x, 0, dt, value)
        elif value == "count":  # positions: 0 for left pads; +1 per added response column
            head = _pad(x[:, :p], dp, 0, 0)
            steps = torch.arange(1, dt + 1, device=x.device, dtype=x.dtype)
            tensors[key] = torch.cat([head, x[:, p:], x[:, -1:] + steps], dim=1)
        else:
            tensors[key] = torch.cat([_pad(x[:, :p], dp, 0, value), _pad(x[:, p:], 0, dt, value)], dim=1)
    return Batch(tensors, batch.non_tensors, batch.meta)


def concat_rollouts(batches: list[Batch], pad_token_id: int) -> Batch:
    """Concatenate rollout batches generated separately: each is padded (``pad_rollout``) to the largest
    prompt width and the largest response width among them, then ``Batch.concat``. [ΣN, P_max + T_max]."""
    if not batches:
        raise BatchError("concat_rollouts needs at least one batch.")
    p = max(b["prompts"].shape[1] for b in batches)
    t = max(b["responses"].shape[1] for b in batches)
    return Batch.concat([pad_rollout(b, p, t, pad_token_id) for b in batches])


def rollout_inputs(prompts: Batch) -> Batch:
    """What a backend reads: the prompt tensors, plus the per-row fields agent loops use."""
    keys = ["input_ids", "attention_mask", "position_ids"] + [
        k for k in ("agent_name", "extra_info") if k in prompts
    ]
    return prompts.select(keys)
