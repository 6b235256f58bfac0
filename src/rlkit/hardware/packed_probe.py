"""What the two packed-weight decode probes share (``rlkit.hardware.fp16``: fbgemm's fp16 weights;
``rlkit.hardware.mlas``: ONNX Runtime's prepacked fp32 GEMM).

Both time one decoder layer's linears (q, k, v, o, gate, up, down at the run's shapes: :func:`layer_shapes`; a
generic layer of hidden 1024, ``PROBE_LAYER``, where the config does not say) at a decode step's rows, on one
thread: fp32 ``F.linear`` against the faster kernel on weights it packs once, and that packing; the best of a
few rounds each (:func:`time_packed_layer`). Both apply the same rule: the kernel pays where

    max_response_length >= margin × break-even tokens

the break-even being the packing time over the saving per decode step (:func:`payback_choice`). Each probe
keeps its own dataclass, whose field names are its cache format (``rlkit.hardware.cpu.cached_entry``);
:class:`PackedProbe` gives both the same derived numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any, ClassVar, TypeVar

__all__ = [
    "PROBE_LAYER",
    "Layer",
    "PackedProbe",
    "layer_shapes",
    "payback_choice",
    "probe_from_entry",
    "step_seconds",
    "time_packed_layer",
]


Layer = tuple[tuple[int, int], ...]  # (out_features, in_features) of each of a decoder layer's linears


# a generic decoder layer: hidden 1024, GQA 4:1, MLP 2816
PROBE_LAYER: Layer = (
    (1024, 1024),
    (256, 1024),
    (256, 1024),
    (1024, 1024),
    (2816, 1024),
    (2816, 1024),
    (1024, 2816),
)


def layer_shapes(config: Mapping[str, Any]) -> Layer | None:
    """One decoder layer's linears (q, k, v, o, gate, up, down) from a transformers config dict (Llama, Qwen2,
    Mistral and the like), or None where it lacks the sizes."""
    try:
        hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return None
    q, kv = heads * head_dim, kv_heads * head_dim
    return (
        (q, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, q),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    )


Probe = TypeVar("Probe", bound="PackedProbe")


class PackedProbe:
    """Derived numbers of a frozen probe dataclass with ``fp32_s`` (one decode step of the layer's linears
    with ``F.linear``), ``pack_s`` (packing the layer's weights once), ``rows``, ``params`` and the packed
    kernel's step time in the field named by ``PACKED_FIELD``."""

    PACKED_FIELD: ClassVar[str]
    fp32_s: float
    pack_s: float
    rows: int
    params: int

    @property
    def packed_s(self) -> float:
        return getattr(self, self.PACKED_FIELD)

    @property
    def speedup(self) -> float:
        """F.linear step time / packed step time (> 1: the packed kernel is faster)."""
        return self.fp32_s / self.packed_s if self.packed_s > 0 else 0.0

    @property
    def break_even_tokens(self) -> float:
        """Decode steps after which the saving equals one packing (inf: the packed kernel saves nothing)."""
        saving = self.fp32_s - self.packed_s
        return self.pack_s / saving if saving > 0 else math.inf

    @classmethod
    def from_entry(cls: type[Probe], entry: Mapping[str, Any]) -> Probe:
        """The probe from its cache entry (:func:`probe_from_entry`)."""
        return probe_from_entry(cls, entry)


def probe_from_entry(cls: type[Probe], entry: Mapping[str, Any]) -> Probe:
    """The frozen probe dataclass ``cls`` (int and float fields) from its cache entry (KeyError, TypeError or
    ValueError where a field is missing or malformed: ``cached_entry`` then measures again)."""
    return cls(**{f.name: (int if f.type in ("int", int) else float)(entry[f.name]) for f in fields(cls)})


def step_seconds(step: Callable[[], object], reps: int) -> float:
    """Mean wall seconds of ``step()`` over ``reps`` calls, after one warm-up call."""
    step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - start) / reps


def time_packed_layer(
    layer: Layer,
    pack: Callable[[Any], Any],
    packed_linear: Callable[[Any, Any], Any],
    *,
    rounds: int,
    rows: int,
    reps: int,
) -> dict[str, float | int]:
    """``layer`` 's linears at ``rows`` rows on one thread: ``fp32_s`` with ``F.linear``, ``packed_s`` with
    ``packed_linear(x, pack(weight))`` (``reps`` steps a round, the mean), ``pack_s`` packing all the layer's
    weights, each the best of ``rounds`` rounds; and ``params``, the layer's weights."""
    import torch
    import torch.nn.functional as F

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in layer]
        inputs = {k: torch.randn(rows, k, generator=gen) for _, k in layer}
        fp32_s = packed_s = pack_s = math.inf
        for _ in range(rounds):
            start = time.perf_counter()
            packed = [pack(w) for w in weights]
            pack_s = min(pack_s, time.perf_counter() - start)
            fp32_s = min(
                fp32_s, step_seconds(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], reps)
            )

            def packed_step(packed: Sequence[Any] = packed) -> list[Any]:
                return [packed_linear(inputs[w.shape[1]], p) for w, p in zip(weights, packed, strict=True)]

            packed_s = min(packed_s, step_seconds(packed_step, reps))
        params = sum(n * k for n, k in layer)
        return {"fp32_s": fp32_s, "packed_s": packed_s, "pack_s": pack_s, "params": params}
    finally:
        torch.set_num_threads(previous)


def payback_choice(
    probe: PackedProbe,
    max_new_tokens: int,
    *,
    margin: float,
    kernel: str,
    baseline: str,
    choices: tuple[str, str],
) -> tuple[bool, str]:
    """(the packed kernel pays?, why in one line) for decodes of up to ``max_new_tokens`` tokens: it pays
    where they reach ``margin`` × its break-even. ``kernel`` and ``baseline`` name the two in the line,
    ``choices`` the values it picks (pays, does not)."""
    measured = (
        f"{kernel} of one decoder layer ({probe.params / 1e6:.1f} M parameters) measured "
        f"{probe.speedup:.2f}x {baseline} at {probe.rows} rows, packing {probe.pack_s * 1e3:.0f} ms"
    )
    yes, no = choices
    even = probe.break_even_tokens
    if not math.isfinite(even):
        return False, f"{measured}: no saving -> {no}"
    need = margin * even
    pays = max_new_tokens >= need
    return pays, (
        f"{measured}: pays back after {even:.0f} tokens; max_response_length {max_new_tokens} "
        f"{'>=' if pays else '<'} {margin:g} x {even:.0f} -> {yes if pays else no}"
    )
