"""The FSDP2 actor: response log-probs (+ entropy) and the PPO-style policy update.

``FSDPActor`` is plain Python (no Ray): it runs inside whichever process owns a rank of the default
torch.distributed group (a Ray worker in production, a spawned process in tests).

Update, for each of ``ppo_epochs`` passes over the rank's samples:
  mini-batch  = ``actor.ppo_mini_batch_size`` prompts × ``rollout_n`` samples, split evenly over ranks
  micro-batch = ``ppo_micro_batch_size_per_rank`` samples, or a token budget (``use_dynamic_bsz``)
  loss        = policy loss − entropy_coeff · entropy (+ kl_loss_coef · KL to the reference), each
                aggregated by ``agg_loss`` with the mini-batch's token / sequence counts summed over
                all micro-batches and ranks, so every micro-batch's loss is its exact share and the
                SUM-reduced gradient (``rlkit.model.fsdp``) does not depend on the split.
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

import math
from collections import defaultdict
from pathlib import Path

import torch

from rlkit.algos.aggregation import agg_loss, global_counts
from rlkit.algos.kl import kl_penalty
from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.hardware import concrete_mixed_precision
from rlkit.model import flops, fsdp
from rlkit.model.attention import cpu_training_attention
from rlkit.model.forward import ForwardPlan, casts_kept, compute_log_probs, forward_response
from rlkit.model.loss_inputs import UpdateMismatch, mini_batch_selection
from rlkit.recipe.compose import Resolved
from rlkit.recipe.schema import ActorConfig, ModelConfig

__all__ = ["FSDPActor"]


class FSDPActor:
    """The policy model of one rank: FSDP2-sharded causal LM, AdamW, LR schedule."""

    def __init__(
        self,
        model_config: ModelConfig,
        actor_config: ActorConfig,
        policy_loss: Resolved,
        *,
        rollout_n: int,
        total_steps: int,
        device: torch.device | str = "cpu",
        temperature: float = 1.0,
        log_prob_micro_batch_size: int = 8,
        tokenizer=None,
        seed: int = 0,
        forward_plan: ForwardPlan = ForwardPlan(),
    ):
        """``forward_plan``: which forward computes response log-probs (``rlkit.model.forward``; the default
        is the cheapest path, tests and benchmarks pass the alternatives)."""
        from rlkit.model.load import load_model, load_tokenizer

        self.forward_plan = forward_plan

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
            from rlkit.model.lora import apply_lora, trainable_numel

            module, self.peft_model = apply_lora(module, actor_config.lora)
            self.lora_trainable = trainable_numel(module)[0]
        bf16 = concrete_mixed_precision(actor_config.mixed_precision, self.device) == "bf16"
        attention = cpu_training_attention(module, bf16) if self.device.type == "cpu" else None
        if attention is not None and hasattr(module, "set_attn_implementation"):
            # the grouped eager where it can (beat CPU SDPA in fp32 and bf16 on Zen 4), else eager for bf16
            module.set_attn_implementation(attention)
        if actor_config.gradient_checkpointing:
            if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.x name
                module.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.module = fsdp.fsdp_wrap(
            module, self.device, plain_at_world_size_1=forward_plan.plain_at_world_size_1
        )
        self.dims = flops.model_dims(self.module)  # what perf/flops/actor counts per position
        self.optimizer = fsdp.build_optimizer(self.module, actor_config.optim)
        self.scheduler = fsdp.build_lr_scheduler(self.optimizer, actor_config.optim, total_steps)
        self.nonfinite_skips = 0
        self._nonfinite_in_row = 0
        self.update_calls = 0
        self.shuffle_generator = torch.Generator().manual_seed(seed)
        self.seed = seed

    # ----- log-probs ----------------------------------------------------------------------------
    def compute_log_prob(
        self, batch: Batch, *, with_entropy: bool = False, with_sum_pi_squared: bool = False
    ) -> Batch:
        """``old_log_prob [B, T]`` (and ``entropy``, ``sum_pi_squared`` [B, T]) of the batch's responses under
        the current weights."""
        outs = compute_log_probs(
            self.module,
            batch,
            temperature=batch.meta.get("temperature", self.temperature),
            micro_batch_size=self.log_prob_micro_batch_size,
            with_entropy=with_entropy,
            mixed_precision=self.cfg.mixed_precision,
            device=self.device,
            max_token_len=self.cfg.ppo_max_token_len_per_rank if self.cfg.use_dynamic_bsz else None,
            with_sum_pi_squared=with_sum_pi_squared,
            plan=self.forward_plan,
        )
        return Batch({"old_log_prob": outs.pop("log_prob")} | outs)

    # ----- update -------------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """PPO epochs × mini-batches over this rank's samples; returns ``actor/*`` metrics (same on every
        rank)."""
        cfg = self.cfg
        mini_size = cfg.ppo_mini_batch_size * self.rollout_n // self.world_size
        if mini_size == 0 or len(batch) % mini_size:
            raise WorkerError(
                f"actor.update: this rank holds {len(batch)} samples, not a multiple of the per-rank "
                f"mini-batch actor.ppo_mini_batch_size ({cfg.ppo_mini_batch_size}) × rollout.n "
                f"({self.rollout_n}) / world size ({self.world_size}) = {mini_size}. Make "
                "data.train_batch_size a multiple of actor.ppo_mini_batch_size and the samples divisible by "
                "the world size."
            )
        temperature = batch.meta.get("temperature", self.temperature)
        self.module.train()
        history: dict[str, list[float]] = defaultdict(list)
        # on-policy fast path (no old_log_prob) or bypass (old_log_prob is the rollout's): the first
        # mini-batch's log-probs, the current policy's, give the rollout mismatch
        fast = "old_log_prob" not in batch or batch.meta.get("old_log_prob_is_rollout", False)
        mismatch = UpdateMismatch() if fast and "rollout_log_probs" in batch else None
        tally = flops.FlopTally(self.dims)
        minis = 0
        for _ in range(cfg.ppo_epochs):
            order = (
                torch.randperm(len(batch), generator=self.shuffle_generator)
                if cfg.shuffle
                else torch.arange(len(batch))
            )
            for start in range(0, len(batch), mini_size):
                # the same on every rank
                selection_seed = self.seed * 1_000_003 + self.update_calls * 1009 + minis
                out = self._update_mini(
                    batch[order[start : start + mini_size]],
                    temperature,
                    selection_seed,
                    mismatch if minis == 0 else None,
                    tally,
                )
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

    def _update_mini(
        self,
        mini: Batch,
        temperature: float,
        selection_seed: int,
        mismatch: UpdateMismatch | None,
        tally: flops.FlopTally | None = None,
    ) -> dict[str, float]:
        cfg = self.cfg
        selected = mini_batch_selection(self, mini, temperature, selection_seed)  # [b, T] bool, or None
        counts = torch.stack(global_counts(mini["response_mask"])).double()
        global_tokens, global_seqs = fsdp.all_reduce(counts).tolist()
        pieces = fsdp.micro_batch_indices(
            mini,
            size=cfg.ppo_micro_batch_size_per_rank,
            max_tokens=cfg.ppo_max_token_len_per_rank if cfg.use_dynamic_bsz else None,
        )
        n_all = fsdp.num_chunks_everywhere(len(pieces))
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        # each weight's bf16 cast made once for the mini-batch's micro-batches; left before the optimizer step
        with casts_kept(self.module, self.device, cfg.mixed_precision, self.forward_plan):
            for i in range(n_all):
                real = i < len(pieces)
                idx = pieces[i] if real else torch.tensor([0])  # a dummy piece keeps FSDP ranks in step
                micro = mini[idx]
                loss, metrics = self._micro_loss(
                    micro,
                    temperature,
                    global_tokens,
                    global_seqs,
                    selected[idx] if selected is not None else None,
                    mismatch if real else None,
                    tally if real else None,
                )
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
                    f"(actor.max_nonfinite_in_row = {cfg.max_nonfinite_in_row}). Lower actor.optim.lr, check "
                    "the rewards / advantages for inf or NaN, or use actor.mixed_precision: fp32."
                )
        else:
            self.optimizer.step()
            self._nonfinite_in_row = 0
        out["actor/grad_norm"] = grad_norm
        return out

    def _micro_loss(
        self,
        micro: Batch,
        temperature: float,
        global_tokens: float,
        global_seqs: float,
        selected: torch.Tensor | None = None,
        mismatch: UpdateMismatch | None = None,
        tally: flops.FlopTally | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the mini-batch loss, and its share of every metric. ``selected``
        [b, T]: the rows of the loss's mini-batch selection (``rlkit.model.loss_inputs``)."""
        cfg = self.cfg
        mask = micro["response_mask"].to(self.device)  # [b, T]
        width = mask.shape[1]
        log_prob, entropy = forward_response(
            self.module,
            micro,
            temperature=temperature,
            with_entropy=True,
            entropy_grad=cfg.entropy_coeff != 0,
            mixed_precision=cfg.mixed_precision,
            device=self.device,
            plan=self.forward_plan,
            tally=tally,
        )
        old = micro["old_log_prob"].to(self.device) if "old_log_prob" in micro else log_prob.detach()
        extra = {"selected": selected.to(self.device)} if selected is not None else {}
        pg_mat, pg_metrics = self.policy_loss.fn(
            log_prob, old, micro["advantages"].to(self.device), mask, **self.policy_loss.kwargs, **extra
        )
        # rollout correction (rlkit.step.correction): per-token weights, no gradient
        if "rollout_is_weights" in micro:
            pg_mat = pg_mat * micro["rollout_is_weights"].to(self.device)
        if mismatch is not None:
            mismatch.add(log_prob, micro["rollout_log_probs"], mask)

        def agg(mat: torch.Tensor) -> torch.Tensor:
            return agg_loss(
                mat,
                mask,
                cfg.loss_agg_mode,
                global_tokens=global_tokens,
                global_seqs=global_seqs,
                max_response_len=width,
            )

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
        from rlkit.model.lora import adapter_state_dict

        return adapter_state_dict(self.module)

    def save_checkpoint(self, directory) -> None:
        """Model + optimizer shards (with ``actor.lora``: the adapter and its optimizer state only, plus
        ``adapter_config.json``), scheduler, counters and RNG states."""
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "nonfinite_skips": self.nonfinite_skips,
            "update_calls": self.update_calls,
            "shuffle_generator": self.shuffle_generator.get_state(),
        }
        lora = self.peft_model is not None
        fsdp.save_checkpoint(directory, self.module, self.optimizer, extra, trainable_only=lora)
        if lora and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            from rlkit.model.lora import save_adapter_config

            save_adapter_config(self.peft_model, Path(directory))

    def load_checkpoint(self, directory) -> None:
        extra = fsdp.load_checkpoint(
            directory, self.module, self.optimizer, trainable_only=self.peft_model is not None
        )
        self.scheduler.load_state_dict(extra["scheduler"])
        self.nonfinite_skips = extra["nonfinite_skips"]
        self.update_calls = extra["update_calls"]
        self.shuffle_generator.set_state(extra["shuffle_generator"])
