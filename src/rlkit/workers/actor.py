"""The FSDP2 actor: response log-probs (+ entropy) and the PPO-style policy update.

``FSDPActor`` is plain Python (no Ray): it runs inside whichever process owns a rank of the default
torch.distributed group (a Ray worker in production, a spawned process in tests).

Update, for each of ``ppo_epochs`` passes over the rank's samples:
  mini-batch  = ``actor.ppo_mini_batch_size`` prompts × ``rollout_n`` samples, split evenly over ranks
  micro-batch = ``ppo_micro_batch_size_per_rank`` samples, or a token budget (``use_dynamic_bsz``)
  loss        = policy loss − entropy_coeff · entropy (+ kl_loss_coef · KL to the reference), each
                aggregated by ``agg_loss`` with the mini-batch's token / sequence counts summed over
                all micro-batches and ranks, so every micro-batch's loss is its exact share and the
                SUM-reduced gradient (``rlkit.workers.fsdp``) does not depend on the split.
One optimizer step per mini-batch (gradients clipped; a non-finite norm skips the step); the LR
scheduler steps once per ``update`` call (= per training step).

Batch fields read: ``input_ids, attention_mask, position_ids [B, P+T]``, ``responses,
response_mask, advantages [B, T]``, optional ``old_log_prob`` (absent = on-policy, the current
log-prob detached), ``ref_log_prob [B, T]`` (when ``use_kl_loss``), ``rollout_is_weights [B, T]`` (a
rollout correction's weights, multiplying the per-token policy loss), ``rollout_log_probs [B, T]``
(without ``old_log_prob``: the mismatch metrics), meta ``temperature``. A loss declaring a
``mini_batch_selection`` gets ``selected`` made over the global mini-batch (``loss_inputs``).
Shapes: ``B`` samples on this rank, ``P`` prompt width, ``T`` response width, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from rlkit.algos.aggregation import agg_loss, global_counts
from rlkit.algos.entropy import entropy_from_logits, log_probs_from_logits
from rlkit.algos.fused_head import head_outputs
from rlkit.algos.kl import kl_penalty
from rlkit.algos.token_baseline import sum_pi_squared_from_logits
from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.hardware import concrete_mixed_precision
from rlkit.pipeline import Resolved
from rlkit.recipe.schema import ActorConfig, ModelConfig
from rlkit.workers import flops, fsdp
from rlkit.workers.lm_head import head_replaced, plain_head
from rlkit.workers.loss_inputs import UpdateMismatch, mini_batch_selection
from rlkit.workers.packing import pack_groups, plan

__all__ = ["FSDPActor", "forward_response", "compute_log_probs"]


def autocast(device: torch.device, mixed_precision: str):
    """bf16 autocast for ``bf16``; ``auto`` is this device's decision (``rlkit.hardware``; a run passes it resolved)."""
    if concrete_mixed_precision(mixed_precision, device) == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_response(module: nn.Module, micro: Batch, *, temperature: float, with_entropy: bool,
                     entropy_grad: bool = False, mixed_precision: str = "fp32",
                     device: torch.device | None = None,
                     tally: flops.FlopTally | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token [b, T] (float32) and its entropy [b, T] (or None), 0 where masked.

    Logits are divided by ``temperature`` first (as the rollout did). Columns that are padding in every
    row are cut before the forward and the outputs padded back to ``T`` with zeros. ``tally``: gets the forward's
    rows in the layout run (``rlkit.workers.flops``).
    """
    out = response_outputs(module, micro, temperature=temperature, with_entropy=with_entropy,
                           entropy_grad=entropy_grad, mixed_precision=mixed_precision, device=device,
                           tally=tally)
    return out["log_prob"], out.get("entropy")


def response_outputs(module: nn.Module, micro: Batch, *, temperature: float, with_entropy: bool,
                     entropy_grad: bool = False, with_sum_pi_squared: bool = False, mixed_precision: str = "fp32",
                     device: torch.device | None = None,
                     tally: flops.FlopTally | None = None) -> dict[str, torch.Tensor]:
    """``forward_response``'s outputs by name: ``log_prob``, ``entropy`` (with_entropy) and ``sum_pi_squared``
    [b, T] (with_sum_pi_squared: sum over the vocabulary of softmax(logits / temperature)^2, no gradient;
    OTB's input), each 0 where masked.

    A model whose head is a plain linear map (``rlkit.workers.lm_head.plain_head``) never materialises logits:
    the outputs come from the final hidden states of the response tokens (``response_mask``) alone, in
    vocabulary slices (``rlkit.algos.fused_head``), and the micro-batch runs in its cheapest layout (shared
    prompt pass, packed rows or padded rows; ``_layout``). Other models: logits, then the chunked functions of
    ``rlkit.algos.entropy``.
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
    head = plain_head(module) if keeps and _fused_head else None
    want = {"temperature": temperature, "with_entropy": with_entropy, "entropy_grad": entropy_grad,
            "with_sum_pi_squared": with_sum_pi_squared}
    with autocast(device, mixed_precision):
        if head is not None:
            rows = keep_mask[:, :t].bool()
            outs = _fused_outputs(module, head, ids, mask, pos, p_keep, t, labels, rows, want, tally)
        else:
            outs = _logits_outputs(module, ids, mask, pos, p_keep, t, labels, keeps, want, tally)
    pad = (0, width - t)
    return {name: torch.nn.functional.pad(value, pad) * keep_mask for name, value in outs.items()}


def _fused_outputs(module: nn.Module, head: nn.Linear, ids, mask, pos, p_keep: int, t: int, labels: torch.Tensor,
                   rows: torch.Tensor, want: dict,
                   tally: flops.FlopTally | None = None) -> dict[str, torch.Tensor]:
    """Per-token outputs [b, t] by name, from the final hidden states of the ``rows`` [b, t] (bool) tokens and the
    head weight; 0 elsewhere. The micro-batch runs in the layout ``_layout`` picks: shared prefix (the hidden
    states come out of the model, a plain module), packed (one padding-free row per group) or padded; in the
    latter two the swapped head computes the outputs inside the model's forward (FSDP: gathered weight, hooked
    output) and returns them stacked as the ``logits`` [b, t, k]."""
    names = ["log_prob"] + (["entropy"] if want["with_entropy"] else []) + (
        ["sum_pi_squared"] if want["with_sum_pi_squared"] else [])

    def outputs(hidden: torch.Tensor) -> torch.Tensor:  # [b, t, H] -> [b, t, k]
        got = head_outputs(hidden[rows], head.weight, labels[rows], **want)  # each [N]
        zeros = torch.zeros(rows.shape, dtype=torch.float32, device=hidden.device)
        return torch.stack([zeros.index_put((rows,), got[name]) for name in names], dim=-1)

    layout = _layout(module, ids, mask, p_keep, t)
    if layout == "shared":
        with head_replaced(head, lambda hidden: hidden):
            hidden = _shared_prefix_logits(module, ids, mask, pos, p_keep, t)  # [b, t, H], None: no group
        if hidden is not None:
            _count(tally, "shared", ids, mask, p_keep, t, head_rows=float(rows.sum()))
            return dict(zip(names, outputs(hidden).unbind(-1), strict=True))
    packed = None
    if layout == "packed":
        eager = module.config._attn_implementation == "eager"
        packed = pack_groups(ids, mask, pos, p_keep, t, additive=torch.float32 if eager else None)
    if packed is not None and bool((packed.source[rows] >= 0).all()):
        src = packed.source[rows]  # [N] flat index into the packed [G * L] hidden states

        def packed_outputs(hidden: torch.Tensor) -> torch.Tensor:  # [G, L, H] -> [b, t, k]
            got = head_outputs(hidden.reshape(-1, hidden.shape[-1])[src], head.weight, labels[rows], **want)
            zeros = torch.zeros(rows.shape, dtype=torch.float32, device=hidden.device)
            return torch.stack([zeros.index_put((rows,), got[name]) for name in names], dim=-1)

        with head_replaced(head, packed_outputs):
            stacked = module(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                             position_ids=packed.position_ids, use_cache=False, logits_to_keep=0).logits
        if tally is not None:
            tally.add("packed", flops.packed_rows(*packed.input_ids.shape, head=float(rows.sum())))
        return dict(zip(names, stacked.unbind(-1), strict=True))
    with head_replaced(head, lambda hidden: outputs(hidden[:, :t])):  # hidden [b, t + 1, H]
        stacked = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                         logits_to_keep=t + 1).logits
    _count(tally, "padded", ids, mask, p_keep, t, head_rows=float(rows.sum()))
    return dict(zip(names, stacked.unbind(-1), strict=True))


def _count(tally: flops.FlopTally | None, layout: str, ids, mask, p_keep: int, t: int, *,
           head_rows: float) -> None:
    """Add one forward's rows to ``tally``: ``padded`` (every row at full width) or ``shared`` (each distinct
    prompt once, then the responses)."""
    if tally is None:
        return
    if layout == "padded":
        tally.add(layout, flops.padded_rows(ids.shape[0], ids.shape[1], head_rows))
        return
    u = len(torch.unique(torch.cat([ids[:, :p_keep], mask[:, :p_keep]], dim=1), dim=0))
    tally.add(layout, flops.shared_rows(u, ids.shape[0], p_keep, t, head_rows))


def _layout(module: nn.Module, ids, mask, p_keep: int, t: int) -> str:
    """``packing.plan``'s choice for this micro-batch on this model: "packed", "shared" or "padded"."""
    config = module.config
    if not _pack or config._attn_implementation not in ("sdpa", "eager"):
        return "shared" if _can_share(module) and _share_prefix else "padded"
    body = sum(p.numel() for p in module.parameters()) - module.get_input_embeddings().weight.numel()
    pair = 4.0 * config.hidden_size * config.num_hidden_layers
    return plan(ids, mask, p_keep, t, body_params=body, pair_flops=pair, shared_ok=_share_prefix and _can_share(module))


def _logits_outputs(module: nn.Module, ids, mask, pos, p_keep: int, t: int, labels: torch.Tensor, keeps: bool,
                    want: dict, tally: flops.FlopTally | None = None) -> dict[str, torch.Tensor]:
    """Per-token outputs [b, t] by name through the [b, t, V] logits (models whose head is not a plain linear map)."""
    logits = _shared_prefix_logits(module, ids, mask, pos, p_keep, t) if keeps and _share_prefix else None
    if logits is not None:
        u = len(torch.unique(torch.cat([ids[:, :p_keep], mask[:, :p_keep]], dim=1), dim=0))
        _count(tally, "shared", ids, mask, p_keep, t, head_rows=float(u + ids.shape[0] * t))
    else:
        out = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                     **({"logits_to_keep": t + 1} if keeps else {}))
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


# The LM head computes log-probs / entropies from hidden states in chunks, without [b, t, V] logits
# (benchmarks/ab.py's ``fusedhead`` turns it off to compare).
_fused_head = True
# Rows with the same prompt (a GRPO group) run the prompt once (tests turn it off to compare with the plain path).
_share_prefix = True
# With the fused head, a micro-batch may run as one padding-free packed row per group (``rlkit.workers.packing``)
# when that executes fewer FLOPs (benchmarks/ab.py's ``pack`` turns it off to compare).
_pack = True


def _can_share(module: nn.Module) -> bool:
    """The shared-prefix path applies: not FSDP-sharded (every rank must run the same number of forwards) and
    no gradient checkpointing (no KV cache)."""
    from torch.distributed.fsdp import FSDPModule

    checkpointing = getattr(module, "is_activation_checkpointing", None)  # transformers 5 name, then the old one
    if checkpointing is None:
        checkpointing = getattr(module, "is_gradient_checkpointing", False)
    return not (isinstance(module, FSDPModule) or checkpointing)


def _shared_prefix_logits(module: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                          p_keep: int, t: int) -> torch.Tensor | None:
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
        0, inverse, torch.arange(len(ids), device=ids.device), reduce="amin")  # one row per prompt
    head = module(input_ids=ids[first, :p_keep], attention_mask=mask[first, :p_keep],
                  position_ids=pos[first, :p_keep], use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    cache.batch_select_indices(inverse)  # [u, ...] -> [b, ...], an indexing op autograd follows
    tail = module(input_ids=ids[:, p_keep:], attention_mask=mask, position_ids=pos[:, p_keep:],
                  past_key_values=cache, use_cache=True, logits_to_keep=t)
    # the last prompt position predicts response token 0; response position j predicts token j + 1
    return torch.cat([head.logits[inverse, -1:], tail.logits[:, : t - 1]], dim=1)


@functools.cache
def _accepts_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@torch.no_grad()
def compute_log_probs(module: nn.Module, batch: Batch, *, temperature: float, micro_batch_size: int,
                      with_entropy: bool, mixed_precision: str, device: torch.device,
                      max_token_len: int | None = None, with_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
    """``response_outputs`` of a whole local batch [B, T] by name (``log_prob``, ``entropy``, ``sum_pi_squared``),
    micro-batch by micro-batch, in the input order."""
    pieces = fsdp.micro_batch_indices(batch, size=micro_batch_size, max_tokens=max_token_len)
    n_all = fsdp.num_chunks_everywhere(len(pieces))
    names = ["log_prob"] + (["entropy"] if with_entropy else []) + (["sum_pi_squared"] if with_sum_pi_squared else [])
    outs = {name: torch.zeros(batch["responses"].shape, dtype=torch.float32) for name in names}
    was_training = module.training
    module.eval()
    try:
        for i in range(n_all):
            idx = pieces[i] if i < len(pieces) else torch.tensor([0])  # extra forwards keep FSDP ranks in step
            got = response_outputs(module, batch[idx], temperature=temperature, with_entropy=with_entropy,
                                   with_sum_pi_squared=with_sum_pi_squared, mixed_precision=mixed_precision,
                                   device=device)
            if i < len(pieces):
                for name in names:
                    outs[name][idx] = got[name].cpu()
    finally:
        module.train(was_training)
    return outs


class FSDPActor:
    """The policy model of one rank: FSDP2-sharded causal LM, AdamW, LR schedule."""

    def __init__(self, model_config: ModelConfig, actor_config: ActorConfig, policy_loss: Resolved, *,
                 rollout_n: int, total_steps: int,
                 device: torch.device | str = "cpu", temperature: float = 1.0, log_prob_micro_batch_size: int = 8,
                 tokenizer=None, seed: int = 0):
        from rlkit.models.load import load_model, load_tokenizer

        self.model_config = model_config
        self.cfg = actor_config
        self.rollout_n = rollout_n
        self.device = torch.device(device)
        self.temperature = temperature
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        self.policy_loss = policy_loss  # resolved on the driver: the function and its validated parameters
        torch.manual_seed(seed)
        module = load_model(model_config, "causal_lm", tokenizer=self.tokenizer)
        self.peft_model = None  # actor.lora: the PeftModel around ``module`` (adapter on/off); docs/lora.md
        if actor_config.lora is not None:
            from rlkit.workers.lora import apply_lora, trainable_numel

            module, self.peft_model = apply_lora(module, actor_config.lora)
            self.lora_trainable = trainable_numel(module)[0]
        bf16 = concrete_mixed_precision(actor_config.mixed_precision, self.device) == "bf16"
        if bf16 and self.device.type == "cpu" and hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")  # CPU SDPA's bf16 backward is slow (docs/benchmarks.md)
        if actor_config.gradient_checkpointing:
            if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.x name
                module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.module = fsdp.fsdp_wrap(module, self.device)
        self.dims = flops.model_dims(self.module)  # what perf/flops/actor counts per position
        self.optimizer = fsdp.build_optimizer(self.module, actor_config.optim)
        self.scheduler = fsdp.build_lr_scheduler(self.optimizer, actor_config.optim, total_steps)
        self.nonfinite_skips = 0
        self._nonfinite_in_row = 0
        self.update_calls = 0
        self.shuffle_generator = torch.Generator().manual_seed(seed)
        self.seed = seed

    # ----- log-probs ----------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch, *, with_entropy: bool = False, with_sum_pi_squared: bool = False) -> Batch:
        """``old_log_prob [B, T]`` (and ``entropy``, ``sum_pi_squared`` [B, T]) of the batch's responses under the
        current weights."""
        outs = compute_log_probs(
            self.module, batch, temperature=batch.meta.get("temperature", self.temperature),
            micro_batch_size=self.log_prob_micro_batch_size, with_entropy=with_entropy,
            mixed_precision=self.cfg.mixed_precision, device=self.device,
            max_token_len=self.cfg.ppo_max_token_len_per_rank if self.cfg.use_dynamic_bsz else None,
            with_sum_pi_squared=with_sum_pi_squared)
        return Batch({"old_log_prob": outs.pop("log_prob")} | outs)

    # ----- update -------------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """PPO epochs × mini-batches over this rank's samples; returns ``actor/*`` metrics (same on every rank)."""
        cfg = self.cfg
        mini_size = cfg.ppo_mini_batch_size * self.rollout_n // self.world_size
        if mini_size == 0 or len(batch) % mini_size:
            raise WorkerError(
                f"actor.update: this rank holds {len(batch)} samples, not a multiple of the per-rank mini-batch "
                f"actor.ppo_mini_batch_size ({cfg.ppo_mini_batch_size}) × rollout.n ({self.rollout_n}) / world size "
                f"({self.world_size}) = {mini_size}. Make data.train_batch_size a multiple of actor.ppo_mini_batch_size "
                "and the samples divisible by the world size.")
        temperature = batch.meta.get("temperature", self.temperature)
        self.module.train()
        history: dict[str, list[float]] = defaultdict(list)
        # on-policy fast path (no old_log_prob) or bypass (old_log_prob is the rollout's): the first mini-batch's
        # log-probs, the current policy's, give the rollout mismatch
        fast = "old_log_prob" not in batch or batch.meta.get("old_log_prob_is_rollout", False)
        mismatch = UpdateMismatch() if fast and "rollout_log_probs" in batch else None
        tally = flops.FlopTally(self.dims)
        minis = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.shuffle_generator) if cfg.shuffle else torch.arange(len(batch))
            for start in range(0, len(batch), mini_size):
                selection_seed = self.seed * 1_000_003 + self.update_calls * 1009 + minis  # the same on every rank
                out = self._update_mini(batch[order[start:start + mini_size]], temperature, selection_seed,
                                        mismatch if minis == 0 else None, tally)
                minis += 1
                for key, value in out.items():
                    history[key].append(value)
        self.scheduler.step()
        self.update_calls += 1
        metrics = {key: sum(values) / len(values) for key, values in history.items()}
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["actor/nonfinite_skips"] = float(self.nonfinite_skips)
        # executed FLOPs of this update summed over ranks (the driver divides by time and the stated peak)
        metrics["perf/flops/actor"] = float(fsdp.all_reduce(torch.tensor([tally.flops], dtype=torch.float64)))
        if self.peft_model is not None:
            metrics["actor/lora_trainable_params"] = float(self.lora_trainable)
        return metrics | (mismatch.metrics() if mismatch is not None else {})

    def _update_mini(self, mini: Batch, temperature: float, selection_seed: int,
                     mismatch: UpdateMismatch | None,
                     tally: flops.FlopTally | None = None) -> dict[str, float]:
        cfg = self.cfg
        selected = mini_batch_selection(self, mini, temperature, selection_seed)  # [b, T] bool, or None
        counts = torch.stack(global_counts(mini["response_mask"])).double()
        global_tokens, global_seqs = fsdp.all_reduce(counts).tolist()
        pieces = fsdp.micro_batch_indices(mini, size=cfg.ppo_micro_batch_size_per_rank,
                                          max_tokens=cfg.ppo_max_token_len_per_rank if cfg.use_dynamic_bsz else None)
        n_all = fsdp.num_chunks_everywhere(len(pieces))
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        for i in range(n_all):
            real = i < len(pieces)
            idx = pieces[i] if real else torch.tensor([0])  # a dummy piece keeps FSDP ranks in step
            micro = mini[idx]
            loss, metrics = self._micro_loss(micro, temperature, global_tokens, global_seqs,
                                             selected[idx] if selected is not None else None,
                                             mismatch if real else None, tally if real else None)
            (loss if real else loss * 0.0).backward()
            if real:
                for key, value in metrics.items():
                    sums[key] += value
        grad_norm = fsdp.clip_grad_norm(self.module, cfg.optim.grad_clip)
        keys = sorted(sums)
        totals = fsdp.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()
        out = {f"actor/{k}": v for k, v in zip(keys, totals, strict=True)}
        if not (math.isfinite(grad_norm) and math.isfinite(out.get("actor/pg_loss", 0.0))):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_skips += 1
            self._nonfinite_in_row += 1
            if self._nonfinite_in_row >= cfg.max_nonfinite_in_row:
                raise WorkerError(
                    f"actor.update: {self._nonfinite_in_row} non-finite losses or gradient norms in a row "
                    f"(actor.max_nonfinite_in_row = {cfg.max_nonfinite_in_row}). Lower actor.optim.lr, check the "
                    "rewards / advantages for inf or NaN, or use actor.mixed_precision: fp32.")
        else:
            self.optimizer.step()
            self._nonfinite_in_row = 0
        out["actor/grad_norm"] = grad_norm
        return out

    def _micro_loss(self, micro: Batch, temperature: float, global_tokens: float, global_seqs: float,
                    selected: torch.Tensor | None = None,
                    mismatch: UpdateMismatch | None = None,
                    tally: flops.FlopTally | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the mini-batch loss, and its share of every metric. ``selected`` [b, T]:
        the rows of the loss's mini-batch selection (``rlkit.workers.loss_inputs``)."""
        cfg = self.cfg
        mask = micro["response_mask"].to(self.device)  # [b, T]
        width = mask.shape[1]
        log_prob, entropy = forward_response(self.module, micro, temperature=temperature, with_entropy=True,
                                             entropy_grad=cfg.entropy_coeff != 0,
                                             mixed_precision=cfg.mixed_precision, device=self.device,
                                             tally=tally)
        old = micro["old_log_prob"].to(self.device) if "old_log_prob" in micro else log_prob.detach()
        extra = {"selected": selected.to(self.device)} if selected is not None else {}
        pg_mat, pg_metrics = self.policy_loss.fn(log_prob, old, micro["advantages"].to(self.device), mask,
                                                 **self.policy_loss.kwargs, **extra)
        if "rollout_is_weights" in micro:  # rollout correction (rlkit.offpolicy): per-token weights, no gradient
            pg_mat = pg_mat * micro["rollout_is_weights"].to(self.device)
        if mismatch is not None:
            mismatch.add(log_prob, micro["rollout_log_probs"], mask)

        def agg(mat: torch.Tensor) -> torch.Tensor:
            return agg_loss(mat, mask, cfg.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                            max_response_len=width)

        pg_loss = agg(pg_mat)
        entropy_loss = agg(entropy)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss if cfg.entropy_coeff != 0 else pg_loss
        token_share = float(mask.sum()) / max(global_tokens, 1.0)  # weights token-mean metrics exactly
        metrics = {"pg_loss": float(pg_loss.detach()), "entropy": float(entropy_loss.detach())}
        metrics |= {k: float(v) * token_share for k, v in pg_metrics.items()}
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro["ref_log_prob"].to(self.device), cfg.kl_loss_type)
            kl_loss = agg(kl)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = float(kl_loss.detach())
            metrics["kl_coef"] = cfg.kl_loss_coef * token_share
        return loss, metrics

    # ----- weights and checkpoints --------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-style full state dict on CPU (rank 0; ``{}`` elsewhere). Collective."""
        return fsdp.full_state_dict(self.module)

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """What a rollout holding its own copy needs after an update (rank 0; ``{}`` elsewhere): the adapter's
        tensors alone with ``actor.lora``, else the full state dict. Collective."""
        if self.peft_model is None:
            return self.full_state_dict()
        from rlkit.workers.lora import adapter_state_dict

        return adapter_state_dict(self.module)

    def save_checkpoint(self, directory) -> None:
        """Model + optimizer shards (with ``actor.lora``: the adapter and its optimizer state only, plus
        ``adapter_config.json``), scheduler, counters and RNG states."""
        extra = {"scheduler": self.scheduler.state_dict(), "nonfinite_skips": self.nonfinite_skips,
                 "update_calls": self.update_calls, "shuffle_generator": self.shuffle_generator.get_state()}
        lora = self.peft_model is not None
        fsdp.save_checkpoint(directory, self.module, self.optimizer, extra, trainable_only=lora)
        if lora and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            from rlkit.workers.lora import save_adapter_config

            save_adapter_config(self.peft_model, Path(directory))

    def load_checkpoint(self, directory) -> None:
        extra = fsdp.load_checkpoint(directory, self.module, self.optimizer, trainable_only=self.peft_model is not None)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.nonfinite_skips = extra["nonfinite_skips"]
        self.update_calls = extra["update_calls"]
        self.shuffle_generator.set_state(extra["shuffle_generator"])
