"""The reference policy: log-probs of a frozen copy of the initial model, FSDP2-sharded.

Batch fields read: ``input_ids, attention_mask, position_ids [B, P+T]``, ``responses, response_mask
[B, T]``, meta ``temperature``. Writes ``ref_log_prob [B, T]`` (0 where masked).
"""

from __future__ import annotations

import torch

from rlkit.batch import Batch
from rlkit.model import fsdp
from rlkit.model.forward import compute_log_probs
from rlkit.recipe.schema import ModelConfig, RefConfig

__all__ = ["FSDPRef"]


class FSDPRef:
    """Frozen causal LM of one rank (no optimizer; parameters do not require grad)."""

    def __init__(
        self,
        model_config: ModelConfig,
        ref_config: RefConfig,
        *,
        device: torch.device | str = "cpu",
        temperature: float = 1.0,
        mixed_precision: str = "fp32",
        tokenizer=None,
    ):
        from rlkit.model.load import load_model, load_tokenizer

        self.cfg = ref_config
        self.device = torch.device(device)
        self.temperature = temperature
        self.mixed_precision = mixed_precision
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        module = load_model(model_config, "causal_lm", tokenizer=self.tokenizer)
        module.requires_grad_(False)
        self.module = fsdp.fsdp_wrap(module, self.device)
        self.module.eval()

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        log_prob = compute_log_probs(
            self.module,
            batch,
            temperature=batch.meta.get("temperature", self.temperature),
            micro_batch_size=self.cfg.log_prob_micro_batch_size_per_rank,
            with_entropy=False,
            mixed_precision=self.mixed_precision,
            device=self.device,
        )["log_prob"]
        return Batch({"ref_log_prob": log_prob})

    def save_checkpoint(self, directory) -> None:
        """Nothing trains here; only the RNG states are saved (the weights are the initial model's)."""
        fsdp.save_checkpoint(directory, self.module, None, {})

    def load_checkpoint(self, directory) -> None:
        fsdp.load_checkpoint(directory, self.module, None)
