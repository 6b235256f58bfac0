"""Executed FLOPs of the actor's update and the stated peak they are divided by (``perf/mfu/actor``).

``perf/mfu/actor = executed update FLOPs / update seconds / (stated peak per rank × ranks)``.

Executed FLOPs (``update_flops``) count the matrix products one micro-batch's forward and backward run, in the
layout the actor ran it (``rlkit.workers.actor``: padded rows, one shared prompt pass per group, packed rows):

* body: ``2 · W_body`` per token position the decoder layers run (``W_body``: weights of the decoder layers'
  linear maps; padding positions the layout runs are counted, prompts a shared pass skips are not);
* LoRA: ``2 · W_lora`` per body position (``W_lora``: the adapters' A and B weights);
* attention: ``4 · d_attn · L`` per causal query·key pair (``d_attn`` = query heads × head dim, ``L`` layers;
  QKᵀ and PV; a kernel that also computes masked pairs executes more, which is not counted);
* head: ``2 · V · H`` per position whose logits are computed (the fused head: response tokens only;
  the logits path: the ``logits_to_keep`` positions);
* backward, only where gradients flow: a trainable linear map 2× its forward (input and weight gradients);
  a frozen one whose input needs a gradient 1× (LoRA's base weights and head), 0× where its input needs none
  (LoRA's first layer: ``model_dims``); attention 2× its forward in every layer whose input needs a gradient.
  Recomputation (gradient checkpointing, the fused head's backward where its logits exceed
  ``KEEP_LOGITS_BYTES`` and are recomputed) is executed but not counted.

Norms, activations, softmax and the optimizer are left out, so the count is a lower bound of the work run.
The *model* FLOPs of the literature (``6 · N · tokens``) are a different number and are not reported as MFU.

The peak (``stated_peak``) is a hardware figure, never a timing: on CUDA a per-device table (``GPU_PEAKS``,
dense, no sparsity); on a CPU ``cores × FLOPs per cycle per core × clock`` (``cpu_flops_per_cycle``: from the
vector-width flags and a small table by vendor; the clock: the largest of the maximum frequency the kernel
reports, the ``@ x.xxGHz`` of the model name and the ``cpu MHz`` lines). Virtual machines often report only
the base clock while the cores run faster: where a best-of matmul probe exceeds the stated figure, the probe
is used instead and named as the source (``peak_source``), so the ratio cannot pass 1 on a matmul.

Imports only the standard library and torch (``benchmarks/common.py`` loads it by file path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ModelDims",
    "Rows",
    "model_dims",
    "update_flops",
    "forward_flops",
    "padded_rows",
    "shared_rows",
    "packed_rows",
    "Peak",
    "GPU_PEAKS",
    "gpu_peak",
    "cpu_flops_per_cycle",
    "cpu_clock_hz",
    "cpu_peak",
    "stated_peak",
    "FlopTally",
]

# A decoder layer's linear maps in the order they run (names of common HF architectures); within the first
# layer, a map gets an input gradient only after an adapter at an earlier stage.
_STAGES = (
    ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv"),
    ("o_proj", "out_proj", "dense"),
    ("gate_proj", "up_proj", "gate_up_proj", "fc1", "c_fc", "w1", "w3", "dense_h_to_4h"),
    ("down_proj", "fc2", "w2", "dense_4h_to_h"),
)


# ----- what the model computes --------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    body: int  # weights of the decoder layers' linear maps (LoRA: the frozen base weights)
    head: int  # vocabulary × hidden (the LM head's matmul; a tied head counted here once)
    layers: int
    attn_width: int  # query heads × head dim
    lora: int = 0  # weights of the LoRA adapters (A and B), 0 without LoRA
    # LoRA: the first decoder layer's maps whose input needs no gradient (it reads the frozen embeddings):
    first_quiet: int = 0  # base weights without an input gradient there
    first_quiet_a: int = 0  # adapter A maps without an input gradient there
    first_attention_grad: bool = True  # whether the first layer's attention runs a backward

    @property
    def is_lora(self) -> bool:
        return self.lora > 0


@dataclass(frozen=True)
class Rows:
    """Positions one forward runs: through the decoder layers, through the head, and causal attention
    pairs."""

    body: float
    head: float
    pairs: float


def _linears(module: Any):
    from torch import nn

    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            yield name, sub


def model_dims(module: Any) -> ModelDims:
    """``ModelDims`` of an HF causal LM (plain, LoRA-injected or FSDP2-sharded: shapes come from the linear
    maps' ``in_features`` / ``out_features``, which sharding leaves alone).

    LoRA's first decoder layer reads the frozen embeddings: its maps (base and adapter A) get an input
    gradient only when an adapter sits at an earlier stage of the layer (q/k/v → o → gate/up → down;
    ``_STAGES``), its attention a backward only with an adapter on q/k/v. A map of unknown name there counts
    as the last stage."""
    cfg = module.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    maps = [
        (name, lin.in_features * lin.out_features, re.search(r"layers\.(\d+)\.", name))
        for name, lin in _linears(module)
    ]
    first = min((int(m.group(1)) for _, _, m in maps if m), default=None)

    def in_first(m) -> bool:
        return m is not None and int(m.group(1)) == first

    def adapter(name: str) -> bool:
        return ".lora_A." in name or ".lora_B." in name

    head = sum(size for name, size, _ in maps if not adapter(name) and _is_head(name, size, cfg))
    body = sum(size for name, size, _ in maps if not adapter(name) and not _is_head(name, size, cfg))
    lora = sum(size for name, size, _ in maps if adapter(name))
    earliest = min(
        (_stage(name) for name, _, m in maps if adapter(name) and in_first(m)), default=len(_STAGES)
    )

    def quiet(name: str) -> bool:
        return _stage(name) <= earliest

    first_quiet = sum(size for name, size, m in maps if not adapter(name) and in_first(m) and quiet(name))
    first_quiet_a = sum(size for name, size, m in maps if ".lora_A." in name and in_first(m) and quiet(name))
    return ModelDims(
        body=body,
        head=head,
        layers=cfg.num_hidden_layers,
        attn_width=heads * head_dim,
        lora=lora,
        first_quiet=first_quiet,
        first_quiet_a=first_quiet_a,
        first_attention_grad=earliest == 0,
    )


def _is_head(name: str, size: int, cfg: Any) -> bool:
    return "layers." not in name and size == cfg.vocab_size * cfg.hidden_size


def _stage(name: str) -> int:
    """The map's stage in its layer (``_STAGES``); unknown names: past the last (never upstream of
    anything)."""
    parts = name.split(".")
    return next((i for i, names in enumerate(_STAGES) if any(n in parts for n in names)), len(_STAGES))


def _causal(queries: float, past: float = 0.0) -> float:
    """Query·key pairs of ``queries`` positions each seeing ``past`` earlier keys and the causal triangle."""
    return queries * past + queries * (queries + 1) / 2


def padded_rows(b: int, width: int, head: float) -> Rows:
    """``b`` rows of ``width`` positions each; the head on ``head`` positions."""
    return Rows(body=b * width, head=head, pairs=b * _causal(width))


def shared_rows(u: int, b: int, p: int, t: int, head: float) -> Rows:
    """One pass over ``u`` distinct prompts of ``p`` positions, then ``b`` rows of ``t`` response positions on
    their prompt's KV cache."""
    return Rows(body=u * p + b * t, head=head, pairs=u * _causal(p) + b * _causal(t, p))


def packed_rows(g: int, width: int, head: float) -> Rows:
    """``g`` packed rows of ``width`` positions (a group's prompt once, then its responses)."""
    return padded_rows(g, width, head)


def forward_flops(dims: ModelDims, rows: Rows) -> float:
    attention = 4.0 * dims.attn_width * dims.layers * rows.pairs
    return 2.0 * (dims.body + dims.lora) * rows.body + attention + 2.0 * dims.head * rows.head


def update_flops(dims: ModelDims, rows: Rows) -> float:
    """Forward + backward FLOPs of one micro-batch of the update (module docstring)."""
    forward = forward_flops(dims, rows)
    attention = 4.0 * dims.attn_width * dims.layers * rows.pairs
    if not dims.is_lora:
        return 3.0 * forward  # every linear map trainable: input and weight gradients; attention 2x
    base_dx = 2.0 * (dims.body - dims.first_quiet) * rows.body  # frozen base: input gradients only
    # adapters: input and weight gradients
    adapters = (4.0 * dims.lora - 2.0 * dims.first_quiet_a) * rows.body
    graded = dims.layers if dims.first_attention_grad else dims.layers - 1
    attention_bw = 2.0 * attention * graded / dims.layers
    head_dx = 2.0 * dims.head * rows.head
    return forward + base_dx + adapters + attention_bw + head_dx


class FlopTally:
    """Executed update FLOPs summed over the micro-batches the actor runs (``add`` per forward, with its
    rows)."""

    def __init__(self, dims: ModelDims):
        self.dims = dims
        self.flops = 0.0
        self.layouts: dict[str, int] = {}
        self.rows: list[Rows] = []

    def add(self, layout: str, rows: Rows) -> None:
        self.flops += update_flops(self.dims, rows)
        self.rows.append(rows)
        self.layouts[layout] = self.layouts.get(layout, 0) + 1


# ----- the peak -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of one rank (one GPU, or one worker's threads)
    source: str  # "table: ..." or "probe: ..."

    def params(self) -> dict[str, Any]:
        return {"peak_tflops_per_rank": round(self.flops / 1e12, 4), "peak_source": self.source}


# Dense (no 2:4 sparsity) tensor-core bf16 and CUDA-core fp32 TFLOP/s from NVIDIA's data sheets; the most
# specific name first. TF32 (torch.backends.cuda.matmul.allow_tf32) uses the "tf32" column.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM4 and PCIe, 40 and 80 GB
)


def gpu_peak(name: str, precision: str, *, tf32: bool = False) -> Peak | None:
    """The table's peak for the device ``name`` (``torch.cuda.get_device_name``) in ``precision`` (bf16/fp32),
    or None for a device the table does not list."""
    column = "bf16" if precision == "bf16" else ("tf32" if tf32 else "fp32")
    for key, row in GPU_PEAKS:
        if key.lower() in name.lower():
            return Peak(row[column] * 1e12, f"table: {key} {column} dense {row[column]:g} TFLOP/s ({name})")
    return None


def _cpuinfo_fields(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def cpu_flops_per_cycle(vendor: str, flags: set[str], precision: str) -> tuple[int, str]:
    """Peak FLOPs per cycle of one core (multiply-add = 2) and the table row used.

    fp32: AVX-512 with two 512-bit FMA pipes 64 (Intel; AMD from Zen 5, told apart from Zen 4 by
    ``avx_vnni``); Zen 4's AVX-512 on 256-bit pipes 32; AVX2 + FMA (two 256-bit FMA pipes) 32; AVX 16; else
    SSE 8; Arm NEON (asimd, two 128-bit pipes) 16, SVE counted as NEON unless wider (upper bound 32). bf16:
    AMX 1024 (Intel Sapphire Rapids and later); AVX-512 BF16 dot products twice the fp32 row; without native
    bf16, the fp32 row (bf16 then runs on the fp32 units)."""
    amd = vendor == "AuthenticAMD"
    if "avx512f" in flags:
        fp32, row = (
            (32, "Zen 4 AVX-512 (256-bit pipes)") if amd and "avx_vnni" not in flags else (64, "AVX-512 x2")
        )
    elif "avx2" in flags and "fma" in flags:
        fp32, row = 32, "AVX2+FMA x2"
    elif "avx" in flags:
        fp32, row = 16, "AVX"
    elif "sve" in flags:
        fp32, row = 32, "SVE (upper bound)"
    elif "asimd" in flags:
        fp32, row = 16, "NEON x2"
    else:
        fp32, row = 8, "SSE"
    if precision != "bf16":
        return fp32, f"{row} fp32 {fp32}"
    if "amx_bf16" in flags:
        return 1024, "AMX bf16 1024"
    if "avx512_bf16" in flags or "bf16" in flags:
        return 2 * fp32, f"{row} bf16 dot {2 * fp32}"
    return fp32, f"{row} (no native bf16) {fp32}"


def cpu_clock_hz(cpuinfo_text: str, sys_max_khz: str | None = None) -> float:
    """The largest clock the system states: cpufreq's ``cpuinfo_max_freq`` (kHz), the ``@ x.xxGHz`` of the
    model name, the ``cpu MHz`` lines; 0 when none is stated."""
    candidates = [float(m) * 1e6 for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo_text, re.M)]
    model = re.search(r"@\s*([\d.]+)\s*GHz", cpuinfo_text)
    if model:
        candidates.append(float(model.group(1)) * 1e9)
    if sys_max_khz and sys_max_khz.strip().isdigit():
        candidates.append(int(sys_max_khz) * 1e3)
    return max(candidates, default=0.0)


def cpu_peak(
    threads: int,
    precision: str,
    *,
    cpuinfo: str | Path = "/proc/cpuinfo",
    cpufreq: str | Path = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq",
) -> Peak | None:
    """``threads × FLOPs per cycle × clock`` for a worker running ``threads`` torch threads (one core each;
    SMT siblings share a core's pipes, so the figure only gets larger than the real one). None when no clock
    is stated."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    try:
        max_khz = Path(cpufreq).read_text()
    except OSError:
        max_khz = None
    fields = _cpuinfo_fields(text)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    per_cycle, row = cpu_flops_per_cycle(fields.get("vendor_id", ""), flags, precision)
    clock = cpu_clock_hz(text, max_khz)
    if clock <= 0:
        return None
    return Peak(
        threads * per_cycle * clock, f"table: {threads} cores x {row} FLOP/cycle x {clock / 1e9:.2f} GHz"
    )


def stated_peak(
    device: str, precision: str, threads: int, *, probe: float = 0.0, cpuinfo: str | Path = "/proc/cpuinfo"
) -> Peak | None:
    """The peak of one rank (module docstring). ``probe``: a best-of matmul rate measured on the same threads
    (CPU):
    used, and named, where it exceeds the stated figure. None where nothing is known (an unlisted GPU)."""
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
        tf32 = bool(getattr(torch.backends.cuda.matmul, "allow_tf32", False))
        tf32 = tf32 or torch.get_float32_matmul_precision() in ("high", "medium")  # TF32 tensor cores allowed
        return gpu_peak(name, precision, tf32=tf32)
    peak = cpu_peak(threads, precision, cpuinfo=cpuinfo)
    if probe > (peak.flops if peak else 0.0):
        stated = f"; above the {peak.source}" if peak else ""
        return Peak(probe, f"probe: best of 3 1024² matmuls on {threads} threads{stated}")
    return peak
