"""``rlkit merge CHECKPOINT --out DIR``: a checkpoint's sharded actor → a Hugging Face folder.

A checkpoint holds the actor as torch.distributed.checkpoint (DCP) shards (``actor/dcp``, one file
per rank) plus ``hf_config/`` (model config and tokenizer, written by the driver). Merging needs
no process group and no GPU: DCP's shards are read into one state dict, the model is rebuilt from
its config, the weights are loaded strictly (tied weights excepted), and ``save_pretrained`` writes
config, tokenizer and safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.

A LoRA checkpoint (``actor.lora``: ``actor/adapter_config.json`` beside adapter-only shards) becomes
PEFT's adapter folder by default (``adapter_config.json`` + ``adapter_model.safetensors`` + tokenizer;
``PeftModel.from_pretrained(base, folder)`` loads it, the base being ``base_model_name_or_path`` in the
config), or with ``merge_lora=True`` the base with the adapter merged in: a plain HF model folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError

__all__ = ["MergeError", "save_hf_config", "load_actor_state_dict", "merge_checkpoint"]


class MergeError(RlkitError):
    """A checkpoint could not be merged into a Hugging Face folder."""


def save_hf_config(model_config: Any, tokenizer: Any, directory: Path) -> None:
    """Write the model's config (and generation config) and the tokenizer, without weights."""
    from transformers import AutoConfig, GenerationConfig

    from rlkit.model.load import resolve_model_path

    source = resolve_model_path(model_config.path)
    directory.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(source, trust_remote_code=model_config.trust_remote_code).save_pretrained(
        directory
    )
    try:
        GenerationConfig.from_pretrained(source).save_pretrained(directory)
    except OSError:
        pass  # a model without generation_config.json
    tokenizer.save_pretrained(directory)


def load_actor_state_dict(checkpoint: Path) -> dict[str, Any]:
    """The actor's model weights from the DCP shards of ``checkpoint/actor/dcp`` (CPU tensors).

    Only the ``model.*`` entries are read (the optimizer state beside them is twice the model's size),
    straight into tensors of the saved shapes and dtypes: no intermediate single-file copy.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_dir = checkpoint / "actor" / "dcp"
    if not dcp_dir.is_dir():
        raise MergeError(
            f"{checkpoint}: no actor/dcp folder; give a checkpoint folder such as "
            ".../checkpoints/global_step_10"
        )
    reader = dcp.FileSystemReader(str(dcp_dir))
    entries = reader.read_metadata().state_dict_metadata
    prefix = "model." if any(k.startswith("model.") for k in entries) else ""
    model = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise MergeError(f"{dcp_dir}: the checkpoint holds no model tensors")
    dcp.load({"model": model} if prefix else model, storage_reader=reader, no_dist=True)
    return model


def merge_checkpoint(
    checkpoint: str | Path, out: str | Path, dtype: str | None = None, *, merge_lora: bool = False
) -> Path:
    """Write ``out`` (config, tokenizer, safetensors) from ``checkpoint``; atomic (temp folder + rename).
    A LoRA checkpoint gives the adapter folder, or with ``merge_lora`` the merged model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, out = Path(checkpoint), Path(out)
    hf_config = checkpoint / "hf_config"
    if not (hf_config / "config.json").is_file():
        raise MergeError(
            f"{checkpoint}: no hf_config/config.json; is this an rlkit checkpoint folder (global_step_N)?"
        )
    if (checkpoint / "actor" / "adapter_config.json").is_file():
        return _write(_lora_model(checkpoint, dtype, merge_lora), hf_config, out)
    if merge_lora:
        raise MergeError(
            f"{checkpoint}: --merge-lora needs a LoRA checkpoint (actor.lora; actor/adapter_config.json), "
            "this one holds full weights; drop --merge-lora"
        )
    weights = load_actor_state_dict(checkpoint)
    config = AutoConfig.from_pretrained(hf_config)
    with torch.device("meta"):  # no random init of weights that are overwritten next
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype) if dtype else torch.float32
        )
    if dtype:
        weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    result = model.load_state_dict(weights, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied and not k.endswith("lm_head.weight")]
    if missing or result.unexpected_keys:
        raise MergeError(
            f"{checkpoint}: the actor weights do not fit the model config: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return _write(model, hf_config, out)


def _lora_model(checkpoint: Path, dtype: str | None, merge_lora: bool):
    """The base model with the checkpoint's adapter (a ``PeftModel``), or merged into it (``merge_lora``)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.recipe.hub import is_hub_id, resolve_hub_id

    lora_config = peft.LoraConfig.from_pretrained(str(checkpoint / "actor"))
    base_path = lora_config.base_model_name_or_path
    key = f"{checkpoint}/actor/adapter_config.json base_model_name_or_path"
    if base_path and not Path(base_path).is_dir() and is_hub_id(base_path):
        base_path = resolve_hub_id(base_path, key)  # a Hub id: from the HF cache, or downloaded
    if not base_path or not Path(base_path).is_dir():
        raise MergeError(
            f"{checkpoint}/actor/adapter_config.json: its base model folder {base_path!r} is not here; "
            "set base_model_name_or_path in that file to the base model's folder or Hub id"
        )
    base = AutoModelForCausalLM.from_pretrained(
        base_path, dtype=getattr(torch, dtype) if dtype else torch.float32
    )
    model = peft.get_peft_model(base, lora_config)
    weights = load_actor_state_dict(checkpoint)
    inner = model.base_model.model
    expected = {k for k, p in inner.named_parameters() if p.requires_grad}
    result = inner.load_state_dict(weights, strict=False)
    missing = sorted(expected - set(weights))
    if missing or result.unexpected_keys:
        raise MergeError(
            f"{checkpoint}: the adapter shards do not fit adapter_config.json on {base_path}: missing "
            f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    return model.merge_and_unload() if merge_lora else model


def _write(model, hf_config: Path, out: Path) -> Path:
    """``save_pretrained`` of ``model`` (a model, or a PeftModel: its adapter) + tokenizer into ``out``,
    atomically."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (hf_config / "generation_config.json").is_file():
            shutil.copy(hf_config / "generation_config.json", tmp / "generation_config.json")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
