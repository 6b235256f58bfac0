"""A model reward: sequence-classification scores of whole (prompt + response) sequences, FSDP2-sharded.

The model is ``AutoModelForSequenceClassification`` with one label from ``reward.reward_model.path``.
It pools the last non-pad token; padding positions are set to the pad id before the forward so
that holds with left-padded prompts and right-padded responses.

Batch fields read: ``input_ids, attention_mask, position_ids [B, P+T]``. Writes ``rm_scores [B]``.
"""

from __future__ import annotations

import torch

from rlkit.batch import Batch
from rlkit.model import fsdp
from rlkit.model.forward import autocast
from rlkit.recipe.schema import ModelConfig

__all__ = ["FSDPRewardModel"]


class FSDPRewardModel:
    """Frozen sequence-classification model of one rank."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        path: str | None = None,
        device: torch.device | str = "cpu",
        micro_batch_size: int = 8,
        mixed_precision: str = "fp32",
        tokenizer=None,
    ):
        """``path``: the reward model folder (``reward.reward_model.path``); ``model_config`` gives dtype
        and tokenizer (the reward model must share the policy's tokenizer)."""
        from rlkit.model.load import load_model, load_tokenizer

        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.mixed_precision = mixed_precision
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        module = load_model(model_config, "reward", path=path, tokenizer=self.tokenizer)
        module.requires_grad_(False)
        self.pad_token_id = module.config.pad_token_id
        self.module = fsdp.fsdp_wrap(module, self.device)
        self.module.eval()

    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> Batch:
        pieces = fsdp.micro_batch_indices(batch, size=self.micro_batch_size)
        n_all = fsdp.num_chunks_everywhere(len(pieces))
        scores = torch.zeros(len(batch), dtype=torch.float32)
        for i in range(n_all):
            idx = pieces[i] if i < len(pieces) else torch.tensor([0])
            micro = batch[idx]
            mask = micro["attention_mask"].to(self.device)
            ids = micro["input_ids"].to(self.device).masked_fill(mask == 0, self.pad_token_id)
            with autocast(self.device, self.mixed_precision):
                out = self.module(
                    input_ids=ids, attention_mask=mask, position_ids=micro["position_ids"].to(self.device)
                )
            if i < len(pieces):
                scores[idx] = out.logits[:, 0].float().cpu()
        return Batch({"rm_scores": scores})

    def save_checkpoint(self, directory) -> None:
        fsdp.save_checkpoint(directory, self.module, None, {})

    def load_checkpoint(self, directory) -> None:
        fsdp.load_checkpoint(directory, self.module, None)
