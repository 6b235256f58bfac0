"""The batch that flows through the RL step (veRL's DataProto, small and typed).

A ``Batch`` has three parts that share one batch dimension ``N``:

- ``tensors``: a ``tensordict.TensorDict`` with ``batch_size=[N]`` (``input_ids [N, L]``,
  ``response_mask [N, T]``, ``advantages [N, T]`` ...);
- ``non_tensors``: per-sample Python values as object arrays of length ``N`` (``data_source``,
  ``reward_model``, ``uid`` ...);
- ``meta``: batch-level values (``temperature``, ``global_token_num`` ...), not split or repeated.

Every operation returns a new Batch; the consistency check runs whenever one is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlkit.errors import BatchError

__all__ = ["Batch"]

Index = int | slice | Sequence[int] | torch.Tensor | np.ndarray


def _object_array(values: Iterable[Any]) -> np.ndarray:
    values = list(values)
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def _to_array(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    if (
        not isinstance(t, torch.Tensor)
        or t.device.type != "cpu"
        or t.requires_grad
        or t.layout != torch.strided
    ):
        return t
    try:
        return t.contiguous().numpy()
    except (TypeError, RuntimeError):  # a dtype numpy has not (bf16, float8), a conjugate-bit view
        return t


def _from_pickle(fields: dict, non_tensors: dict, meta: dict, n: int) -> Batch:
    """The Batch ``Batch.__reduce__`` pickled. Arrays on a read-only buffer (Ray's) are copied: torch
    tensors must be writable."""
    tensors = {
        k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v if v.flags.writeable else v.copy())
        for k, v in fields.items()
    }
    batch = Batch.__new__(Batch)
    batch.non_tensors, batch.meta = non_tensors, meta
    batch.tensors = TensorDict(tensors, batch_size=[n])
    return batch


class Batch:
    """Tensors, per-sample fields and meta info sharing one batch dimension."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
    ):
        tensors = tensors if tensors is not None else {}
        self.non_tensors: dict[str, np.ndarray] = {
            k: v if isinstance(v, np.ndarray) and v.dtype == object else _object_array(v)
            for k, v in (non_tensors or {}).items()
        }
        if isinstance(tensors, TensorDict):
            self.tensors = tensors
        else:
            self.tensors = self._build_tensordict(dict(tensors))
        self.meta: dict[str, Any] = dict(meta or {})
        self._check()

    def _build_tensordict(self, tensors: dict[str, torch.Tensor]) -> TensorDict:
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise BatchError(
                    f"tensor field '{key}' is a {type(value).__name__}; put non-tensor values in non_tensors."
                )
            if value.dim() == 0:
                raise BatchError(
                    f"tensor field '{key}' is a scalar; batch fields need a leading batch dimension "
                    "(put scalars in meta)."
                )
        sizes = {k: v.shape[0] for k, v in tensors.items()}
        if len(set(sizes.values())) > 1:
            raise BatchError(f"tensor fields disagree on the batch size: {sizes}.")
        n = next(iter(sizes.values())) if sizes else self._non_tensor_len()
        return TensorDict(tensors, batch_size=[n])

    def _non_tensor_len(self) -> int:
        lengths = {len(v) for v in self.non_tensors.values()}
        return lengths.pop() if len(lengths) == 1 else 0

    def _check(self) -> None:
        if self.tensors.batch_dims != 1:
            raise BatchError(
                "tensors must have exactly one batch dimension, got "
                f"batch_size={list(self.tensors.batch_size)}."
            )
        n = len(self)
        bad = {k: len(v) for k, v in self.non_tensors.items() if len(v) != n or v.ndim != 1}
        if bad:
            raise BatchError(f"non-tensor fields {bad} do not match the batch size {n} (from the tensors).")

    # ----- basic access -------------------------------------------------------------------------
    def __len__(self) -> int:
        if self.tensors.batch_size[0] == 0 and not self.tensors.keys() and self.non_tensors:
            return self._non_tensor_len()
        return int(self.tensors.batch_size[0])

    def keys(self) -> list[str]:
        return list(self.tensors.keys()) + list(self.non_tensors.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def __getitem__(self, item: str | Index) -> Any:
        if isinstance(item, str):
            if item in self.tensors.keys():
                return self.tensors[item]
            if item in self.non_tensors:
                return self.non_tensors[item]
            raise KeyError(
                f"batch has no field '{item}'. Fields: {', '.join(sorted(self.keys())) or '(none)'}."
            )
        return self._index(item)

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != len(self):
                raise BatchError(
                    f"field '{key}' has shape {tuple(value.shape)}; the batch size is {len(self)}."
                )
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            arr = value if isinstance(value, np.ndarray) and value.dtype == object else _object_array(value)
            if len(arr) != len(self):
                raise BatchError(f"field '{key}' has {len(arr)} values; the batch size is {len(self)}.")
            if key in self.tensors.keys():
                del self.tensors[key]
            self.non_tensors[key] = arr

    def __reduce__(self):
        """Pickled (Ray's role calls) with its host tensors as numpy arrays, which pickle protocol 5 hands
        over as raw buffers: a fraction of torch's own tensor pickling (docs/benchmarks.md, "Role calls
        pickle a batch's tensors as arrays"). A tensor numpy cannot hold (bf16, on another device,
        requiring grad) pickles as a torch tensor."""
        fields = {k: _to_array(v) for k, v in self.tensors.items()}
        return _from_pickle, (fields, self.non_tensors, self.meta, len(self))

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return (
            f"Batch(n={len(self)}, tensors={shapes}, non_tensors={sorted(self.non_tensors)}, "
            f"meta={sorted(self.meta)})"
        )

    # ----- selection --------------------------------------------------------------------------
    def _index(self, item: Index) -> Batch:
        n = len(self)
        if isinstance(item, int):
            if not -n <= item < n:
                raise BatchError(f"index {item} out of range for a batch of {n}.")
            item = [item % n]
        if isinstance(item, slice):
            idx = torch.arange(n)[item]
        else:
            idx = torch.as_tensor(np.asarray(item) if not isinstance(item, torch.Tensor) else item)
            if idx.dtype == torch.bool:
                if idx.shape != (n,):
                    raise BatchError(f"a boolean mask must have shape ({n},), got {tuple(idx.shape)}.")
                idx = idx.nonzero().flatten()
            idx = idx.long().flatten()
            if idx.numel() and (idx.max() >= n or idx.min() < -n):
                raise BatchError(f"index {idx.tolist()} out of range for a batch of {n}.")
        np_idx = idx.numpy()
        return Batch(
            self.tensors[idx],
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            self.meta,
        )

    def select(self, keys: Iterable[str], meta_keys: Iterable[str] | None = None) -> Batch:
        """A new batch with only ``keys`` (tensor or non-tensor); meta kept unless narrowed."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise BatchError(f"cannot select missing field(s) {missing}. Fields: {sorted(self.keys())}.")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        meta = self.meta if meta_keys is None else {k: self.meta[k] for k in meta_keys}
        return Batch(
            self.tensors.select(*tensor_keys),
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            meta,
        )

    def pop(self, keys: Iterable[str]) -> Batch:
        """Remove ``keys`` from this batch and return them as a new batch (meta is shared)."""
        popped = self.select(keys)
        for key in popped.keys():
            if key in self.tensors.keys():
                del self.tensors[key]
            else:
                del self.non_tensors[key]
        return popped

    def union(self, other: Batch) -> Batch:
        """Fields of both; a key in both must hold equal values, otherwise ``BatchError``."""
        if len(self) != len(other):
            raise BatchError(f"cannot union batches of {len(self)} and {len(other)} samples.")
        tensors = self.tensors.clone(recurse=False)
        for key, value in other.tensors.items():
            if key in tensors.keys() and not torch.equal(tensors[key], value):
                raise BatchError(f"union: tensor field '{key}' differs between the two batches.")
            tensors[key] = value
        non_tensors = dict(self.non_tensors)
        for key, value in other.non_tensors.items():
            if key in non_tensors and not np.array_equal(non_tensors[key], value):
                raise BatchError(f"union: non-tensor field '{key}' differs between the two batches.")
            non_tensors[key] = value
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and meta[key] != value:
                raise BatchError(
                    f"union: meta '{key}' differs between the two batches ({meta[key]!r} vs {value!r})."
                )
            meta[key] = value
        return Batch(tensors, non_tensors, meta)

    # ----- reshaping --------------------------------------------------------------------------
    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along the batch dimension; all must have the same fields and per-sample shapes (a
        width mismatch is a ``BatchError`` naming the field). Meta from the first."""
        if not batches:
            raise BatchError("concat needs at least one batch.")
        keys = sorted(batches[0].keys())
        for i, b in enumerate(batches[1:], start=1):
            if sorted(b.keys()) != keys:
                raise BatchError(f"concat: batch {i} has fields {sorted(b.keys())}, batch 0 has {keys}.")
        for key in batches[0].tensors.keys():
            shapes = [tuple(b.tensors[key].shape[1:]) for b in batches]
            if len(set(shapes)) > 1:
                raise BatchError(
                    f"concat: field '{key}' has per-sample shapes {shapes} in batches 0..{len(batches) - 1}; "
                    "pad them to one width first (rollout batches: rlkit.rollout.base.concat_rollouts pads "
                    "prompts on the left and responses on the right)."
                )
        tensors = torch.cat([b.tensors for b in batches]) if batches[0].tensors.keys() else None
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors, batches[0].meta)

    def split(self, sizes: int | Sequence[int]) -> list[Batch]:
        """Pieces of ``sizes`` samples each (an int: equal pieces, the last may be shorter)."""
        n = len(self)
        if isinstance(sizes, int):
            if sizes <= 0:
                raise BatchError(f"split size must be positive, got {sizes}.")
            sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
        if sum(sizes) != n:
            raise BatchError(f"split sizes {list(sizes)} sum to {sum(sizes)}, the batch has {n}.")
        out, start = [], 0
        for size in sizes:
            out.append(self[start : start + size])
            start += size
        return out

    def chunk(self, chunks: int) -> list[Batch]:
        """``chunks`` equal pieces; the batch size must divide evenly (as across ranks)."""
        if chunks <= 0 or len(self) % chunks:
            raise BatchError(f"cannot chunk a batch of {len(self)} into {chunks} equal parts.")
        return self.split(len(self) // chunks)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every sample ``n`` times: ``[a, a, b, b]`` (interleave) or ``[a, b, a, b]``."""
        if n < 1:
            raise BatchError(f"repeat count must be >= 1, got {n}.")
        idx = torch.arange(len(self))
        idx = idx.repeat_interleave(n) if interleave else idx.repeat(n)
        return self[idx]

    def reorder(self, order: Sequence[int] | torch.Tensor) -> Batch:
        """Samples in the given order, which must be a permutation of ``range(len(self))``."""
        order_t = torch.as_tensor(order).long()
        if sorted(order_t.tolist()) != list(range(len(self))):
            raise BatchError(f"reorder needs a permutation of 0..{len(self) - 1}, got {order_t.tolist()}.")
        return self[order_t]

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.tensors.to(device), self.non_tensors, self.meta)
