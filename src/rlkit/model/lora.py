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
- Checkpoints (``rlkit.model.fsdp.save_checkpoint(..., trainable_only=True)``) hold the adapter and its
  optimizer state only, plus ``adapter_config.json`` (PEFT's), from which ``rlkit merge`` rebuilds the
  adapter folder or the merged model.
- A rollout that needs its weights sent (not the HF hybrid engine, which shares the module) gets
  ``adapter_state_dict``: the adapter tensors alone. An engine with LoRA loading of its own (the vLLM and
  SGLang plugins) reads them as a PEFT adapter folder (``write_adapter_folder``: ``peft_adapter_tensors``
  renamed, PEFT's ``adapter_config.json``) and starts from the base weights (``base_state_dict``);
  ``merged_state_dict`` is ``W + scale · B A`` under the base names, for an engine that cannot.
- The critic (``critic.lora``) gets its own adapter the same way (``apply_lora(...,
  trainable_head="score")``):
  the adapter on its backbone, its freshly initialised value head (``score``) trained in full beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.model.forward import compute_log_probs
from rlkit.recipe.schema import LoraConfig, RefConfig

__all__ = [
    "ADAPTER_CONFIG",
    "apply_lora",
    "adapter_state_dict",
    "is_adapter_key",
    "trainable_numel",
    "LoraRef",
    "lora_config_of",
    "lora_scaling",
    "peft_adapter_tensors",
    "base_state_dict",
    "merged_state_dict",
    "write_adapter_folder",
    "state_bytes",
]

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file name; written into the checkpoint's actor/ folder


def peft_config(cfg: LoraConfig, base_path: str | None = None, head: str | None = None):
    """The ``peft.LoraConfig`` of a recipe's ``actor.lora`` (task type causal LM) or ``critic.lora``
    (``head``:
    the value head's name, left out of the adapter; no task type, so PEFT makes no copy of the head)."""
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - the extra is part of the test environment
        raise WorkerError("actor.lora needs the PEFT library: pip install 'rlkit[lora]'") from exc
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM" if head is None else None,
        base_model_name_or_path=base_path,
        exclude_modules=[head] if head else None,
    )


def apply_lora(
    module: nn.Module, cfg: LoraConfig, *, where: str = "actor.lora", trainable_head: str | None = None
) -> tuple[nn.Module, Any]:
    """Inject a LoRA adapter into ``module`` in place; returns ``(model, peft_model)``.

    ``model`` is the transformers model with LoRA layers (train and sample with it), ``peft_model`` the
    ``PeftModel`` around it (``disable_adapter()``, ``peft_config``). Only adapter parameters require
    grad, and ``trainable_head`` (the critic's value head ``score``: a fresh layer, trained in full).
    The adapter's initial values come from the torch RNG (seed it first for equal ranks).
    """
    import peft

    base_path = getattr(getattr(module, "config", None), "_name_or_path", None)
    try:
        peft_model = peft.get_peft_model(module, peft_config(cfg, base_path, trainable_head))
    except ValueError as exc:
        raise WorkerError(
            f"{where}.target_modules={cfg.target_modules!r}: PEFT could not place the adapter "
            f"({exc}). Name the model's linear layers (e.g. [q_proj, v_proj]) or use 'all-linear'."
        ) from exc
    model = peft_model.base_model.model
    # the head itself, not PEFT's modules_to_save copy: one name in checkpoints
    if trainable_head is not None:
        getattr(model, trainable_head).requires_grad_(True)
    return model, peft_model


def is_adapter_key(name: str) -> bool:
    """Whether a parameter name (of the transformers model) belongs to a LoRA adapter."""
    return (
        ".lora_A." in name
        or ".lora_B." in name
        or ".lora_embedding_" in name
        or ".lora_magnitude_vector" in name
    )


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


# ----- LoRA for rollout engines with weights of their own (vLLM, SGLang plugins; docs/lora.md) ----------
def lora_config_of(module: nn.Module) -> Any | None:
    """The ``peft.LoraConfig`` of a module carrying a PEFT adapter (PEFT sets ``peft_config`` on the model
    it injects into; FSDP2 keeps the attribute), else None."""
    configs = getattr(module, "peft_config", None)
    return configs.get("default") if isinstance(configs, dict) else None


def lora_scaling(config: Any) -> float:
    """The adapter's scale: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)


def peft_adapter_tensors(state: dict[str, torch.Tensor], adapter: str = "default") -> dict[str, torch.Tensor]:
    """Adapter tensors under the names of PEFT's ``adapter_model.safetensors`` (what vLLM, SGLang and
    ``PeftModel.from_pretrained`` read): ``base_model.model.<module>.lora_A.weight`` ``[r, in]``,
    ``...lora_B.weight`` ``[out, r]``; the adapter name dropped."""
    return {
        "base_model.model." + k.replace(f".{adapter}.", "."): v for k, v in state.items() if is_adapter_key(k)
    }


def base_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base weights of a module with LoRA layers, under the plain transformers names
    (``q_proj.base_layer.weight`` → ``q_proj.weight``): what an engine loads as its model."""
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_key(k)}


def merged_state_dict(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Full weights with the adapter merged in, plain names: ``W [out, in] + scale · B [out, r] @ A [r, in]``
    for each adapted linear layer (the fallback for an engine without LoRA loading)."""
    scale = lora_scaling(config)
    merged = base_state_dict(state)
    for key, lora_a in state.items():
        if ".lora_A." not in key or not key.endswith(".weight"):
            continue
        prefix = key.split(".lora_A.")[0]  # model.layers.0.self_attn.q_proj
        lora_b = state[key.replace(".lora_A.", ".lora_B.")]
        weight = merged[prefix + ".weight"]
        merged[prefix + ".weight"] = weight + (scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)
    return merged


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of a state dict's tensors (what a weight sync moves)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def write_adapter_folder(directory: Path, state: dict[str, torch.Tensor], config: Any) -> int:
    """A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) from the adapter
    tensors of ``state`` (transformers-model names, e.g. ``adapter_state_dict``); returns its tensors'
    bytes."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in peft_adapter_tensors(state).items()}
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return state_bytes(tensors)


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
        actor = self.actor
        with actor.peft_model.disable_adapter():
            log_prob = compute_log_probs(
                actor.module,
                batch,
                temperature=batch.meta.get("temperature", self.temperature),
                micro_batch_size=self.cfg.log_prob_micro_batch_size_per_rank,
                with_entropy=False,
                mixed_precision=actor.cfg.mixed_precision,
                device=actor.device,
                plan=actor.forward_plan,
            )["log_prob"]
        return Batch({"ref_log_prob": log_prob})
