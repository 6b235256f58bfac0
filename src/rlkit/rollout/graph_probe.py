"""Whether the one-graph decode step pays for a model on this CPU: a probe of the whole step, four ways.

``rollout.backend.linears: auto`` (with ``dtype: auto``) on a CPU without fast bf16 chooses how the hf backend
decodes. For a model the one-graph step takes (``rlkit.rollout.ort_step``: a transformers Llama, Qwen2,
Qwen3 or Mistral without a sliding window, SiLU MLP, fp32 weights, no LoRA adapter), the per-linear probes
(``rlkit.hardware.fp16``, ``rlkit.hardware.mlas``) time the layer's linears alone, while the graph also runs
the norms, rotary, attention and activation in ONNX Runtime: those probes understate it. This probe times
what each path really runs, on one decoder layer of the run's own architecture (its config with one layer
and a 256-word vocabulary, random weights), at ``GRAPH_PROBE_ROWS`` rows over a ``GRAPH_PROBE_CONTEXT``-token
prefill, one thread, the best of ``GRAPH_PROBE_ROUNDS`` rounds:

- ``fp32_s``: the lean step (``rlkit.rollout.lean_step.LeanStep``) with ``F.linear`` as the decode runs it
  (``rlkit.rollout.decode``): its layers under TorchScript (``rlkit.rollout.scripted_step``), with the
  compiled glue operators and, over a cache that keeps its keys transposed, the compiled attention kernel
  where they load on this machine and the kernel's own probe takes it (``rlkit.rollout.attention_kernel``);
- ``fp16_s``: the same step over fbgemm fp16 weights (``rlkit.rollout.fp16_weights``; inf where this torch
  has no fbgemm), ``fp16_pack_s`` repacking them once (one weight hand-over);
- ``graph_s``: the one-graph step (``OrtDecodeStep``), ``graph_pack_s`` rebuilding its session once;
- ``bf16_s``: the lean step over oneDNN-packed bf16 weights (``rlkit.rollout.bf16_weights``; run the same
  way, over fp32 K/V), ``bf16_pack_s`` repacking them once; only on a CPU with native bf16
  (``CpuInfo.native_bf16``: avx512_bf16, AMX) where torch has oneDNN, inf elsewhere (emulated bf16 is many
  times slower than fp32: nothing to weigh).

Each path costs ``margin × pack + tokens × step`` for a decode of ``tokens`` (no pack for ``F.linear``;
``margin``: ``rlkit.hardware.mlas.MLAS_PAYBACK_MARGIN``, the per-linear probes' margin); the cheapest wins
(:func:`graph_choice`), a tie going to the simpler path (fp32, then fp16, then the graph, then bf16). The
probe is cached per CPU, torch version and architecture (``$RLKIT_CACHE/hardware.json``); its numbers go
into the run's ``resolved.decode_linears_reason``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GRAPH_PROBE_CONTEXT",
    "GRAPH_PROBE_ROUNDS",
    "GRAPH_PROBE_ROWS",
    "GraphProbe",
    "cached_graph_probe",
    "graph_choice",
    "model_choice",
    "probe_graph_step",
]

GRAPH_PROBE_ROWS = 16
GRAPH_PROBE_CONTEXT = 64
GRAPH_PROBE_ROUNDS = 3
_STEPS = 8  # decode steps timed per round and path
_VOCAB = 256
_LAYERS = 3  # the probe model's depth; a layer's share is the difference to a one-layer model


@dataclass(frozen=True)
class GraphProbe:
    fp32_s: float  # one lean decode step of the probe model (one decoder layer) with F.linear (best round)
    fp16_s: float  # the same over fbgemm fp16 weights (inf: no fbgemm in this torch)
    graph_s: float  # the same as one ONNX Runtime graph
    fp16_pack_s: float  # repacking the fp16 weights once
    graph_pack_s: float  # rebuilding the graph's session once (MLAS prepacks its weights)
    # the lean step over oneDNN-packed bf16 weights, and repacking them once (inf: not measured: no native
    # bf16)
    bf16_s: float = math.inf
    bf16_pack_s: float = math.inf
    rows: int = GRAPH_PROBE_ROWS
    params: int = 0  # the probe layer's weights

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> GraphProbe | None:
        """The probe from its cache entry; None for an architecture measured as one the graph declines."""
        from rlkit.hardware.packed_probe import probe_from_entry

        return None if entry.get("no_graph") else probe_from_entry(cls, entry)


def _probe_model(config: Mapping[str, Any], layers: int):
    """The run's architecture with ``layers`` decoder layers and a small vocabulary, random fp32 weights; None
    where transformers cannot build it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type is None:
        return None
    values |= {"num_hidden_layers": layers, "vocab_size": _VOCAB, "tie_word_embeddings": False}
    for key in ("layer_types", "max_window_layers", "architectures", "torch_dtype", "dtype"):
        values.pop(key, None)
    try:
        small = AutoConfig.for_model(model_type, **values)
        small.pad_token_id = small.bos_token_id = small.eos_token_id = None
        with torch.random.fork_rng(devices=[]):  # the run's own random state stays as it was
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
    except Exception:  # noqa: BLE001 - transformers' many error types: no probe model, no graph choice
        return None


def _time_steps(step, cache, ids, mask, steps: int) -> float:
    """Mean seconds of ``steps`` decode steps of ``step`` from a copy of the prefilled ``cache``."""
    cache = copy.deepcopy(cache)
    rows, width = mask.shape
    full = torch.cat([mask, torch.ones(rows, steps + 1, dtype=mask.dtype)], 1)
    token, last = ids[:, -1:], torch.full((rows,), width - 1)
    step(cache, token, last + 1, full[:, : width + 1])  # warm-up
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step(cache, token, last + 1 + i, full[:, : width + 1 + i])
    return (time.perf_counter() - start) / steps


def _time_paths(model, graph, rounds: int, rows: int, context: int, bf16: bool) -> dict[str, float]:
    """Best-of-``rounds`` seconds of a decode step of ``model`` by each path (bf16 weights only where
    ``bf16``), and of each path's repack."""
    from rlkit.hardware import fp16_weights_unavailable
    from rlkit.model.kv_cache import cache_argument
    from rlkit.rollout.attention_kernel import kernel_fits, kernel_pays
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy
    from rlkit.rollout.cpu_kernels import kernel_unavailable
    from rlkit.rollout.decode import SlabCache, slab_layers
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy
    from rlkit.rollout.lean_step import LeanStep

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _VOCAB, (rows, context), generator=gen)
    mask = torch.ones(rows, context, dtype=torch.long)
    glue = kernel_unavailable() is None  # the compiled operators loaded: the fused loop and the kernel
    lean = LeanStep(model, scripted=True, fused_glue=glue)  # as the decode runs it (rollout.decode)
    kernel = glue and kernel_fits(lean) and kernel_pays(lean.heads, lean.kv_heads, lean.dim)
    caches = {}  # the graph's (it writes the slabs only) and the lean step's (transposed keys: the kernel's)
    for name, transposed in (("graph", False), ("lean", kernel)):
        cache = SlabCache(slab_layers(model), context + _STEPS + 2, transposed_keys=transposed)
        model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_argument(model, cache))
        caches[name] = cache
    copies = {
        "fp16": None if fp16_weights_unavailable() else Fp16DecodeCopy(model),
        "bf16": Bf16DecodeCopy(model) if bf16 else None,
    }
    # the construction packed (the first refresh packs nothing); every later refresh repacks, as one weight
    # hand-over does
    for packed in copies.values():
        if packed is not None:
            packed.refresh(model)
    names = ("fp32_s", "fp16_s", "graph_s", "fp16_pack_s", "graph_pack_s", "bf16_s", "bf16_pack_s")
    best = dict.fromkeys(names, math.inf)
    for _ in range(rounds):
        start = time.perf_counter()
        graph.refresh(model)
        best["graph_pack_s"] = min(best["graph_pack_s"], time.perf_counter() - start)
        best["fp32_s"] = min(best["fp32_s"], _time_steps(lean, caches["lean"], ids, mask, _STEPS))
        best["graph_s"] = min(best["graph_s"], _time_steps(graph, caches["graph"], ids, mask, _STEPS))
        for kind, packed in copies.items():
            if packed is not None:
                start = time.perf_counter()
                step = LeanStep(packed.refresh(model, trainable_moved=True), scripted=True, fused_glue=glue)
                best[f"{kind}_pack_s"] = min(best[f"{kind}_pack_s"], time.perf_counter() - start)
                seconds = _time_steps(step, caches["lean"], ids, mask, _STEPS)
                best[f"{kind}_s"] = min(best[f"{kind}_s"], seconds)
    return best


def probe_graph_step(
    config: Mapping[str, Any],
    *,
    rounds: int = GRAPH_PROBE_ROUNDS,
    rows: int = GRAPH_PROBE_ROWS,
    context: int = GRAPH_PROBE_CONTEXT,
    bf16: bool | None = None,
) -> GraphProbe | None:
    """Time one decoder layer of ``config`` 's architecture three or four ways (module docstring; ``bf16``
    None: bf16 weights where :func:`bf16_measurable`), or None where the one-graph step does not take it.
    Each number is one layer's share: the probe model's step (or repack) with ``_LAYERS`` decoder layers
    less the one with a single layer, over the difference in layers, so what a step costs once whatever the
    depth (embedding, head, binding, Python) does not count as a layer's."""
    from rlkit.rollout.ort_step import ort_step_for

    bf16 = bf16_measurable() if bf16 is None else bf16
    times = {}
    for layers in (1, _LAYERS):
        model = _probe_model(config, layers)
        graph = ort_step_for(model) if model is not None else None
        if graph is None:
            return None
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                times[layers] = _time_paths(model, graph, rounds, rows, context, bf16)
        finally:
            torch.set_num_threads(previous)

    def share(name: str) -> float:
        one, more = times[1][name], times[_LAYERS][name]
        return max((more - one) / (_LAYERS - 1), 0.0) if math.isfinite(one) else math.inf

    layer = model.model.layers[0]
    params = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    return GraphProbe(**{name: share(name) for name in times[1]}, rows=rows, params=params)


def bf16_measurable() -> bool:
    """Whether the probe weighs bf16 weights here: the CPU has native bf16 and torch has oneDNN's packed
    linear."""
    from rlkit.hardware import cpu_info
    from rlkit.rollout.bf16_weights import bf16_weights_unavailable

    return bool(cpu_info().native_bf16) and bf16_weights_unavailable() is None


def cached_graph_probe(config: Mapping[str, Any], cpu, cache_path: Path | None = None, *, probe=None):
    """The graph probe of ``config`` 's architecture for this CPU and torch version from the cache, or
    measured now (``probe(config)``, default :func:`probe_graph_step`) and added to it; None where the
    one-graph step does not take the architecture (cached too, so no later run builds the probe models again
    to learn it)."""
    from rlkit.hardware.cpu import cached_entry

    keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    )
    # "fused": measured since the lean step runs as the decode runs it, its layers under TorchScript with the
    # compiled glue and attention kernel where they load, the fp16 copy's too (older entries timed the Python
    # loop, then the scripted one without the compiled operators)
    kind = "graph-decode-fused-" + "-".join(str(config.get(k)) for k in keys)

    def measured() -> dict[str, Any]:
        result = (probe or probe_graph_step)(config)
        return {"no_graph": 1} if result is None else asdict(result)

    return cached_entry(kind, cpu, measured, GraphProbe.from_entry, cache_path)


def graph_choice(
    probe: GraphProbe, max_new_tokens: int, *, margin: float, reduced: bool
) -> tuple[str, str, str]:
    """(decode dtype, decode linears, why in one line) for decodes of up to ``max_new_tokens`` tokens: the
    cheapest of ``F.linear`` (float32, torch), fbgemm fp16 weights (float16, torch), the one-graph step
    (float32, onnxruntime) and oneDNN-packed bf16 weights (bfloat16, torch), each ``margin × pack + tokens ×
    step`` in fp32 steps; the reduced-precision weights only where ``reduced`` (the recipe's decode dtype is
    ``auto``) and where the probe measured them (fp16: fbgemm; bf16: native bf16). A layer
    whose ``F.linear`` share read 0 (a tiny model on a busy machine: the 3-layer model stepped no slower than
    the 1-layer one) keeps ``F.linear``."""
    tokens = max_new_tokens
    if probe.fp32_s <= 0.0:  # two more layers did not step measurably slower: nothing to weigh
        return (
            "float32",
            "torch",
            (
                f"one decoder layer ({probe.params / 1e6:.1f} M parameters) is too small for its share of a "
                f"decode step to be timed (F.linear {probe.fp32_s * 1e3:.3f} ms) -> float32 with F.linear"
            ),
        )
    costs = {"float32 with F.linear": tokens * probe.fp32_s}
    if reduced and math.isfinite(probe.fp16_s):
        costs["float16 weights"] = margin * probe.fp16_pack_s + tokens * probe.fp16_s
    costs["float32 as one onnxruntime graph"] = margin * probe.graph_pack_s + tokens * probe.graph_s
    if reduced and math.isfinite(probe.bf16_s):
        costs["bfloat16 weights"] = margin * probe.bf16_pack_s + tokens * probe.bf16_s
    pick = min(costs, key=lambda name: costs[name])  # the first of equal costs: the simpler path
    bf16_pack = f", bf16 {probe.bf16_pack_s * 1e3:.0f} ms" if "bfloat16 weights" in costs else ""
    shown = ", ".join(f"{name} {cost / probe.fp32_s:.1f}" for name, cost in costs.items())
    why = (
        f"for {tokens} tokens the decode step of one decoder layer ({probe.params / 1e6:.1f} M parameters, "
        f"{probe.rows} rows; packing fp16 {probe.fp16_pack_s * 1e3:.0f} ms, graph "
        f"{probe.graph_pack_s * 1e3:.0f} ms{bf16_pack}) costs in fp32 steps: {shown} -> {pick}"
    )
    dtype, linears = {
        "float32 with F.linear": ("float32", "torch"),
        "float16 weights": ("float16", "torch"),
        "float32 as one onnxruntime graph": ("float32", "onnxruntime"),
        "bfloat16 weights": ("bfloat16", "torch"),
    }[pick]
    return dtype, linears, why


def model_choice(model, max_new_tokens: int, reduced: bool) -> tuple[str, str, str] | None:
    """:func:`graph_choice` for the run's policy ``model`` (its ``ModelConfig``) from its cached probe, with
    the per-linear probes' margin; None where onnxruntime is missing or the graph does not take the
    architecture (``rlkit.runtime.build`` passes it to the run's precision resolution)."""
    from transformers import AutoConfig

    from rlkit.hardware import cpu_info, onnxruntime_unavailable
    from rlkit.hardware.mlas import MLAS_PAYBACK_MARGIN
    from rlkit.model.load import resolve_model_path

    if onnxruntime_unavailable():
        return None
    config = AutoConfig.from_pretrained(
        resolve_model_path(model.path), trust_remote_code=model.trust_remote_code
    )
    probe = cached_graph_probe(config.to_dict(), cpu_info())
    return (
        None
        if probe is None
        else graph_choice(probe, max_new_tokens, margin=MLAS_PAYBACK_MARGIN, reduced=reduced)
    )
