"""A decode copy of the actor's module whose ``nn.Linear`` s hold packed weights, repacked only when they may
have moved: the machinery of ``rlkit.rollout.fp16_weights`` (fbgemm fp16), ``rlkit.rollout.mlas_weights``
(ONNX Runtime's MLAS fp32) and ``rlkit.rollout.bf16_weights`` (oneDNN bf16).

The copy (:class:`PackedDecodeCopy`) is a deep copy of the module whose linears are packed ones (a class with
``pack(linear, name)``) and whose other parameters (embeddings, norms, LoRA adapters) are copied at every
refresh. Packing is not free (docs/benchmarks.md), so a weight is repacked only when it may have moved:

- any weight written since its last packing (``load_state_dict`` and ``copy_`` bump the tensor's version
  counter), a LoRA run's frozen base included;
- every trainable weight when the caller says the trainable weights moved (``trainable_moved``): the fused
  AdamW step writes parameters without bumping their version, so the counter cannot tell. ``HFRollout`` says
  so once after each ``update_weights`` (the hybrid engine's sync after every update), so a full fine-tune
  repacks every weight once per step however many times the step generates (one call per turn in a
  multi-turn step), and a LoRA run's base is packed once.

**Sibling linears fused** (a copy with a ``fused_cls``): linears that read one input — a decoder layer's
``q_proj``/``k_proj``/``v_proj`` and its MLP's ``gate_proj``/``up_proj`` — are packed as one matrix, their
output rows stacked (:func:`sibling_groups`), so a decode step runs one GEMM (one cast in, one out) where it
ran three or two. Each sibling's place in the module holds a :class:`FusedMember`; the first member called
with an input runs the group's GEMM and keeps the split outputs for its siblings, which are handed theirs when
called with that same tensor object (the model's own forward and ``rlkit.rollout.lean_step`` pass one
``hidden_states`` to all of them). A member called with another tensor, or twice, runs the GEMM afresh, so a
model that calls its projections otherwise gets the right values, only slower.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlkit.errors import RlkitError

__all__ = [
    "FusedMember",
    "FusedOutputs",
    "PackedDecodeCopy",
    "PackedSiblings",
    "sibling_groups",
    "stacked_bias",
]

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # read one input in Llama-family layers


def _packable(name: str, module: nn.Module) -> bool:
    """Plain ``nn.Linear`` s, except a PEFT adapter's own (PEFT reads ``lora_A.weight.dtype``)."""
    return type(module) is nn.Linear and "lora_" not in name


def sibling_groups(source: nn.Module, names: list[str]) -> list[tuple[str, ...]]:
    """``names`` as packing units: each full set of ``SIBLINGS`` under one parent (same input width) one
    tuple, in the set's order; every other name a tuple of one. A LoRA-wrapped projection (``….base_layer``)
    is never grouped: its adapter reads the input on its own."""
    present = set(names)
    units: list[tuple[str, ...]] = []
    grouped: set[str] = set()
    for name in names:
        parent, _, _ = name.rpartition(".")
        for siblings in SIBLINGS:
            full = tuple(f"{parent}.{child}" if parent else child for child in siblings)
            if name == full[0] and all(n in present for n in full):
                widths = {source.get_submodule(n).in_features for n in full}
                if len(widths) == 1:
                    units.append(full)
                    grouped.update(full)
    return units + [(name,) for name in names if name not in grouped]


class FusedMember(nn.Module):
    """One sibling of a fused group (module docstring): ``y = x @ W_i.T (+ b_i)``, ``W_i`` this member's rows
    of the group's packed matrix; any leading shape ``[..., in] → [..., out_i]``."""

    def __init__(self, group: FusedOutputs, index: int, out_features: int):
        super().__init__()
        self.index, self.in_features, self.out_features = index, group.in_features, out_features
        self.group = group  # a plain object (not a submodule), shared by the group's members

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, member {self.index} of {self.group.extra_repr()}"


class FusedOutputs:
    """The base of a fused group (``fused_cls``): ``in_features``, ``splits`` (each member's
    ``out_features``) and :meth:`run` (``[..., in] → [..., sum(splits)]``, the one GEMM) from the subclass;
    keeps the last GEMM's input (the tensor object), its split outputs and which members took theirs."""

    in_features: int
    splits: list[int]

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.taken: set[int] = set()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.splits}"

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self.input or index in self.taken:
            self.input, self.taken = x, set()
            self.outputs = self.run(x).split(self.splits, dim=-1)
        self.taken.add(index)
        out = self.outputs[index]
        if len(self.taken) == len(self.splits):  # every member served: hold nothing between steps
            self.input, self.outputs, self.taken = None, (), set()
        return out


class PackedSiblings(FusedOutputs):
    """A fused group packed from its sibling linears (the packed copies' ``fused_cls``): ``in_features``,
    ``splits`` and ``names`` from them, the one matrix from the subclass's :meth:`pack` (called again at each
    refresh), ``packing`` naming the weights' format in its repr."""

    packing = ""

    def __init__(self, linears: list[nn.Linear], names: tuple[str, ...]):
        super().__init__()
        self.in_features = linears[0].in_features
        self.splits = [linear.out_features for linear in linears]
        self.names = names
        self.pack(linears, names)

    def pack(self, linears: list[nn.Linear], names: tuple[str, ...] = ()) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        members = "+".join(name.rpartition(".")[2] for name in self.names)
        return f"{members}: {super().extra_repr()}, weight={self.packing}"


def stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """Sibling linears' biases as one fp32 ``[sum(out_features)]`` in their order, zero where one of them has
    none; None where none has one."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat(
        [
            linear.bias.detach().float() if linear.bias is not None else torch.zeros(linear.out_features)
            for linear in linears
        ]
    )


def _pack_all(jobs: list[tuple[nn.Module | FusedOutputs, list[nn.Linear], tuple[str, ...]]]) -> None:
    """Pack each job's target from its linears, on as many threads as torch's intra-op count (the worker's
    ``threads_per_worker``): fbgemm (and MLAS) packs one matrix on one thread, and on a pool the packing
    runs partly in parallel (SmolLM2 on 2 threads: 0.72x the packing time, 0.84x the refresh;
    docs/benchmarks.md). The packed weights are the same either way."""

    def pack(target: nn.Module | FusedOutputs, linears: list[nn.Linear], names: tuple[str, ...]) -> None:
        if len(names) == 1:
            target.pack(linears[0], names[0])
        else:
            target.pack(linears, names)

    threads = min(torch.get_num_threads(), len(jobs))
    if threads <= 1:
        for job in jobs:
            pack(*job)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="rlkit-pack") as pool:
        for done in [pool.submit(pack, *job) for job in jobs]:
            done.result()  # a weight the packing refuses raises here, naming the linear


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


def _place(module: nn.Module, name: str, replacement: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, child, replacement)


class PackedDecodeCopy:
    """A copy of ``source`` for decoding whose ``nn.Linear`` s are ``linear_cls(linear, name)`` (a packed
    weight with a ``pack(linear, name)`` method: ``Fp16Linear``, ``MlasLinear``, ``Bf16Linear``) and, with a
    ``fused_cls`` (a :class:`FusedOutputs` built as ``fused_cls(linears, names)``, with
    ``pack(linears, names)``),
    whose sibling linears are fused (module docstring); :meth:`refresh` brings it to ``source`` 's current
    weights (repacking the trainable linears and the frozen ones written since). ``setting``: the recipe
    setting that asked for it, for errors."""

    def __init__(
        self,
        source: nn.Module,
        linear_cls: type[nn.Module],
        setting: str,
        fused_cls: type[FusedOutputs] | None = None,
    ):
        names = [name for name, m in source.named_modules() if _packable(name, m)]
        if not names:
            raise RlkitError(f"{setting}: the model has no nn.Linear to pack; decode in float32 instead.")
        self.units = sibling_groups(source, names) if fused_cls else [(name,) for name in names]
        self.module = copy.deepcopy(source, _skipped(source, names)).requires_grad_(False)
        self.targets: dict[tuple[str, ...], nn.Module | FusedOutputs] = {}
        self.packed_at: dict[tuple[str, ...], tuple[tuple[int, int], ...]] = {}
        for unit in self.units:
            linears = [source.get_submodule(name) for name in unit]
            if len(unit) == 1:
                target = linear_cls(linears[0], unit[0])
                _place(self.module, unit[0], target)
            else:
                target = fused_cls(linears, unit)
                for index, (name, linear) in enumerate(zip(unit, linears, strict=True)):
                    _place(self.module, name, FusedMember(target, index, linear.out_features))
            self.targets[unit] = target
            self.packed_at[unit] = tuple(_version(linear.weight) for linear in linears)
        self._repacked = self._built = len(names)  # the first refresh packs nothing more, reports these

    def refresh(self, source: nn.Module, *, trainable_moved: bool = True) -> nn.Module:
        """Repack the linears written since their packing and (``trainable_moved``) every trainable one, copy
        every other parameter and buffer; returns the copy."""
        fresh, self._repacked, self._built = self._built > 0, self._built, 0
        with torch.no_grad():
            todo = []
            for unit in self.units:
                linears = [source.get_submodule(name) for name in unit]
                now = tuple(_version(linear.weight) for linear in linears)
                moved = trainable_moved and any(linear.weight.requires_grad for linear in linears)
                if not fresh and (moved or now != self.packed_at[unit]):
                    todo.append((unit, linears, now))
            _pack_all([(self.targets[unit], linears, unit) for unit, linears, _ in todo])
            for unit, _, now in todo:
                self.packed_at[unit], self._repacked = now, self._repacked + len(unit)
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
