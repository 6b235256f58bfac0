"""The ``sglang`` backend's parameters (``rollout.backend: {name: sglang, ...}``): the one place their defaults live."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

__all__ = ["SglangLaunchParams", "SglangParams"]


class SglangLaunchParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_replicas: PositiveInt = Field(1, description="rollout engines (data parallel)")
    tp_size: PositiveInt = Field(1, description="GPUs per engine (tensor parallel)")
    mem_fraction_static: float = Field(0.6, gt=0, le=1, description="GPU memory for weights + KV cache (leave room for training)")
    dtype: str = Field("bfloat16", description="weights' dtype in the engine")
    enable_memory_saver: bool = Field(True, description="needed by /release_memory_occupation (hybrid engine; CUDA only)")
    host: str = Field("127.0.0.1", description="address the servers bind")
    startup_timeout_s: PositiveFloat = Field(600.0, description="seconds to wait for /health after launch")
    extra_args: list[str] = Field(default_factory=list, description="passed through to sglang.launch_server")


class SglangParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    urls: list[str] = Field(default_factory=list, description="attach to running servers (one per replica); empty = launch")
    launch: SglangLaunchParams = Field(default_factory=SglangLaunchParams, description="servers to start when no urls are given")
    model_path: str | None = Field(None, description="model the launched servers load (default: the actor's name_or_path)")
    timeout_s: PositiveFloat = Field(600.0, description="per request")
    retries: int = Field(3, ge=0, description="per request, on connection errors")
    weights_dir: str | None = Field(None, description="where update_weights writes the weights servers reload (default: a temp folder)")
