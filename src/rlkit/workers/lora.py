"""LoRA for the actor through PEFT: adapter injection, the adapter-disabled reference, adapter-only weights.

``actor.lora`` (``rlkit.recipe.schema.LoraConfig``) makes ``FSDPActor`` inject a PEFT LoRA adapter into
its freshly loaded causal LM before FSDP2 wrapping. The actor keeps working on the transformers model
itself (``PeftModel.base_model.model``, with LoRA layers inside its linear modules), so every code path of
the full-weight actor (``logits_to_keep``, the shared prompt pass, FSDP2 wrapping per decoder layer) is
the same; the ``PeftModel`` wrapper is kept only to switch the adapter off.

- Base weights are frozen (``requires_grad=False``); the optimizer holds only the adapter's ``lora_A``
  ``[r, in]`` and ``lora_B`` ``[out, r]`` matrices. ``lora_B`` starts at zero: at step 1 the actor equals
  the base model.
- The reference policy colocated with the actor (``LoraRef``) is the same module with the adapter
  disabled: no second copy of the weights.
- Checkpoints (``rlkit.workers.fsdp.save_checkpoint(..., trainable_only=True)``) hold the adapter and its
  optimizer state only, plus ``adapter_config.json`` (PEFT's), from which ``rlkit merge`` rebuilds the
  adapter folder or the merged model.
- A rollout that needs its weights sent (not the HF hybrid engine, which shares the module) gets
  ``adapter_state_dict``: the adapter tensors alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.recipe.schema import LoraConfig, RefConfig

__all__ = ["ADAPTER_CONFIG", "apply_lora", "adapter_state_dict", "is_adapter_key", "trainable_numel", "LoraRef"]

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file name; written into the checkpoint's actor/ folder


def peft_config(cfg: LoraConfig, base_path: str | None = None):
    """The ``peft.LoraConfig`` of a recipe's ``actor.lora`` (task type causal LM)."""
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - the extra is part of the test environment
        raise WorkerError("actor.lora needs the PEFT library: pip install 'rlkit[lora]'") from exc
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           use_rslora=cfg.use_rslora, bias="none", task_type="CAUSAL_LM",
                           base_model_name_or_path=base_path)


def apply_lora(module: nn.Module, cfg: LoraConfig) -> tuple[nn.Module, Any]:
    """Inject a LoRA adapter into ``module`` in place; returns ``(model, peft_model)``.

    ``model`` is the transformers model with LoRA layers (train and sample with it), ``peft_model`` the
    ``PeftModel`` around it (``disable_adapter()``, ``peft_config``). Only adapter parameters require
    grad. The adapter's initial values come from the torch RNG (seed it first for equal ranks).
    """
    import peft

    base_path = getattr(getattr(module, "config", None), "_name_or_path", None)
    try:
        peft_model = peft.get_peft_model(module, peft_config(cfg, base_path))
    except ValueError as exc:
        raise WorkerError(f"actor.lora.target_modules={cfg.target_modules!r}: PEFT could not place the adapter "
                          f"({exc}). Name the model's linear layers (e.g. [q_proj, v_proj]) or use 'all-linear'.") from exc
    return peft_model.base_model.model, peft_model


def is_adapter_key(name: str) -> bool:
    """Whether a parameter name (of the transformers model) belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name or ".lora_magnitude_vector" in name


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors (full, CPU copies) by transformers-model name; rank 0 gets them, others ``{}``.
    Collective under FSDP2 (call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(module, options=opts)
    return {k: v.detach().clone() for k, v in state.items() if is_adapter_key(k)}


def trainable_numel(module: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts of the (unsharded) model."""
    trainable = total = 0
    for p in module.parameters():
        n = p.numel()  # a DTensor counts its global shape
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def save_adapter_config(peft_model: Any, directory: Path) -> None:
    """PEFT's ``adapter_config.json`` into ``directory`` (rank 0 calls it)."""
    directory.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config["default"].save_pretrained(str(directory))


class LoraRef:
    """The reference policy of a LoRA actor: the actor's own module with the adapter switched off.

    Same interface as ``FSDPRef`` (``compute_ref_log_prob``); holds no weights of its own.
    """

    def __init__(self, actor: Any, ref_config: RefConfig, *, temperature: float = 1.0):
        if getattr(actor, "peft_model", None) is None:
            raise WorkerError("LoraRef needs an actor built with actor.lora.")
        self.actor = actor
        self.cfg = ref_config
        self.temperature = temperature

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob [B, T]`` of the base model (adapter disabled for the call)."""
        from rlkit.workers.actor import compute_log_probs

        actor = self.actor
        with actor.peft_model.disable_adapter():
            log_prob = compute_log_probs(
                actor.module, batch, temperature=batch.meta.get("temperature", self.temperature),
                micro_batch_size=self.cfg.log_prob_micro_batch_size_per_rank, with_entropy=False,
                mixed_precision=actor.cfg.mixed_precision, device=actor.device)["log_prob"]
        return Batch({"ref_log_prob": log_prob})
