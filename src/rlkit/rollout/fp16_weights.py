"""Decoding with fp16 weights on an x86 CPU: ``rollout.backend: {name: hf, dtype: float16}``.

On a CPU without fast bf16 (AVX2 only), a decode step multiplies 8–64 rows by every weight matrix, and
MKL's fp32 sgemm at that shape reaches neither the matmul peak nor the read bandwidth. fbgemm (PyTorch's x86
quantized backend) has a GEMM made for this shape: the weights packed once in fp16 (half the bytes to read),
the activations and the accumulation in fp32 (the packed fp16 values are widened with F16C on the fly). The
measurements (``benchmarks/decode_kernels.py``, ``benchmarks/decode.py --ab fp16``) are in
docs/benchmarks.md, "fp16 decode weights".

The decode copy (:class:`Fp16DecodeCopy`) is a deep copy of the actor's module whose ``nn.Linear`` s are
:class:`Fp16Linear` (the packed weight, bias kept fp32) and whose other parameters (embeddings, norms,
LoRA adapters) stay fp32 and are copied at every refresh. The copy's machinery, :class:`PackedDecodeCopy`,
takes any packed linear: ``rlkit.rollout.mlas_weights`` uses it with ONNX Runtime's fp32 GEMM. Packing is
not free (docs/benchmarks.md), so a weight is repacked only when it may have moved:

- any weight written since its last packing (``load_state_dict`` and ``copy_`` bump the tensor's version
  counter), a LoRA run's frozen base included;
- every trainable weight when the caller says the trainable weights moved (``trainable_moved``): the fused
  AdamW step writes parameters without bumping their version, so the counter cannot tell. ``HFRollout`` says
  so once after each ``update_weights`` (the hybrid engine's sync after every update), so a full fine-tune
  repacks every weight once per step however many times the step generates (one call per turn in a
  multi-turn step), and a LoRA run's base is packed once.

Numerics: fp16 keeps 11 significant bits (bf16: 8), so each weight is rounded by at most 2^-11
relative; one forward of SmolLM2-135M moved no log-prob over its whole vocabulary by more than 0.02, and the
sampled tokens' probabilities moved by ~3e-4 on the tiny model (the offpolicy smoke run). A weight beyond
fp16's range (|w| > 65504) is an error, never an inf. The rollout's log-probs are those of the fp16-weight
model, as with any decode copy; ``algorithm.rollout_correction`` corrects for the difference.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlkit.errors import RlkitError
from rlkit.hardware import fp16_weights_unavailable

__all__ = ["Fp16DecodeCopy", "Fp16Linear", "PackedDecodeCopy"]

_FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504


class Fp16Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed in fp16 by fbgemm; ``x``, ``b`` and ``y`` fp32, any leading
    shape ``[..., in_features] → [..., out_features]``."""

    def __init__(self, linear: nn.Linear, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pack(linear, name)

    def pack(self, linear: nn.Linear, name: str = "") -> None:
        """Pack ``linear`` 's current weight (and bias); ``name`` for the error where a weight exceeds
        fp16."""
        with torch.no_grad():
            weight = linear.weight.detach().float().contiguous()
            largest = float(weight.abs().max())
            if not largest <= _FP16_MAX:
                raise RlkitError(
                    f"rollout.backend.dtype=float16: {name or 'a linear'}'s weight holds {largest:g}, "
                    f"beyond fp16's range ({_FP16_MAX:g}); decode in float32 (or bfloat16) instead."
                )
            bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16 (fbgemm packed)"
        )


def _packable(name: str, module: nn.Module) -> bool:
    """Plain ``nn.Linear`` s, except a PEFT adapter's own (PEFT reads ``lora_A.weight.dtype``)."""
    return type(module) is nn.Linear and "lora_" not in name


def _pack_all(jobs: list[tuple[nn.Module, nn.Linear, str]]) -> None:
    """``target.pack(linear, name)`` for each job, on as many threads as torch's intra-op count (the worker's
    ``threads_per_worker``): fbgemm (and MLAS) packs one matrix on one thread, and on a pool the packing
    runs partly in parallel (SmolLM2 on 2 threads: 0.72x the packing time, 0.84x the refresh;
    docs/benchmarks.md). The packed weights are the same either way."""
    threads = min(torch.get_num_threads(), len(jobs))
    if threads <= 1:
        for target, linear, name in jobs:
            target.pack(linear, name)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="rlkit-fp16-pack") as pool:
        for done in [pool.submit(target.pack, linear, name) for target, linear, name in jobs]:
            done.result()  # a weight beyond fp16's range raises here, naming the linear


def _skipped(source: nn.Module, names: list[str]) -> dict[int, nn.Parameter]:
    """A ``copy.deepcopy`` memo that leaves out the weights only the linears ``names`` use (they are replaced
    by packed ones right after the copy; an empty stand-in instead of a full fp32 copy of each). A weight
    another module shares (a head tied to the embedding) is copied."""
    packed = {id(p) for name in names for p in source.get_submodule(name).parameters(recurse=False)}
    shared = {
        id(p) for name, m in source.named_modules() if name not in names for p in m.parameters(recurse=False)
    }
    return {i: nn.Parameter(torch.empty(0), requires_grad=False) for i in packed - shared}


def _version(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t._version


class PackedDecodeCopy:
    """A copy of ``source`` for decoding whose ``nn.Linear`` s are ``linear_cls(linear, name)`` (a packed
    weight with a ``pack(linear, name)`` method: :class:`Fp16Linear`,
    ``rlkit.rollout.mlas_weights.MlasLinear``); :meth:`refresh` brings it to ``source`` 's current weights
    (repacking the trainable linears and the frozen ones written since). ``setting``: the recipe setting
    that asked for it, for errors."""

    def __init__(self, source: nn.Module, linear_cls: type[nn.Module], setting: str):
        self.names = [name for name, m in source.named_modules() if _packable(name, m)]
        if not self.names:
            raise RlkitError(f"{setting}: the model has no nn.Linear to pack; decode in float32 instead.")
        self.module = copy.deepcopy(source, _skipped(source, self.names)).requires_grad_(False)
        self.packed_at: dict[str, tuple[int, int]] = {}
        for name in self.names:
            parent, _, child = name.rpartition(".")
            owner = self.module.get_submodule(parent) if parent else self.module
            setattr(owner, child, linear_cls(source.get_submodule(name), name))
            self.packed_at[name] = _version(source.get_submodule(name).weight)
        self._repacked = self._built = len(self.names)  # the first refresh packs nothing more, reports these

    def refresh(self, source: nn.Module, *, trainable_moved: bool = True) -> nn.Module:
        """Repack the linears written since their packing and (``trainable_moved``) every trainable one, copy
        every other parameter and buffer; returns the copy."""
        fresh, self._repacked, self._built = self._built > 0, self._built, 0
        with torch.no_grad():
            todo = []
            for name in self.names:
                linear = source.get_submodule(name)
                now = _version(linear.weight)
                moved = trainable_moved and linear.weight.requires_grad
                if not fresh and (moved or now != self.packed_at[name]):
                    todo.append((name, linear, now))
            _pack_all([(self.module.get_submodule(name), linear, name) for name, linear, _ in todo])
            for name, _, now in todo:
                self.packed_at[name], self._repacked = now, self._repacked + 1
            mine = dict(self.module.named_parameters())
            for name, p in source.named_parameters():
                if name in mine:
                    mine[name].copy_(p)
            mine_buffers = dict(self.module.named_buffers())
            for name, b in source.named_buffers():
                if name in mine_buffers:
                    mine_buffers[name].copy_(b)
        return self.module

    @property
    def repacked(self) -> int:
        """How many linears were packed for the last refresh (the construction's count with the first)."""
        return self._repacked


class Fp16DecodeCopy(PackedDecodeCopy):
    """The decode copy with fbgemm fp16 weights (:class:`Fp16Linear`): ``rollout.backend.dtype: float16``."""

    def __init__(self, source: nn.Module):
        reason = fp16_weights_unavailable()
        if reason:
            raise RlkitError(f"rollout.backend.dtype=float16: {reason}. Use rollout.backend.dtype=float32.")
        super().__init__(source, Fp16Linear, "rollout.backend.dtype=float16")
