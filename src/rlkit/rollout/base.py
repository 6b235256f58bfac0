"""The rollout backend contract and the batch layout every backend returns (veRL's).

A backend is registered in ``rollout_backends`` (``RolloutBackendSpec.cls``); its contract is
``rlkit.protocols.RolloutBackend`` (optional capabilities: ``rlkit.protocols.CAPABILITIES``, declared on
the spec). It is constructed as::

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

Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import torch

from rlkit.batch import Batch
from rlkit.protocols import RolloutBackend  # the contract (re-exported here, where the layout is)

__all__ = ["RolloutBackend", "assemble_rollout"]


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
