"""The LM head of a Hugging Face causal LM, swapped for one forward so that the model hands out what the head
receives (final hidden states) or what we compute from it, instead of [b, t, V] logits.

The actor (``rlkit.workers.actor.response_outputs``) computes response log-probs and entropies with
``rlkit.algos.fused_head.head_outputs`` from the hidden states and the head weight. The swap happens inside
the model's own forward, so under FSDP2 the head weight read there is the gathered (unsharded) parameter and
the result is the forward's output, which FSDP's backward hooks follow (the root module reshards after
forward: the weight must not be read outside it).

Applies when logits are exactly ``hidden @ head.weight.T``: the output embedding is a bias-free ``nn.Linear``
and the config declares no logit scaling or soft-capping (Gemma 2's ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``); ``plain_head`` returns None otherwise and the caller keeps the
logits path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["plain_head", "head_replaced"]

# config attribute -> the values under which logits are exactly hidden @ W^T
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None,),
    "attn_logit_softcapping_final": (None,),
    "logit_scale": (None, 1.0),
    "logits_scaling": (None, 1.0),
}


def plain_head(module: nn.Module) -> nn.Linear | None:
    """The model's output projection when its logits are exactly ``hidden @ weight.T``; else None."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head.bias is not None or "forward" in vars(head):
        return None
    config = getattr(module, "config", None)
    for name, allowed in _LOGIT_TRANSFORMS.items():
        if getattr(config, name, None) not in allowed:
            return None
    return head


@contextlib.contextmanager
def head_replaced(head: nn.Linear, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, ``head(hidden)`` returns ``fn(hidden)`` (hidden [b, k, H], the positions the model's
    ``logits_to_keep`` kept); the model returns that as its ``logits``."""
    head.forward = fn
    try:
        yield
    finally:
        del head.forward
