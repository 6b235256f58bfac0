"""The ``sglang`` backend's parameters (``rollout.backend: {name: sglang, ...}``): the one place their
defaults live.

Settings that cannot work together are refused here, when the recipe is validated: SGLang's memory
saver (``--enable-memory-saver``, which ``/release_memory_occupation`` needs) is CUDA-only, and on a
CPU server ``/release_memory_occupation`` kills the server; so ``launch.device: cpu`` with
``launch.enable_memory_saver: true`` or ``memory_release: true`` is an error. With ``device: auto``
the device is known only when the backend starts (the worker's device), and the same request is
refused there (``rlkit_sglang.backend``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

__all__ = [
    "SglangLaunchParams",
    "SglangParams",
    "CPU_MEMORY_RELEASE",
    "MEMORY_RELEASE_FIX",
    "memory_release_problem",
]

# Why memory release is never used on CPU (in errors and logs).
CPU_MEMORY_RELEASE = (
    "SGLang's memory saver (torch_memory_saver) is CUDA-only: on a CPU server --enable-memory-saver "
    "fails at start and /release_memory_occupation kills the server"
)


MEMORY_RELEASE_FIX = (
    "Leave rollout.backend.memory_release unset (it is then used only where every server runs on CUDA "
    "with --enable-memory-saver) or run the servers on cuda with the memory saver on."
)


class SglangLaunchParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    python: str | None = Field(
        None,
        description="Python interpreter with SGLang installed (its own venv); "
        "default: the worker's interpreter",
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto = the worker's device")
    num_replicas: PositiveInt = Field(1, description="rollout engines (data parallel)")
    tp_size: PositiveInt = Field(1, description="GPUs per engine (tensor parallel; 1 on CPU)")
    mem_fraction_static: float = Field(
        0.6, gt=0, le=1, description="GPU memory for weights + KV cache (CUDA only)"
    )
    dtype: str | None = Field(
        None, description="weights' dtype in the engine; default bfloat16 on CUDA, float32 on CPU"
    )
    enable_memory_saver: bool | None = Field(
        None, description="--enable-memory-saver (needed by release/resume); default on for CUDA; CUDA-only"
    )
    context_length: PositiveInt | None = Field(None, description="--context-length (default on CPU: 1024)")
    max_total_tokens: PositiveInt | None = Field(
        None, description="--max-total-tokens, the KV pool (default on CPU: 8192)"
    )
    max_running_requests: PositiveInt | None = Field(
        None, description="--max-running-requests (default on CPU: 64)"
    )
    threads: PositiveInt = Field(1, description="OMP_NUM_THREADS of a CPU server")
    host: str = Field("127.0.0.1", description="address the servers bind")
    startup_timeout_s: PositiveFloat = Field(600.0, description="seconds to wait for /health after launch")
    log_dir: str | None = Field(
        None, description="folder of the servers' logs (default: the working directory)"
    )
    extra_args: list[str] = Field(default_factory=list, description="passed through to sglang.launch_server")

    @model_validator(mode="after")
    def _cpu_has_no_memory_saver(self) -> SglangLaunchParams:
        if self.device == "cpu":
            if self.enable_memory_saver:
                raise ValueError(
                    f"launch.enable_memory_saver=true with launch.device=cpu: {CPU_MEMORY_RELEASE}. "
                    "Remove enable_memory_saver (default: off on CPU) or launch on cuda."
                )
            if self.tp_size != 1:
                raise ValueError(
                    "launch.tp_size must be 1 with launch.device=cpu (tensor parallel needs GPUs)."
                )
        return self


class SglangParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    urls: list[str] = Field(
        default_factory=list, description="attach to running servers (one per replica); empty = launch"
    )
    launch: SglangLaunchParams = Field(
        default_factory=SglangLaunchParams, description="servers to start when no urls are given"
    )
    model_path: str | None = Field(
        None, description="model the launched servers load (default: the actor's name_or_path)"
    )
    memory_release: bool | None = Field(
        None,
        description="release/resume the servers' memory around training; "
        "None = when every server reports a CUDA device with "
        "the memory saver on; true on a server that cannot → error",
    )
    timeout_s: PositiveFloat = Field(600.0, description="per request")
    retries: int = Field(3, ge=0, description="per request, on connection errors")
    weight_sync: Literal["auto", "tensor", "disk"] = Field(
        "auto",
        description="tensor: in memory (/update_weights_from_tensor over shared memory; same host only); "
        "disk: one folder per run, rewritten in place (/update_weights_from_disk); "
        "auto: tensor for launched servers, disk for attached ones (urls)",
    )
    weights_dir: str | None = Field(
        None,
        description="where the run's weights folder is made (disk sync, LoRA adapters; removed at "
        "exit); default: the temp dir",
    )

    @model_validator(mode="after")
    def _memory_release_needs_cuda(self) -> SglangParams:
        if self.memory_release and not self.urls:
            problem = memory_release_problem(self.launch.device, self.launch.enable_memory_saver)
            if problem:
                raise ValueError(f"memory_release=true: {problem}. {MEMORY_RELEASE_FIX}")
        return self


def memory_release_problem(device: str, memory_saver: bool | None) -> str | None:
    """Why a server on ``device`` with ``memory_saver`` cannot release its memory, or None when it can
    (``memory_saver=None``: not known, e.g. an attached server that does not report it)."""
    if device == "cpu":
        return CPU_MEMORY_RELEASE
    if memory_saver is False:
        return "the server runs without --enable-memory-saver, which /release_memory_occupation needs"
    return None
