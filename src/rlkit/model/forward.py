"""The actor's forward: per-token outputs of the response tokens (log-prob, entropy, Σπ²), by the cheapest
path.

``compute_log_probs`` (no gradient, whole local batch) and ``forward_response`` / ``response_outputs`` (one
micro-batch, with gradient) are what the actor, the reference, the critic's and LoRA's paths call. Which path
a micro-batch runs is a :class:`ForwardPlan` (a constructor argument of ``FSDPActor``; tests and benchmarks
pass the alternatives): every path gives the same numbers within float rounding
(``tests/unit/workers/test_fast_paths.py``).

Shapes: ``b`` rows of a micro-batch, ``B`` rows of a local batch, ``t``/``T`` response width, ``H`` hidden
size, ``V`` vocabulary, ``k`` outputs stacked.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from rlkit.algos.entropy import entropy_from_logits, log_probs_from_logits
from rlkit.algos.fused_head import KEEP_LOGITS_BYTES, head_outputs
from rlkit.algos.token_baseline import sum_pi_squared_from_logits
from rlkit.batch import Batch
from rlkit.hardware import concrete_mixed_precision
from rlkit.model import flops, fsdp
from rlkit.model.attention import eager_kind
from rlkit.model.kv_cache import cache_argument, output_cache
from rlkit.model.lm_head import head_replaced, plain_head
from rlkit.model.packing import pack_groups
from rlkit.model.packing import plan as packing_plan

__all__ = [
    "ForwardPlan",
    "autocast",
    "compute_log_probs",
    "casts_kept",
    "forward_response",
    "layout_of",
    "response_outputs",
]


@dataclass(frozen=True)
class ForwardPlan:
    """Which forward computes the response outputs. Each choice gives the same numbers within float
    rounding."""

    fused_head: bool = (
        True  # outputs from hidden states in vocabulary slices, no [b, t, V] logits (plain heads)
    )
    share_prefix: bool = (
        True  # a group's prompt runs once (not under FSDP sharding or gradient checkpointing)
    )
    pack: bool = True  # with the fused head: one padding-free row per group where that executes fewer FLOPs
    keep_head_logits: bool = True  # with the fused head: logits kept for backward within KEEP_LOGITS_BYTES
    plain_at_world_size_1: bool = (
        True  # one rank: the plain module, not FSDP2-wrapped (rlkit.model.fsdp.fsdp_wrap)
    )
    cast_weights_once: bool = (
        True  # bf16 autocast, unsharded module: a weight cast once per update (casts_kept)
    )


def autocast(device: torch.device, mixed_precision: str):
    """bf16 autocast for ``bf16``; ``auto`` is this device's decision (``rlkit.hardware``; a run passes it
    resolved)."""
    if concrete_mixed_precision(mixed_precision, device) == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def casts_kept(module: nn.Module, device: torch.device, mixed_precision: str, plan: ForwardPlan):
    """A context around several micro-batches whose weights do not change (one optimizer step's forwards and
    backwards, or a no-grad pass), in which bf16 autocast casts each weight to bf16 once instead of once per
    micro-batch: the same numbers, 0.972x the time of a SmolLM2 bf16 update in 4 micro-batches
    (docs/benchmarks.md, "Weights cast once per optimizer step").

    Autocast keeps its casts of the weights (leaf tensors that require grad) until the outermost autocast
    context exits; this is such an outer context with autocast itself off, so each micro-batch's forward still
    enters its own and the backward runs outside autocast, as without it. Leave it before the optimizer steps:
    a kept cast must not outlive the weight it copies. Off for a sharded (FSDP2) module, whose kept casts
    would be whole unsharded weights held between micro-batches, and where ``plan.cast_weights_once`` is
    off."""
    from torch.distributed.fsdp import FSDPModule

    if (
        not plan.cast_weights_once
        or concrete_mixed_precision(mixed_precision, device) != "bf16"
        or any(isinstance(m, FSDPModule) for m in module.modules())
    ):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=False)


def forward_response(
    module: nn.Module,
    micro: Batch,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
    mixed_precision: str = "fp32",
    device: torch.device | None = None,
    plan: ForwardPlan = ForwardPlan(),
    tally: flops.FlopTally | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token [b, T] (float32) and its entropy [b, T] (or None), 0 where masked.

    Logits are divided by ``temperature`` first (as the rollout did). Columns that are padding in every
    row are cut before the forward and the outputs padded back to ``T`` with zeros. ``tally``: gets the
    forward's rows in the layout run (``rlkit.model.flops``).
    """
    out = response_outputs(
        module,
        micro,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        mixed_precision=mixed_precision,
        device=device,
        plan=plan,
        tally=tally,
    )
    return out["log_prob"], out.get("entropy")


def response_outputs(
    module: nn.Module,
    micro: Batch,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
    with_sum_pi_squared: bool = False,
    mixed_precision: str = "fp32",
    device: torch.device | None = None,
    plan: ForwardPlan = ForwardPlan(),
    tally: flops.FlopTally | None = None,
) -> dict[str, torch.Tensor]:
    """``forward_response``'s outputs by name: ``log_prob``, ``entropy`` (with_entropy) and ``sum_pi_squared``
    [b, T] (with_sum_pi_squared: sum over the vocabulary of softmax(logits / temperature)^2, no gradient;
    OTB's input), each 0 where masked.

    A model whose head is a plain linear map (``rlkit.model.lm_head.plain_head``) never materialises logits:
    the outputs come from the final hidden states of the response tokens (``response_mask``) alone, in
    vocabulary slices (``rlkit.algos.fused_head``), and the micro-batch runs in its cheapest layout (shared
    prompt pass, packed rows or padded rows; ``_layout``), as far as ``plan`` allows. Other models: logits,
    then the chunked functions of ``rlkit.algos.entropy``.
    """
    device = device or next(module.parameters()).device
    ids, mask, pos, p_keep, t = fsdp.trim_padding(micro)
    width = micro["responses"].shape[1]
    keep_mask = micro["response_mask"].to(device)  # [b, T], zeros past each response's end
    labels = micro["responses"][:, :t].to(device)  # [b, t]
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    # Only the last t + 1 positions predict response tokens: the head is applied to those alone when the model
    # supports it (HF's ``logits_to_keep``).
    keeps = _accepts_logits_to_keep(type(module))
    head = plain_head(module) if keeps and plan.fused_head else None
    want = {
        "temperature": temperature,
        "with_entropy": with_entropy,
        "entropy_grad": entropy_grad,
        "with_sum_pi_squared": with_sum_pi_squared,
    }
    with autocast(device, mixed_precision):
        if head is not None:
            want["keep_logits_bytes"] = KEEP_LOGITS_BYTES if plan.keep_head_logits else 0
            rows = keep_mask[:, :t].bool()
            outs = _fused_outputs(module, head, ids, mask, pos, p_keep, t, labels, rows, want, plan, tally)
        else:
            outs = _logits_outputs(module, ids, mask, pos, p_keep, t, labels, keeps, want, plan, tally)
    pad = (0, width - t)
    return {name: torch.nn.functional.pad(value, pad) * keep_mask for name, value in outs.items()}


def _fused_outputs(
    module: nn.Module,
    head: nn.Linear,
    ids,
    mask,
    pos,
    p_keep: int,
    t: int,
    labels: torch.Tensor,
    rows: torch.Tensor,
    want: dict,
    plan: ForwardPlan,
    tally: flops.FlopTally | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token outputs [b, t] by name, from the final hidden states of the ``rows`` [b, t] (bool) tokens and
    the head weight; 0 elsewhere. The micro-batch runs in the layout ``_layout`` picks: shared prefix (the
    hidden states come out of the model, a plain module), packed (one padding-free row per group) or padded;
    in the latter two the swapped head computes the outputs inside the model's forward (FSDP: gathered weight,
    hooked output) and returns them stacked as the ``logits`` [b, t, k]."""
    names = (
        ["log_prob"]
        + (["entropy"] if want["with_entropy"] else [])
        + (["sum_pi_squared"] if want["with_sum_pi_squared"] else [])
    )

    def outputs(hidden: torch.Tensor) -> torch.Tensor:  # [b, t, H] -> [b, t, k]
        return _scattered(head_outputs(hidden[rows], head.weight, labels[rows], **want), rows, names)

    layout = layout_of(module, ids, mask, p_keep, t, plan)
    if layout == "shared":
        with head_replaced(head, lambda hidden: hidden):
            hidden = _shared_prefix_logits(module, ids, mask, pos, p_keep, t)  # [b, t, H], None: no group
        if hidden is not None:
            _count(tally, "shared", ids, mask, p_keep, t, head_rows=float(rows.sum()))
            return dict(zip(names, outputs(hidden).unbind(-1), strict=True))
    packed = None
    if layout == "packed":
        eager = eager_kind(module.config._attn_implementation)
        packed = pack_groups(ids, mask, pos, p_keep, t, additive=torch.float32 if eager else None)
    if packed is not None and bool((packed.source[rows] >= 0).all()):
        stacked = _packed_outputs(module, head, packed, labels, rows, want, names, tally)
        return dict(zip(names, stacked.unbind(-1), strict=True))
    with head_replaced(head, lambda hidden: outputs(hidden[:, :t])):  # hidden [b, t + 1, H]
        stacked = module(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=t + 1
        ).logits
    _count(tally, "padded", ids, mask, p_keep, t, head_rows=float(rows.sum()))
    return dict(zip(names, stacked.unbind(-1), strict=True))


def _scattered(got: dict[str, torch.Tensor], rows: torch.Tensor, names: list[str]) -> torch.Tensor:
    """``got`` (name → [N], a value per ``rows`` token) placed into [b, t, k] (k: ``names``), 0 elsewhere."""
    zeros = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    return torch.stack([zeros.index_put((rows,), got[name]) for name in names], dim=-1)


def _packed_outputs(
    module: nn.Module,
    head: nn.Linear,
    packed,
    labels: torch.Tensor,
    rows: torch.Tensor,
    want: dict,
    names: list[str],
    tally: flops.FlopTally | None,
) -> torch.Tensor:
    """The ``rows`` tokens' outputs [b, t, k] from one forward over ``packed`` 's padding-free rows [G, L]:
    the swapped head reads each token's hidden state at its packed position (``packed.source``)."""
    src = packed.source[rows]  # [N] flat index into the packed [G * L] hidden states

    def from_packed(hidden: torch.Tensor) -> torch.Tensor:  # [G, L, H] -> [b, t, k]
        flat = hidden.reshape(-1, hidden.shape[-1])[src]
        return _scattered(head_outputs(flat, head.weight, labels[rows], **want), rows, names)

    with head_replaced(head, from_packed):
        stacked = module(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
            logits_to_keep=0,
        ).logits
    if tally is not None:
        tally.add("packed", flops.packed_rows(*packed.input_ids.shape, head=float(rows.sum())))
    return stacked


def _count(
    tally: flops.FlopTally | None, layout: str, ids, mask, p_keep: int, t: int, *, head_rows: float
) -> None:
    """Add one forward's rows to ``tally``: ``padded`` (every row at full width) or ``shared`` (each distinct
    prompt once, then the responses)."""
    if tally is None:
        return
    if layout == "padded":
        tally.add(layout, flops.padded_rows(ids.shape[0], ids.shape[1], head_rows))
        return
    u = len(torch.unique(torch.cat([ids[:, :p_keep], mask[:, :p_keep]], dim=1), dim=0))
    tally.add(layout, flops.shared_rows(u, ids.shape[0], p_keep, t, head_rows))


def layout_of(module: nn.Module, ids, mask, p_keep: int, t: int, plan: ForwardPlan) -> str:
    """``packing.plan``'s choice for this micro-batch on this model, within ``plan``: "packed", "shared" or
    "padded"."""
    config = module.config
    shared_ok = plan.share_prefix and _can_share(module)
    if not plan.pack or not (
        config._attn_implementation == "sdpa" or eager_kind(config._attn_implementation)
    ):
        return "shared" if shared_ok else "padded"
    body = sum(p.numel() for p in module.parameters()) - module.get_input_embeddings().weight.numel()
    pair = 4.0 * config.hidden_size * config.num_hidden_layers
    return packing_plan(ids, mask, p_keep, t, body_params=body, pair_flops=pair, shared_ok=shared_ok)


def _logits_outputs(
    module: nn.Module,
    ids,
    mask,
    pos,
    p_keep: int,
    t: int,
    labels: torch.Tensor,
    keeps: bool,
    want: dict,
    plan: ForwardPlan,
    tally: flops.FlopTally | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token outputs [b, t] by name through the [b, t, V] logits (models whose head is not a plain linear
    map)."""
    logits = _shared_prefix_logits(module, ids, mask, pos, p_keep, t) if keeps and plan.share_prefix else None
    if logits is not None:
        u = len(torch.unique(torch.cat([ids[:, :p_keep], mask[:, :p_keep]], dim=1), dim=0))
        _count(tally, "shared", ids, mask, p_keep, t, head_rows=float(u + ids.shape[0] * t))
    else:
        out = module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=False,
            **({"logits_to_keep": t + 1} if keeps else {}),
        )
        width = t + 1 if keeps else ids.shape[1]
        _count(tally, "padded", ids, mask, p_keep, t, head_rows=float(ids.shape[0] * width))
        first = 0 if keeps else p_keep - 1
        logits = out.logits[:, first : first + t]
    logits = logits.float()  # [b, t, V]
    if want["temperature"] != 1.0:
        logits = logits / want["temperature"]
    outs = {"log_prob": log_probs_from_logits(logits, labels)}  # [b, t]
    if want["with_entropy"]:
        outs["entropy"] = entropy_from_logits(logits if want["entropy_grad"] else logits.detach())
    if want["with_sum_pi_squared"]:
        outs["sum_pi_squared"] = sum_pi_squared_from_logits(logits.detach())
    return outs


def _can_share(module: nn.Module) -> bool:
    """The shared-prefix path applies: not FSDP-sharded (every rank must run the same number of forwards) and
    no gradient checkpointing (no KV cache)."""
    from torch.distributed.fsdp import FSDPModule

    # transformers 5 name, then the old one
    checkpointing = getattr(module, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(module, "is_gradient_checkpointing", False)
    return not (isinstance(module, FSDPModule) or checkpointing)


def _shared_prefix_logits(
    module: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, p_keep: int, t: int
) -> torch.Tensor | None:
    """Response logits [b, t, V] with each distinct prompt forwarded (and back-propagated) once.

    The prompt part (``p_keep`` columns) of each group runs once with a KV cache; the cache is indexed out
    to the group's rows (differentiable, so gradients of every row flow into the one prompt pass) and the
    responses run on top of it. None when nothing is shared, or where it does not apply: FSDP-sharded
    modules (every rank must run the same number of forwards) and gradient checkpointing (no cache).
    """
    if not _can_share(module):
        return None
    prompt_rows = torch.cat([ids[:, :p_keep], mask[:, :p_keep]], dim=1)
    unique, inverse = torch.unique(prompt_rows, dim=0, return_inverse=True)
    if len(unique) == len(prompt_rows):
        return None
    first = torch.full((len(unique),), len(ids), dtype=torch.long, device=ids.device).scatter_reduce_(
        0, inverse, torch.arange(len(ids), device=ids.device), reduce="amin"
    )  # one row per prompt
    head = module(
        input_ids=ids[first, :p_keep],
        attention_mask=mask[first, :p_keep],
        position_ids=pos[first, :p_keep],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = output_cache(head)
    cache.batch_select_indices(inverse)  # [u, ...] -> [b, ...], an indexing op autograd follows
    tail = module(
        input_ids=ids[:, p_keep:],
        attention_mask=mask,
        position_ids=pos[:, p_keep:],
        use_cache=True,
        **cache_argument(module, cache),
        logits_to_keep=t,
    )
    # the last prompt position predicts response token 0; response position j predicts token j + 1
    return torch.cat([head.logits[inverse, -1:], tail.logits[:, : t - 1]], dim=1)


@functools.cache
def _accepts_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@torch.no_grad()
def compute_log_probs(
    module: nn.Module,
    batch: Batch,
    *,
    temperature: float,
    micro_batch_size: int,
    with_entropy: bool,
    mixed_precision: str,
    device: torch.device,
    max_token_len: int | None = None,
    with_sum_pi_squared: bool = False,
    plan: ForwardPlan = ForwardPlan(),
) -> dict[str, torch.Tensor]:
    """``response_outputs`` of a whole local batch [B, T] by name (``log_prob``, ``entropy``,
    ``sum_pi_squared``), micro-batch by micro-batch, in the input order."""
    pieces = fsdp.micro_batch_indices(batch, size=micro_batch_size, max_tokens=max_token_len)
    n_all = fsdp.num_chunks_everywhere(len(pieces))
    names = (
        ["log_prob"]
        + (["entropy"] if with_entropy else [])
        + (["sum_pi_squared"] if with_sum_pi_squared else [])
    )
    outs = {name: torch.zeros(batch["responses"].shape, dtype=torch.float32) for name in names}
    was_training = module.training
    module.eval()
    try:
        with casts_kept(module, device, mixed_precision, plan):
            for i in range(n_all):
                # extra forwards keep FSDP ranks in step
                idx = pieces[i] if i < len(pieces) else torch.tensor([0])
                got = response_outputs(
                    module,
                    batch[idx],
                    temperature=temperature,
                    with_entropy=with_entropy,
                    with_sum_pi_squared=with_sum_pi_squared,
                    mixed_precision=mixed_precision,
                    device=device,
                    plan=plan,
                )
                if i < len(pieces):
                    for name in names:
                        outs[name][idx] = got[name].cpu()
    finally:
        module.train(was_training)
    return outs
