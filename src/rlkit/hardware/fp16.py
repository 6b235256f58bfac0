"""Whether fp16 decode weights pay for their packing on this CPU: a timed probe, cached per machine and
layer shape, and the rule ``rollout.backend.dtype: auto`` applies to it.

``rollout.backend.dtype: float16`` on a CPU (``rlkit.rollout.fp16_weights``) decodes with the linears' weights
packed in fp16 for fbgemm. Each decode step's linears then run faster than MKL's fp32 sgemm at 8–64 rows on
layers of a few hundred features and up, and slower on tiny ones; and the first generate after a weight update
repacks every trainable weight. So fp16 weights pay only for a model wide enough and a decode long enough.
Where this CPU's bf16 is not fast (where it is, ``auto`` is bfloat16), ``auto`` picks float16 when

    max_response_length >= FP16_PAYBACK_MARGIN × break-even tokens

and float32 otherwise. The break-even is the probe's packing time over its saving per decode step
(``rlkit.hardware.packed_probe``, shared with ``rlkit.hardware.mlas``):

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

from dataclasses import asdict, dataclass
from pathlib import Path

from rlkit.hardware.cpu import CpuInfo, cached_entry
from rlkit.hardware.packed_probe import (
    PROBE_LAYER,
    Layer,
    PackedProbe,
    layer_shapes,
    payback_choice,
    time_packed_layer,
)

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


@dataclass(frozen=True)
class Fp16Probe(PackedProbe):
    PACKED_FIELD = "fp16_s"

    fp32_s: float  # one decode step of the probe layer's linears with fp32 weights (best round)
    fp16_s: float  # the same with fbgemm's fp16-packed weights
    pack_s: float  # packing the layer's weights in fp16 once
    rows: int = FP16_PROBE_ROWS
    params: int = 0  # the probe layer's weights


def probe_fp16_decode(
    layer: Layer = PROBE_LAYER, rounds: int = FP16_PROBE_ROUNDS, rows: int = FP16_PROBE_ROWS, reps: int = 3
) -> Fp16Probe:
    """Time ``layer`` 's linears at ``rows`` rows in fp32 and with fp16-packed weights (``reps`` steps a
    round, the mean), and their packing, on one thread; the best round of each."""
    import torch

    timed = time_packed_layer(
        layer,
        lambda w: torch.ops.quantized.linear_prepack_fp16(w, None),
        torch.ops.quantized.linear_dynamic_fp16,
        rounds=rounds,
        rows=rows,
        reps=reps,
    )
    return Fp16Probe(
        fp32_s=timed["fp32_s"],
        fp16_s=timed["packed_s"],
        pack_s=timed["pack_s"],
        rows=rows,
        params=int(timed["params"]),
    )


def cached_fp16_probe(
    cpu: CpuInfo, cache_path: Path | None = None, *, layer: Layer = PROBE_LAYER, probe=probe_fp16_decode
) -> Fp16Probe:
    """The fp16 probe of ``layer`` for this CPU and torch version from the cache
    (``$RLKIT_CACHE/hardware.json``), or measured now (``probe(layer)``) and added to it."""
    kind = "fp16-decode-" + ",".join(f"{n}x{k}" for n, k in layer)
    return cached_entry(kind, cpu, lambda: asdict(probe(layer)), Fp16Probe.from_entry, cache_path)


def fp16_decode_pays(probe: Fp16Probe, max_new_tokens: int) -> tuple[bool, str]:
    """(fp16 decode weights?, why in one line) for decodes of up to ``max_new_tokens`` tokens (module
    docstring)."""
    return payback_choice(
        probe,
        max_new_tokens,
        margin=FP16_PAYBACK_MARGIN,
        kernel="fp16-weight linears",
        baseline="fp32",
        choices=("float16", "float32"),
    )
