"""Where a run computes: the device, the torch.distributed backend, GPU memory metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlkit.hardware.cpu import PrecisionDecision, device_type, precision_decision

__all__ = [
    "DevicePlan",
    "dist_backend",
    "cuda_missing",
    "device_plan",
    "gpu_memory_metrics",
]


# The one place that decides where a run computes: resources.device -> device, torch.distributed backend
# (nccl on CUDA, gloo on CPU) and, through ``precision_decision``, what ``auto`` precision becomes there.
@dataclass(frozen=True)
class DevicePlan:
    device: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl"

    def torch_device(self, index: int | None = None) -> Any:
        import torch

        return torch.device(self.device if self.device == "cpu" or index is None else f"cuda:{index}")

    def precision(self) -> PrecisionDecision:
        """``auto`` precision here: bf16 on a CUDA device with bf16, else measured (CPU) or fp32."""
        return precision_decision(self.device)


def dist_backend(device: Any) -> str:
    """The torch.distributed backend for ``device`` ("cpu", "cuda", "cuda:1", a torch.device)."""
    return "nccl" if device_type(device) == "cuda" else "gloo"


def cuda_missing(requested: str, cuda_available: bool | None = None) -> str | None:
    """Why ``resources.device: cuda`` cannot run here (None when it can, or when CUDA was not asked for)."""
    import torch

    if requested != "cuda":
        return None
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if available:
        return None
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build (no CUDA)"
    return (
        f"resources.device is 'cuda' but torch {torch.__version__} ({build}) sees no GPU on this "
        f"machine. Set resources.device=cpu (or auto), run on a GPU node, or install a CUDA build of "
        f"torch."
    )


def device_plan(requested: str = "auto", *, cuda_available: bool | None = None) -> DevicePlan:
    """``auto`` -> cuda when torch sees a GPU, else cpu. Raises ``ValueError`` for cuda without a GPU
    (``cuda_missing`` says why) or an unknown name; callers turn it into their own error."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"resources.device must be auto, cpu or cuda, got {requested!r}.")
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "auto":
        requested = "cuda" if available else "cpu"
    reason = cuda_missing(requested, available)
    if reason:
        raise ValueError(reason)
    return DevicePlan(requested, dist_backend(requested))


def gpu_memory_metrics(device: Any) -> dict[str, float]:
    """veRL's ``perf/max_memory_{allocated,reserved}_gb`` (GiB, peak since the process started) on a
    CUDA device; on a CPU nothing (no device memory; ``perf/cpu_memory_used_gb`` is the driver's)."""
    import torch

    if device_type(device) != "cuda":
        return {}
    return {
        "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
        "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
    }
