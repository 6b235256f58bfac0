"""Whether fp16 decode weights pay for their packing on this CPU: a timed probe, cached per machine and
layer shape, and the rule ``rollout.backend.dtype: auto`` applies to it.

``rollout.backend.dtype: float16`` on a CPU (``rlkit.rollout.fp16_weights``) decodes with the linears' weights
packed in fp16 for fbgemm. Each decode step's linears then run faster than MKL's fp32 sgemm at 8–64 rows on
layers of a few hundred features and up, and slower on tiny ones; and the first generate after a weight update
repacks every trainable weight. So fp16 weights pay only for a model wide enough and a decode long enough.
Where this CPU's bf16 is not fast (where it is, ``auto`` is bfloat16), ``auto`` picks float16 when

    max_response_length >= FP16_PAYBACK_MARGIN × break-even tokens

and float32 otherwise. The break-even is the probe's packing time over its saving per decode step:

* one decoder layer of the run's model (q, k, v, o, gate, up, down at its shapes: :func:`layer_shapes`; a
  generic layer of hidden 1024, ``PROBE_LAYER``, where the config does not say) at ``FP16_PROBE_ROWS`` rows,
  on one thread;
* fp32 ``F.linear`` against fbgemm's fp16-weight linear, and the packing of the layer's weights, each the best
  of ``FP16_PROBE_ROUNDS`` rounds (other work on the machine only slows a round down).

The LM head is left out: its saving per parameter is larger (docs/benchmarks.md, "fp16 decode weights"), so
the estimate errs toward float32. The margin covers what the probe leaves out: rows that end early (eos), the
prefill (large M, where fp16 weights gain little) and the probe's own noise. The probe is cached beside the
matmul probe (``rlkit.hardware.cpu.cached_entry``), keyed by the layer's shapes, so one machine decides the
same way for one model on every run; its numbers go into the run's ``resolved.decode_reason``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlkit.hardware.cpu import CpuInfo, cached_entry

__all__ = [
    "FP16_PAYBACK_MARGIN",
    "FP16_PROBE_ROWS",
    "FP16_PROBE_ROUNDS",
    "PROBE_LAYER",
    "Layer",
    "layer_shapes",
    "Fp16Probe",
    "probe_fp16_decode",
    "cached_fp16_probe",
    "fp16_decode_pays",
]

FP16_PAYBACK_MARGIN = 2.0  # the decode must be this many times the break-even length


FP16_PROBE_ROWS = 16  # rows of the probe's decode step


FP16_PROBE_ROUNDS = 3


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


@dataclass(frozen=True)
class Fp16Probe:
    fp32_s: float  # one decode step of the probe layer's linears with fp32 weights (best round)
    fp16_s: float  # the same with fbgemm's fp16-packed weights
    pack_s: float  # packing the layer's weights in fp16 once
    rows: int = FP16_PROBE_ROWS
    params: int = 0  # the probe layer's weights

    @property
    def speedup(self) -> float:
        """fp32 step time / fp16-weight step time (> 1: fp16 weights are faster)."""
        return self.fp32_s / self.fp16_s if self.fp16_s > 0 else 0.0

    @property
    def break_even_tokens(self) -> float:
        """Decode steps after which the saving equals one packing (inf: fp16 weights save nothing)."""
        saving = self.fp32_s - self.fp16_s
        return self.pack_s / saving if saving > 0 else math.inf


def _step_seconds(step, reps: int) -> float:
    """Mean wall seconds of ``step()`` over ``reps`` calls, after one warm-up call."""
    step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - start) / reps


def probe_fp16_decode(
    layer: Layer = PROBE_LAYER, rounds: int = FP16_PROBE_ROUNDS, rows: int = FP16_PROBE_ROWS, reps: int = 3
) -> Fp16Probe:
    """Time ``layer`` 's linears at ``rows`` rows in fp32 and with fp16-packed weights (``reps`` steps a
    round, the mean), and their packing, on one thread; the best round of each."""
    import torch
    import torch.nn.functional as F

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in layer]
        inputs = {k: torch.randn(rows, k, generator=gen) for _, k in layer}
        fp32_s = fp16_s = pack_s = math.inf
        for _ in range(rounds):
            start = time.perf_counter()
            packed = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in weights]
            pack_s = min(pack_s, time.perf_counter() - start)
            fp32_s = min(
                fp32_s, _step_seconds(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], reps)
            )
            fp16_s = min(
                fp16_s,
                _step_seconds(
                    lambda packed=packed: [
                        torch.ops.quantized.linear_dynamic_fp16(inputs[w.shape[1]], p)
                        for w, p in zip(weights, packed, strict=True)
                    ],
                    reps,
                ),
            )
        params = sum(n * k for n, k in layer)
        return Fp16Probe(fp32_s=fp32_s, fp16_s=fp16_s, pack_s=pack_s, rows=rows, params=params)
    finally:
        torch.set_num_threads(previous)


def _fp16_probe(entry: dict[str, Any]) -> Fp16Probe:
    return Fp16Probe(
        fp32_s=float(entry["fp32_s"]),
        fp16_s=float(entry["fp16_s"]),
        pack_s=float(entry["pack_s"]),
        rows=int(entry["rows"]),
        params=int(entry["params"]),
    )


def cached_fp16_probe(
    cpu: CpuInfo, cache_path: Path | None = None, *, layer: Layer = PROBE_LAYER, probe=probe_fp16_decode
) -> Fp16Probe:
    """The fp16 probe of ``layer`` for this CPU and torch version from the cache
    (``$RLKIT_CACHE/hardware.json``), or measured now (``probe(layer)``) and added to it."""
    kind = "fp16-decode-" + ",".join(f"{n}x{k}" for n, k in layer)
    return cached_entry(kind, cpu, lambda: asdict(probe(layer)), _fp16_probe, cache_path)


def fp16_decode_pays(probe: Fp16Probe, max_new_tokens: int) -> tuple[bool, str]:
    """(fp16 decode weights?, why in one line) for decodes of up to ``max_new_tokens`` tokens (module
    docstring)."""
    measured = (
        f"fp16-weight linears of one decoder layer ({probe.params / 1e6:.1f} M parameters) measured "
        f"{probe.speedup:.2f}x fp32 at {probe.rows} rows, packing {probe.pack_s * 1e3:.0f} ms"
    )
    even = probe.break_even_tokens
    if not math.isfinite(even):
        return False, f"{measured}: no saving -> float32"
    need = FP16_PAYBACK_MARGIN * even
    pays = max_new_tokens >= need
    return pays, (
        f"{measured}: pays back after {even:.0f} tokens; max_response_length {max_new_tokens} "
        f"{'>=' if pays else '<'} {FP16_PAYBACK_MARGIN:g} x {even:.0f} -> {'float16' if pays else 'float32'}"
    )
