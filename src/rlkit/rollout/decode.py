"""The HF rollout's decode: prefill, the token loop, stop strings and the "every rank done" test.

``rlkit.rollout.hf.HFRollout.generate`` calls :func:`decode` with a :class:`DecodePlan` (its constructor
argument). ``DecodePlan()`` runs the fast loop below; ``DecodePlan(slab_cache=False)`` the plain loop
(transformers' ``DynamicCache``, every row forwarded to the end), also taken for a model whose cache the slab
does not fit. With ``lean_step=False`` both give the same tokens and log-probs under one seed
(``tests/unit/rollout/test_decode.py``); the lean step agrees to float rounding:

- **Slab cache** (:class:`SlabCache`): each layer's keys/values live in one buffer ``[B, H, P + T, D]``
  allocated at the prefill; a step writes its token's K/V in place and attention reads a view of the
  filled prefix. ``DynamicCache`` instead concatenates, copying the whole cache every step (its bytes grow
  with the completion and, at 16 rows × 256 tokens of SmolLM2, rival the weights). transformers'
  ``StaticCache`` pre-allocates too but attends over its full length every step (fixed shapes for
  ``torch.compile``), reading the unfilled tail as well.
- **Row dropping**: once an eighth of the rows still in the batch have finished (eos, stop string), the
  batch is compacted to the live rows (cache, mask, positions): a finished row costs a full forward per
  step (2 · params FLOPs) until the loop ends. The random draws stay those of the full batch (one per
  row, finished or not), so a row samples the same tokens whichever rows run beside it. An FSDP-sharded
  module must run the same number of forwards on every rank: a rank whose rows are all done keeps one
  (finished) row forwarding until every rank is done (:meth:`Decoding.all_done`).
- **Shared prefill** (``DecodePlan.share_prefill``): a group's identical prompts run one prefill whose KV
  cache is copied to every row.
- **Lean step** (``DecodePlan.lean_step``, ``rlkit.rollout.lean_step``): after the prefill, a Llama-family
  plain module decodes each token through its own modules without transformers' forward plumbing (a
  whole generate 0.87-0.95× as long), its layers as one TorchScript function where they fit
  (``DecodePlan.scripted_layers``, ``rlkit.rollout.scripted_step``); other models through their forward.
  ``rollout.backend.linears: onnxruntime`` replaces it with one ONNX Runtime graph per step
  (``rlkit.rollout.ort_step``, the ``graph_step`` argument of :func:`decode`) over the same cache.
- **bf16 K/V** (``DecodePlan.bf16_kv_from``, ``rlkit.rollout.bf16_kv``): the lean step over the bf16 decode
  copy keeps a long decode's K/V in bf16 (half the bytes attention reads at every step), where this CPU's
  attention probe finds that faster (``DecodePlan.bf16_kv_probe``).
- **Sampling** (``rlkit.rollout.sampling.sample_next``): no copy of the ``[B, V]`` logits unless top-k/top-p
  truncates them, no division at temperature 1, top-k without a sort of the vocabulary; a greedy or
  untruncated draw by the compiled ``rlkit::sample_rows`` (``DecodePlan.fused_sampling``: two reads of each
  row of the logits, bf16 ones read as they are), in both loops.

Shapes: ``B`` rows (prompts × n), ``P`` prompt width, ``T`` response width, ``V`` vocabulary, ``H`` KV
heads, ``D`` head size, ``A`` rows still in the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from rlkit.errors import RlkitError
from rlkit.model.kv_cache import cache_argument, output_cache
from rlkit.rollout.attention_kernel import kernel_fits, kernel_pays, padded_capacity
from rlkit.rollout.bf16_kv import BF16_KV_MIN_POSITIONS, bf16_kv_cache_fits, bf16_kv_pays
from rlkit.rollout.cpu_kernels import kernel_unavailable
from rlkit.rollout.lean_step import lean_step_for
from rlkit.rollout.sampling import kernel_draws, sample_next
from rlkit.rollout.shared_prompt import SharedPrompt

__all__ = ["DecodePlan", "Decoded", "Decoding", "SlabCache", "SlabLayer", "decode", "slab_layers"]

_COMPACT_FRACTION = 8  # compact once 1/8 of the rows in the batch have finished


class SlabLayer(DynamicLayer):
    """One layer's keys and values in a zeroed buffer allocated once, ``[B, H, capacity, D]``; ``update``
    writes the new positions in place and returns views ``[B, H, length, D]`` of the filled prefix.
    ``dtype``: the buffer's (None: the first states'; ``rlkit.rollout.bf16_kv``: bf16 under fp32 states).
    ``transposed_keys``: the keys also as ``key_slab_t [B, H, D, capacity']`` (position fastest, capacity
    rounded up: ``rlkit.rollout.attention_kernel``), written with them."""

    key_slab_t: torch.Tensor | None = None

    def __init__(self, capacity: int, dtype: torch.dtype | None = None, transposed_keys: bool = False):
        super().__init__()
        self.capacity, self.slab_dtype, self.transposed_keys = capacity, dtype, transposed_keys
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.slab_dtype or key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        # zeros, not garbage, past the filled prefix: the ONNX Runtime step (rlkit.rollout.ort_step) reads the
        # whole buffer under a mask, and a NaN there would survive a zero attention weight
        self.key_slab = key_states.new_zeros(b, h, self.capacity, d, dtype=self.dtype)
        self.value_slab = value_states.new_zeros(
            b, value_states.shape[1], self.capacity, value_states.shape[-1], dtype=self.dtype
        )
        if self.transposed_keys:  # not zeroed: the kernel reads no position past the filled ones unmasked
            self.key_slab_t = key_states.new_empty(b, h, d, padded_capacity(self.capacity), dtype=self.dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states/value_states [B, H, q, D]`` at positions ``length .. length + q``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self.advance(end)
        self.key_slab[:, :, start:end].copy_(key_states)
        self.value_slab[:, :, start:end].copy_(value_states)
        if self.key_slab_t is not None:
            self.key_slab_t[..., start:end].copy_(key_states.transpose(-1, -2))
        # the prefill attends over its own (contiguous, unrounded) states, as with DynamicCache
        if start == 0:
            return key_states, value_states
        return self.keys, self.values

    def advance(self, end: int) -> None:
        """Count positions ``0 .. end`` as filled (``keys``/``values`` their views), before they are written
        (here, or by ``rlkit.rollout.scripted_step``'s loop); an error where they do not fit."""
        if end > self.capacity:
            raise RlkitError(
                f"rollout decode: the KV cache holds {self.capacity} positions, a step needs {end}; "
                "this is a bug in rlkit.rollout.decode (the cache is sized prompt + max_new_tokens)."
            )
        self.length = end
        self.keys, self.values = self.key_slab[:, :, :end], self.value_slab[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (or repeat) rows ``indices [A]``: new buffers of ``A`` rows, filled prefix copied."""
        if not self.is_initialized:
            return
        for name in ("key_slab", "value_slab"):
            slab = getattr(self, name)
            new = slab.new_zeros(len(indices), *slab.shape[1:])
            new[:, :, : self.length] = slab[indices, :, : self.length]
            setattr(self, name, new)
        if self.key_slab_t is not None:
            new = self.key_slab_t.new_empty(len(indices), *self.key_slab_t.shape[1:])
            new[..., : self.length] = self.key_slab_t[indices, ..., : self.length]
            self.key_slab_t = new
        self.keys, self.values = self.key_slab[:, :, : self.length], self.value_slab[:, :, : self.length]


class SlabCache(Cache):
    """A ``Cache`` of :class:`SlabLayer`, one per decoder layer, each ``capacity`` positions long (``dtype``:
    theirs, None: the model's states'; ``transposed_keys``: each also keeps its keys transposed, for
    ``rlkit.rollout.attention_kernel``); ``shared_prompt``: the prompts' own K/V while the rows are the
    prompts' groups in order (``rlkit.rollout.shared_prompt``), else None."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        dtype: torch.dtype | None = None,
        transposed_keys: bool = False,
    ):
        super().__init__(layers=[SlabLayer(capacity, dtype, transposed_keys) for _ in range(num_layers)])
        self.shared_prompt: SharedPrompt | None = None

    def repeat_rows(self, inverse: torch.Tensor, keep_prompts: bool) -> None:
        """Copy prompt ``inverse[r]``'s cache to row ``r`` (``inverse [A]``); ``keep_prompts``: keep the
        prompts' own K/V as ``shared_prompt`` where the rows allow (``SharedPrompt.of``)."""
        keys = [layer.key_slab[:, :, : layer.length] for layer in self.layers]
        values = [layer.value_slab[:, :, : layer.length] for layer in self.layers]
        self.batch_select_indices(inverse)
        self.shared_prompt = SharedPrompt.of(inverse, keys, values) if keep_prompts else None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.shared_prompt = None  # rows kept or repeated: the groups no longer line up
        super().batch_select_indices(indices)


def slab_layers(module: nn.Module) -> int | None:
    """How many layers a :class:`SlabCache` for ``module`` needs, or None where it does not fit: the model's
    own cache would not be plain full-attention ``DynamicLayer`` s (sliding windows, shared or linear
    layers)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config transformers cannot type: use the model's own cache
        return None
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return len(layers)


@dataclass(frozen=True)
class DecodePlan:
    """Which decode path ``HFRollout`` runs. Every choice gives the same tokens and log-probs under one seed
    (the lean step: to float rounding); tests and benchmarks pass the alternatives to compare them."""

    slab_cache: bool = True  # the fast loop (slab KV cache, finished rows dropped); False: the plain loop
    share_prefill: bool = True  # one prefill per distinct prompt, its cache copied to the group's rows
    lean_step: bool = True  # fast loop, Llama-family plain module: tokens after the prefill by LeanStep
    share_prompt_attention: bool = True  # lean step: a group's prompt K/V read once per step for its rows
    scripted_layers: bool = True  # lean step: its layers as one TorchScript function (rollout.scripted_step)
    # lean step over the bf16 decode copy: bf16 K/V where a step attends over at least this many positions on
    # average (prompt width + max_new_tokens / 2; rollout.bf16_kv); None: fp32 K/V always
    bf16_kv_from: int | None = BF16_KV_MIN_POSITIONS
    # ... and only where this CPU's attention probe finds bf16 K/V faster (rollout.bf16_kv.bf16_kv_pays),
    # timed with the attention that will read them (the compiled kernel where it attends, else SDPA);
    # False: without asking it (tests and benchmarks that compare the two caches on any CPU)
    bf16_kv_probe: bool = True
    # lean step over fp32 or bf16 K/V: attention by the compiled kernel (rollout.attention_kernel) where it
    # builds on this machine, fits the model's heads and its probe finds it faster than SDPA; False: SDPA
    attention_kernel: bool = True
    # False: the kernel wherever it builds and fits, without asking the probe (tests and benchmarks)
    attention_kernel_probe: bool = True
    # scripted layers: the work between the GEMMs by the compiled glue operators where they build on this
    # machine (rollout.scripted_step.fused_layer_loop); False: torch's operators
    fused_glue: bool = True
    # both loops, CPU logits: a greedy or untruncated draw by the compiled rlkit::sample_rows where it builds
    # on this machine (rollout.sampling.sample_next's ``fused``); False: torch's operators
    fused_sampling: bool = True


@dataclass(frozen=True)
class Decoded:
    """What :func:`decode` ran. ``path``: ``"plain"`` (the model's own cache), ``"slab"`` (the fast loop
    through the model's forward), ``"lean"`` (the fast loop, tokens after the prefill by the lean step),
    ``"scripted"`` (the same, its layers under TorchScript) or ``"graph"`` (by the graph step);
    ``bf16_kv``: the slab cache held bf16 K/V (``rlkit.rollout.bf16_kv``); ``attention_kernel``: a lean
    step attended with the compiled kernel (``rlkit.rollout.attention_kernel``); ``fused_glue``: its scripted
    layers ran with the compiled glue operators (``rlkit.rollout.scripted_step.fused_layer_loop``);
    ``fused_sampling``: the tokens were drawn by the compiled ``rlkit::sample_rows``."""

    path: str
    bf16_kv: bool = False
    attention_kernel: bool = False
    fused_glue: bool = False
    fused_sampling: bool = False


@dataclass
class Decoding:
    """What one ``generate`` call decodes with, besides the model: tokens that end a row, the pad token, the
    random generator, the stop strings and whether the module is a collective (FSDP-sharded over ranks)."""

    tokenizer: object
    eos_token_ids: torch.Tensor  # [E]
    pad_token_id: int
    generator: torch.Generator
    sampling: dict  # sample_next's temperature, top_p, top_k, do_sample
    stop: list[str]
    ignore_eos: bool
    collective: bool
    plan: DecodePlan

    def all_done(self, finished: torch.Tensor) -> bool:
        """Every row of every rank finished (an FSDP-sharded module forwards on all ranks or none)."""
        done = torch.tensor([int(bool(finished.all()))], device=finished.device)
        if self.collective:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def ended(self, tokens: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Live rows whose sampled token ``tokens [A]`` ends them (eos)."""
        if self.ignore_eos:
            return torch.zeros_like(live)
        return live & torch.isin(tokens, self.eos_token_ids)

    def hits_stop(self, responses: torch.Tensor, step: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows (among ``rows [B]`` bool) whose response text now contains a stop string."""
        hit = torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
        window = 4 * max(len(s) for s in self.stop) + 4  # tokens enough to hold any stop string
        lo = max(0, step + 1 - window)
        for r in rows.nonzero().flatten().tolist():
            text = self.tokenizer.decode(responses[r, lo : step + 1].tolist(), skip_special_tokens=False)
            hit[r] = any(s in text for s in self.stop)
        return hit

    def prefill(
        self, module: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache=None
    ):
        """Forward the prompts ``[B, P]`` once each (``plan.share_prefill``: a group's identical rows share
        one prefill whose KV cache is then copied to every row); the head runs on the last position only.
        ``cache``: the ``transformers`` Cache to fill (None: the model's own ``DynamicCache``). Returns the
        model output (its cache covers all B rows) and the next-token logits [B, V]."""
        rows = torch.cat([ids, mask], dim=1)  # identical prompt = identical ids and mask
        unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
        share = self.plan.share_prefill and len(unique) < len(rows)
        if share:
            first = torch.full(
                (len(unique),), len(rows), dtype=torch.long, device=rows.device
            ).scatter_reduce_(
                0, inverse, torch.arange(len(rows), device=rows.device), reduce="amin"
            )  # one representative row per prompt
            ids, mask, pos = ids[first], mask[first], pos[first]
        # the last position as an index tensor, not ``logits_to_keep=1``: HF slices ``hidden[:, -1:, :]``
        # for an int, a strided view on which the head's linear took 0.9 s in bf16 for SmolLM2 (a bmm over
        # the weight copied per row; 9 ms on a contiguous input, docs/benchmarks.md); an index gathers a
        # contiguous [B, 1, H]
        keep = (
            {"logits_to_keep": torch.tensor([ids.shape[1] - 1], device=ids.device)}
            if "logits_to_keep" in inspect.signature(type(module).forward).parameters
            else {}
        )
        out = module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **cache_argument(module, cache),
            **keep,
        )
        logits = out.logits[:, -1]
        if share:
            cache = output_cache(out)
            if isinstance(cache, SlabCache):
                cache.repeat_rows(inverse, keep_prompts=self.plan.share_prompt_attention)
            else:
                cache.batch_select_indices(inverse)
            logits = logits[inverse]
        return out, logits


def decode(
    run: Decoding,
    module: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    responses: torch.Tensor,
    log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    graph_step: Callable | None = None,
) -> Decoded:
    """Prefill ``prompt_ids/prompt_mask [B, P]`` and sample up to ``T`` tokens per row into ``responses``,
    ``log_probs`` and ``response_mask [B, T]`` (filled in place), by the path ``run.plan`` names.
    ``graph_step``: a step with the lean step's contract that replaces it (``rlkit.rollout.ort_step``), where
    the plan takes the lean step. Returns the path taken (:class:`Decoded`)."""
    weight = next(module.parameters(), None)
    on_cpu = weight is not None and weight.device.type == "cpu"  # the compiled operators are CPU code
    fused = (  # the draws by rlkit::sample_rows (rollout.sampling.sample_next)
        run.plan.fused_sampling and on_cpu and kernel_draws(**run.sampling) and kernel_unavailable() is None
    )
    layers = slab_layers(module) if run.plan.slab_cache else None
    if layers is None:
        _decode_plain(run, module, prompt_ids, prompt_mask, responses, log_probs, response_mask, fused)
        return Decoded("plain", fused_sampling=fused)
    lean = None
    if run.plan.lean_step:
        fused_glue = run.plan.scripted_layers and run.plan.fused_glue and on_cpu
        lean = lean_step_for(
            module,
            scripted=run.plan.scripted_layers,
            fused_glue=fused_glue and kernel_unavailable() is None,
        )
    if lean is not None and graph_step is not None:
        lean = graph_step
    width, max_new, start = prompt_ids.shape[1], responses.shape[1], run.plan.bf16_kv_from
    kernel = (
        lean is not None
        and lean is not graph_step
        and run.plan.attention_kernel
        and kernel_fits(lean)
        and kernel_unavailable() is None
        and (not run.plan.attention_kernel_probe or kernel_pays(lean.heads, lean.kv_heads, lean.dim))
    )
    bf16_kv = (  # asked of the attention that will read them: the kernel's over each, or SDPA's
        lean is not None
        and lean is not graph_step
        and start is not None
        and width + max_new / 2 >= start
        and bf16_kv_cache_fits(lean)
        and (not run.plan.bf16_kv_probe or bf16_kv_pays(lean.heads, lean.kv_heads, lean.dim, kernel))
    )
    cache = SlabCache(layers, width + max_new, torch.bfloat16 if bf16_kv else None, transposed_keys=kernel)
    _decode_slab(
        run, module, prompt_ids, prompt_mask, responses, log_probs, response_mask, cache, lean, fused
    )
    if lean is None:
        return Decoded("slab", fused_sampling=fused)
    if lean is graph_step:
        return Decoded("graph", fused_sampling=fused)
    path = "scripted" if getattr(lean, "scripted", None) is not None else "lean"
    return Decoded(  # a stand-in step (benchmarks' spikes) may lack the counts
        path, bf16_kv, getattr(lean, "kernel_steps", 0) > 0, getattr(lean, "fused_steps", 0) > 0, fused
    )


def _record(run: Decoding, responses, log_probs, response_mask, rows, step, tokens, lp, live) -> None:
    responses[rows, step] = torch.where(live, tokens, run.pad_token_id)
    log_probs[rows, step] = torch.where(live, lp, 0.0)
    response_mask[rows, step] = live.long()


def _rows_to_keep(finished: torch.Tensor) -> torch.Tensor | None:
    """Which of the loop's rows to keep forwarding (indices into them), given which have ended (``finished``
    [A], bool): None while fewer than ``1 / _COMPACT_FRACTION`` of them have (compacting the cache costs a
    copy); never empty: where every row here is done but other ranks' are not, one row keeps forwarding."""
    keep = ~finished  # [A]
    dropped = len(keep) - int(keep.sum())
    if dropped < max(1, len(keep) // _COMPACT_FRACTION):
        return None
    if not keep.any():
        keep[0] = True
    return keep.nonzero().flatten()


def _decode_slab(
    run: Decoding,
    module: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cache: SlabCache,
    lean: Callable | None,
    fused: bool,
) -> None:
    """The fast loop: ``cache`` (empty, prompt width + ``T`` positions long), finished rows dropped, the full
    batch's random draws; ``lean``: the step that decodes every token after the prefill (None: the model's
    forward); ``fused``: ``sample_next``'s (the compiled draw)."""
    b, width = prompt_ids.shape
    max_new = responses.shape[1]
    device = prompt_ids.device
    # [B, P+T]
    mask = torch.cat([prompt_mask, torch.ones((b, max_new), dtype=prompt_mask.dtype, device=device)], 1)
    pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    _, logits = run.prefill(module, prompt_ids, prompt_mask, pos, cache=cache)  # [B, V]
    last_pos = pos[:, -1]  # [A]
    rows = torch.arange(b, device=device)  # [A]: each batch row's index among the B rows
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    draw = run.sampling["do_sample"] and run.sampling["temperature"] != 0
    for step in range(max_new):
        uniform = None
        if draw:  # one draw per row of the full batch, as the plain loop draws
            uniform = torch.rand(b, 1, generator=run.generator, dtype=torch.float64, device=device)[rows]
        tokens, lp = sample_next(
            logits, generator=run.generator, uniform=uniform, fused=fused, **run.sampling
        )
        live = ~finished[rows]
        _record(run, responses, log_probs, response_mask, rows, step, tokens, lp, live)
        ended = run.ended(tokens, live)
        if run.stop:
            candidates = torch.zeros(b, dtype=torch.bool, device=device)
            candidates[rows] = live & ~ended
            ended |= run.hits_stop(responses, step, candidates)[rows]
        finished[rows] |= ended
        if step + 1 == max_new or run.all_done(finished):
            break
        index = _rows_to_keep(finished[rows])
        if index is not None:
            cache.batch_select_indices(index)
            rows, last_pos = rows[index], last_pos[index]
        last_pos = last_pos + 1
        length = width + step + 1
        if lean is not None:
            logits = lean(cache, responses[rows, step : step + 1], last_pos, mask[rows, :length])
            continue
        out = module(
            input_ids=responses[rows, step : step + 1],
            attention_mask=mask[rows, :length],
            position_ids=last_pos[:, None],
            use_cache=True,
            **cache_argument(module, cache),
        )
        logits = out.logits[:, -1]


def _decode_plain(
    run: Decoding,
    module: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    fused: bool,
) -> None:
    """The reference loop: the model's ``DynamicCache``, every row forwarded until all are done; ``fused``:
    ``sample_next``'s (the compiled draw)."""
    b, max_new = responses.shape
    finished = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    rows = torch.arange(b, device=prompt_ids.device)
    mask = prompt_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out, logits = run.prefill(module, prompt_ids, mask, pos)  # logits [B, V]
    last_pos = pos[:, -1]
    for step in range(max_new):
        tokens, lp = sample_next(logits, generator=run.generator, fused=fused, **run.sampling)
        live = ~finished
        _record(run, responses, log_probs, response_mask, rows, step, tokens, lp, live)
        ended = run.ended(tokens, live)
        if run.stop:
            ended |= run.hits_stop(responses, step, live & ~ended)
        finished |= ended
        if step + 1 == max_new or run.all_done(finished):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last_pos = last_pos + 1
        out = module(
            input_ids=responses[:, step : step + 1],
            attention_mask=mask,
            position_ids=last_pos[:, None],
            use_cache=True,
            **cache_argument(module, output_cache(out)),
        )
        logits = out.logits[:, -1]
