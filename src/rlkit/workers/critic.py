"""The FSDP2 critic: a value head on the LM backbone; values and the clipped value update.

The model is ``AutoModelForTokenClassification`` with one label (a linear ``score`` head on the
backbone's hidden states, dropout off), loaded from ``critic.model_path`` or ``model.path`` — a causal
LM checkpoint gets a freshly initialised head. The value of response token ``t`` is read where the
actor reads the logits that predict it (the state before the token), as veRL does.

Batch fields read: ``input_ids, attention_mask, position_ids [B, P+T]``, ``responses,
response_mask [B, T]``; ``update`` also ``values`` (at rollout time) and ``returns [B, T]``.
Mini-batches are ``critic.ppo_mini_batch_size`` (default ``actor.ppo_mini_batch_size``) prompts ×
``rollout_n``, split evenly over ranks; the loss uses the global token count (see ``actor``).
``critic.lora`` (docs/lora.md): a PEFT LoRA adapter on the frozen backbone, the value head trained in
full beside it (``rlkit.model.lora.apply_lora(..., trainable_head="score")``); checkpoints hold the
adapter, the head and their optimizer state only.
Shapes: ``B`` samples on this rank, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from rlkit.algos.aggregation import global_counts
from rlkit.algos.value import compute_value_loss
from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.model import fsdp
from rlkit.model.forward import autocast
from rlkit.recipe.schema import CriticConfig, ModelConfig

__all__ = ["FSDPCritic", "forward_values"]


def forward_values(
    module: nn.Module, micro: Batch, *, mixed_precision: str = "fp32", device: torch.device | None = None
) -> torch.Tensor:
    """Values of the response tokens [b, T] (float32, 0 where masked)."""
    device = device or next(module.parameters()).device
    ids, mask, pos, p_keep, t = fsdp.trim_padding(micro)
    width = micro["responses"].shape[1]
    with autocast(device, mixed_precision):
        out = module(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))
    values = out.logits[:, p_keep - 1 : p_keep - 1 + t, 0].float()  # [b, t]
    values = torch.nn.functional.pad(values, (0, width - t))
    return values * micro["response_mask"].to(device)


class FSDPCritic:
    """The value model of one rank: FSDP2-sharded token-classification model, AdamW, LR schedule."""

    def __init__(
        self,
        model_config: ModelConfig,
        critic_config: CriticConfig,
        *,
        rollout_n: int,
        total_steps: int,
        ppo_mini_batch_size: int,
        device: torch.device | str = "cpu",
        mixed_precision: str = "fp32",
        tokenizer=None,
        seed: int = 0,
    ):
        """``ppo_mini_batch_size``: prompts per optimizer step (``critic.ppo_mini_batch_size`` or the
        actor's)."""
        from rlkit.model.load import load_model, load_tokenizer

        self.cfg = critic_config
        self.rollout_n = rollout_n
        self.mini_batch_prompts = critic_config.ppo_mini_batch_size or ppo_mini_batch_size
        self.device = torch.device(device)
        self.mixed_precision = mixed_precision
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        torch.manual_seed(seed)  # the new value head's initialisation
        module = load_model(model_config, "value", path=critic_config.model_path, tokenizer=self.tokenizer)
        self.peft_model = None  # critic.lora: the PeftModel around ``module``; docs/lora.md
        if critic_config.lora is not None:
            from rlkit.model.lora import apply_lora, trainable_numel

            # the value head (token classification)
            head = "score" if hasattr(module, "score") else "classifier"
            module, self.peft_model = apply_lora(
                module, critic_config.lora, where="critic.lora", trainable_head=head
            )
            self.lora_trainable = trainable_numel(module)[0]
        self.module = fsdp.fsdp_wrap(module, self.device)
        self.optimizer = fsdp.build_optimizer(self.module, critic_config.optim)
        self.scheduler = fsdp.build_lr_scheduler(self.optimizer, critic_config.optim, total_steps)
        self.nonfinite_skips = 0

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values [B, T]`` of the batch's responses."""
        pieces = fsdp.micro_batch_indices(batch, size=self.cfg.ppo_micro_batch_size_per_rank)
        n_all = fsdp.num_chunks_everywhere(len(pieces))
        values = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        self.module.eval()
        for i in range(n_all):
            idx = pieces[i] if i < len(pieces) else torch.tensor([0])
            out = forward_values(
                self.module, batch[idx], mixed_precision=self.mixed_precision, device=self.device
            )
            if i < len(pieces):
                values[idx] = out.cpu()
        self.module.train()
        return Batch({"values": values})

    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value regression; returns ``critic/*`` metrics (same on every rank)."""
        mini_size = self.mini_batch_prompts * self.rollout_n // self.world_size
        if mini_size == 0 or len(batch) % mini_size:
            raise WorkerError(
                f"critic.update: this rank holds {len(batch)} samples, not a multiple of the per-rank "
                f"mini-batch {self.mini_batch_prompts} prompts × rollout.n {self.rollout_n} / world size "
                f"{self.world_size} = {mini_size} (critic.ppo_mini_batch_size, else "
                "actor.ppo_mini_batch_size)."
            )
        self.module.train()
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.cfg.ppo_epochs):
            for mini in batch.split(mini_size):
                for key, value in self._update_mini(mini).items():
                    history[key].append(value)
        self.scheduler.step()
        metrics = {key: sum(v) / len(v) for key, v in history.items()}
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["critic/nonfinite_skips"] = float(self.nonfinite_skips)
        if self.peft_model is not None:
            metrics["critic/lora_trainable_params"] = float(self.lora_trainable)
        return metrics

    def _update_mini(self, mini: Batch) -> dict[str, float]:
        counts = torch.stack(global_counts(mini["response_mask"])).double()
        global_tokens, global_seqs = fsdp.all_reduce(counts).tolist()
        pieces = fsdp.micro_batch_indices(mini, size=self.cfg.ppo_micro_batch_size_per_rank)
        n_all = fsdp.num_chunks_everywhere(len(pieces))
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        width = mini["responses"].shape[1]
        for i in range(n_all):
            real = i < len(pieces)
            micro = mini[pieces[i] if real else torch.tensor([0])]
            mask = micro["response_mask"].to(self.device)
            vpreds = forward_values(
                self.module, micro, mixed_precision=self.mixed_precision, device=self.device
            )
            loss, metrics = compute_value_loss(
                vpreds,
                micro["values"].to(self.device),
                micro["returns"].to(self.device),
                mask,
                self.cfg.cliprange_value,
                self.cfg.loss_agg_mode,
                global_tokens=global_tokens,
                global_seqs=global_seqs,
                max_response_len=width,
            )
            (loss if real else loss * 0.0).backward()
            if real:
                share = float(mask.sum()) / max(global_tokens, 1.0)
                sums["vf_loss"] += float(loss.detach())
                for key, value in metrics.items():
                    sums[key] += value * share
        grad_norm = fsdp.clip_grad_norm(self.module, self.cfg.optim.grad_clip)
        keys = sorted(sums)
        totals = fsdp.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()
        out = {f"critic/{k}": v for k, v in zip(keys, totals, strict=True)}
        if math.isfinite(grad_norm) and math.isfinite(out["critic/vf_loss"]):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_skips += 1
        out["critic/grad_norm"] = grad_norm
        return out

    def save_checkpoint(self, directory) -> None:
        """Model + optimizer shards (with ``critic.lora``: the adapter, the value head and their optimizer
        state only, plus PEFT's ``adapter_config.json``), scheduler and counters."""
        lora = self.peft_model is not None
        fsdp.save_checkpoint(
            directory,
            self.module,
            self.optimizer,
            {"scheduler": self.scheduler.state_dict(), "nonfinite_skips": self.nonfinite_skips},
            trainable_only=lora,
        )
        if lora and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            from rlkit.model.lora import save_adapter_config

            save_adapter_config(self.peft_model, Path(directory))

    def load_checkpoint(self, directory) -> None:
        extra = fsdp.load_checkpoint(
            directory, self.module, self.optimizer, trainable_only=self.peft_model is not None
        )
        self.scheduler.load_state_dict(extra["scheduler"])
        self.nonfinite_skips = extra["nonfinite_skips"]
