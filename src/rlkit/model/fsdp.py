"""FSDP2 plumbing shared by the model workers: wrapping, state dicts, checkpoints, optimizer, micro-batches.

Wrapping: ``fully_shard`` on every decoder layer, then on the root (embeddings, final norm, head); at
world size 1 the module stays plain (nothing to shard; FSDP2 would only add copies per step).
Gradients are reduced across ranks with **SUM** (divide factor 1, forced sum reduction — gloo has no
PREMUL_SUM), matching ``rlkit.algos.agg_loss``: every micro-batch's loss is its share of the global
mini-batch loss, so the summed gradient never depends on the micro-batch or rank split.

Full state dicts come from ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
``full_state_dict=True, cpu_offload=True``: rank 0 receives every tensor on CPU, other ranks an empty
dict (verified on gloo here; FSDP1's equivalent crashes, DESIGN.md). Checkpoints use DCP (one folder,
sharded across ranks) for model + optimizer, plus one small ``extra_rank{r}.pt`` per rank with the
scheduler, counters and RNG states (torch, numpy, python ``random``).

Every forward and backward of an FSDP module is a collective: all ranks must run the same number of
them. ``num_chunks_everywhere`` all-reduces a chunk count to the maximum so ranks agree.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlkit.batch import Batch
from rlkit.model.state_file import load_state_file, to_plain
from rlkit.recipe.schema import OptimConfig

__all__ = [
    "decoder_layers",
    "fsdp_wrap",
    "full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "build_optimizer",
    "build_lr_scheduler",
    "clip_grad_norm",
    "all_reduce",
    "num_chunks_everywhere",
    "micro_batch_indices",
    "trim_padding",
    "rng_state",
    "set_rng_state",
]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (the classes its ``_no_split_modules`` names)."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:  # fallback: the usual `<base>.layers` ModuleList
        base = getattr(module, getattr(module, "base_model_prefix", "model"), module)
        layers = list(getattr(base, "layers", []))
    return layers


def fsdp_wrap(
    module: nn.Module,
    device: torch.device,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    plain_at_world_size_1: bool = True,
) -> nn.Module:
    """Shard ``module`` in place with FSDP2 over all ranks of the default group; returns it (unwrapped at
    world size 1 without ``param_dtype`` when ``plain_at_world_size_1``: one rank holds the whole model
    anyway, so the plain module gives the same numbers, state-dict keys and DCP checkpoints (resumable at any
    world size) without FSDP2's per-forward parameter copies, gradient copies and DTensor dispatch in the
    optimizer; measured in docs/benchmarks.md, where benchmarks/ab.py compares both).

    ``param_dtype``: FSDP2 ``MixedPrecisionPolicy`` compute dtype (e.g. bf16; reductions stay fp32);
    None keeps the parameters' dtype (use autocast for bf16 compute instead).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    module.to(device)
    if plain_at_world_size_1 and _world_size() == 1 and param_dtype is None:
        return module  # nothing to shard: FSDP2 would only add gather copies and DTensor dispatch per step
    mesh = init_device_mesh(device.type, (_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # SUM across ranks (agg_loss convention)
            sub.set_force_sum_reduction_for_comms(True)  # gloo: plain SUM, not PREMUL_SUM
    return module


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict on rank 0 (``{}`` on other ranks), never aliasing the live parameters.
    Collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _world_size() == 1:  # one CPU rank: the "full" tensors alias the live parameters; hand out copies
        state = {k: v.detach().clone() for k, v in state.items()}
    return state


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _state_dict_options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def _trainable_only(module: nn.Module, model_sd: dict) -> dict:
    """``model_sd`` cut to the parameters that require grad (a tied head, e.g. ``lm_head.weight`` of a
    frozen embedding, passes ``ignore_frozen_params``: it is not a named parameter of its own)."""
    names = {name for name, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in names}


def save_checkpoint(
    directory: str | Path,
    module: nn.Module,
    optimizer=None,
    extra: dict | None = None,
    *,
    trainable_only: bool = False,
) -> None:
    """DCP-save model (+ optimizer) shards to ``directory/dcp`` and this rank's ``extra`` + RNG states.
    ``trainable_only``: the parameters that require grad alone (a LoRA adapter without its frozen base)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(
        module, optimizer if optimizer is not None else [], options=_state_dict_options(trainable_only)
    )
    model_sd = _trainable_only(module, model_sd) if trainable_only else model_sd
    state = {"model": model_sd} | ({"optim": optim_sd} if optimizer is not None else {})
    dcp.save(state, checkpoint_id=str(directory / "dcp"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = to_plain({"rng": rng_state(), **(extra or {})}, f"extra_rank{rank}")  # weights_only-loadable
    torch.save(state, directory / f"extra_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(
    directory: str | Path, module: nn.Module, optimizer=None, *, trainable_only: bool = False
) -> dict:
    """Inverse of ``save_checkpoint``; restores RNG states and returns this rank's ``extra`` dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    options = _state_dict_options(trainable_only)
    model_sd, optim_sd = get_state_dict(module, optimizer if optimizer is not None else [], options=options)
    model_sd = _trainable_only(module, model_sd) if trainable_only else model_sd
    state = {"model": model_sd} | ({"optim": optim_sd} if optimizer is not None else {})
    check_shapes(directory, model_sd)
    dcp.load(state, checkpoint_id=str(directory / "dcp"))
    set_state_dict(
        module,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=options,
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = load_state_file(directory / f"extra_rank{rank}.pt")
    set_rng_state(extra.pop("rng"))
    return extra


def check_shapes(directory: Path, model_sd: dict) -> None:
    """Every model tensor has the shape the checkpoint in ``directory/dcp`` holds; else
    ``CheckpointMismatchError`` naming the tensor and both shapes (DCP itself fails deep inside with
    ``Size mismatch``)."""
    import torch.distributed.checkpoint as dcp

    from rlkit.model.state_file import CheckpointMismatchError

    try:
        saved = dcp.FileSystemReader(str(directory / "dcp")).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata: dcp.load reports it
        return
    for name, value in model_sd.items():
        meta = saved.get(f"model.{name}")
        size = getattr(meta, "size", None)
        if size is None or not hasattr(value, "shape") or tuple(size) == tuple(value.shape):
            continue
        raise CheckpointMismatchError(
            f"cannot resume from {directory.parent}: it was written by another model. Tensor '{name}' has "
            f"shape {list(size)} in the checkpoint and {list(value.shape)} in the model being trained "
            "(model.path). "
            "Start fresh with trainer.resume=never (or another trainer.output_dir), or set model.path to the "
            "model that wrote the checkpoint."
        )


def build_optimizer(module: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    # One fused kernel per step instead of ~10 foreach passes over parameters and states (plain CPU tensors;
    # sharded DTensor parameters keep the foreach implementation).
    fused = all(p.device.type == "cpu" and type(p.data) is torch.Tensor for p in params) or None
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up (``warmup_steps``, else ``warmup_ratio * total_steps``), then constant or cosine
    decay to ``min_lr_ratio * lr`` at ``total_steps``. Stepped once per ``update`` call (training step)."""
    warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else int(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm(module: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all shards and ranks); return the norm before clipping."""
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def all_reduce(values: torch.Tensor, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) when a process group exists; returns ``values``. A CPU tensor
    under NCCL (which reduces GPU memory only) goes through this rank's GPU and back."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if values.device.type == "cpu" and dist.get_backend() == "nccl":
            on_gpu = values.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=op or dist.ReduceOp.SUM)
            values.copy_(on_gpu)
        else:
            dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
    return values


def num_chunks_everywhere(local: int) -> int:
    """The largest ``local`` over all ranks (ranks must run equally many FSDP forwards)."""
    return int(all_reduce(torch.tensor([local], dtype=torch.long), dist.ReduceOp.MAX).item())


def micro_batch_indices(
    batch: Batch, *, size: int | None = None, max_tokens: int | None = None
) -> list[torch.Tensor]:
    """Sample indices of each micro-batch: ``size`` consecutive samples, or — with ``max_tokens`` — a
    token budget (real tokens = ``attention_mask`` sum).

    Token budget: the piece count is ``ceil(tokens / max_tokens)`` raised to the largest count over all
    ranks (each rank must run as many forwards), capped at the sample count; samples go longest-first
    to the piece with the fewest tokens. A sample longer than the budget gets a piece of its own.
    Callers pad with dummy pieces up to ``num_chunks_everywhere(len(pieces))``.
    """
    n = len(batch)
    if max_tokens is None:
        if size is None or size <= 0:
            raise ValueError(f"micro-batch size must be a positive int, got {size}.")
        return [torch.arange(s, min(s + size, n)) for s in range(0, n, size)]
    lengths = batch["attention_mask"].sum(-1).tolist()
    budget = max([max_tokens, *lengths])
    k = num_chunks_everywhere(max(1, math.ceil(sum(lengths) / budget)) if n else 0)
    k = min(k, n)
    if k == 0:
        return []
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(n), key=lambda j: -lengths[j]):
        b = loads.index(min(loads))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [torch.tensor(sorted(b)) for b in bins]


def trim_padding(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Drop columns that are padding in every row of a micro-batch.

    The sequence is ``[prompt P (left-padded) | response T (right-padded)]``. Returns
    ``input_ids, attention_mask, position_ids`` cut to ``[left, P + t)`` with ``t`` the longest
    response, plus ``(P - left, t)``: the prompt width kept and the response width kept.
    """
    mask = batch["attention_mask"]  # [b, P+T]
    width_t = batch["responses"].shape[1]
    width_p = mask.shape[1] - width_t
    prompt_cols = mask[:, :width_p].any(0).nonzero()
    left = int(prompt_cols[0]) if len(prompt_cols) else width_p - 1
    left = min(left, width_p - 1)  # keep the last prompt column: it predicts the first response token
    resp_cols = mask[:, width_p:].any(0).nonzero()
    t = int(resp_cols[-1]) + 1 if len(resp_cols) else 1
    cols = slice(left, width_p + t)
    pos = batch["position_ids"] if "position_ids" in batch else (mask.cumsum(-1) - 1).clamp(min=0)
    return batch["input_ids"][:, cols], mask[:, cols], pos[:, cols], width_p - left, t
