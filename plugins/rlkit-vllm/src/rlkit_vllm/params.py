"""The ``vllm`` backend's parameters (``rollout.backend: {name: vllm, ...}``): the one place their defaults
live."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

__all__ = ["VllmParams"]


class VllmParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="weights' dtype in the engine; auto = rlkit's decision for this device "
        "(float32 on a CPU without fast bf16, as the hf backend)",
    )
    max_model_len: PositiveInt | None = Field(
        None, description="longest prompt + response the engine accepts (None: the model config's)"
    )
    kv_cache_gib: PositiveFloat | None = Field(
        1.0,
        description="KV cache size in GiB (vLLM's kv_cache_memory_bytes); None: sized from "
        "gpu_memory_utilization",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fraction of device memory for weights + KV cache when kv_cache_gib is None "
        "(on CPU: of host memory); leave room for training",
    )
    max_num_seqs: PositiveInt = Field(256, description="sequences decoded together")
    enforce_eager: bool = Field(
        True, description="no CUDA graphs / torch.compile (CPU: required for a fast start)"
    )
    enable_prefix_caching: bool = Field(
        True, description="share the KV of a prompt's n samples (reset after every weight sync)"
    )
    seed: int | None = Field(None, description="engine seed (None: rlkit's per-rank rollout seed)")
    weight_sync: Literal["state_dict", "folder"] = Field(
        "state_dict",
        description="how update_weights reaches the engine: the actor's full state dict, or a "
        "safetensors folder written then reloaded (docs/vllm.md compares the two)",
    )
    weights_dir: str | None = Field(
        None,
        description="folder holding the engine's model (config, tokenizer, weights); default: a temp folder",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="passed through to vllm.LLM (e.g. max_num_batched_tokens)"
    )
