"""State files without pickled code: what a checkpoint's ``.pt`` files hold besides model shards (optimizer
extras, RNG states, dataloader position, batches generated ahead), saved as tensors and plain values and read
with ``torch.load(weights_only=True)``, so loading a checkpoint from elsewhere never runs code from it.

    torch.save(to_plain(state, "trainer_state"), path)   # numpy arrays and Batches as tagged plain values
    state = load_state_file(path)                        # refuses a pickled object, naming the file
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError

__all__ = ["CheckpointError", "CheckpointMismatchError", "from_plain", "load_state_file", "to_plain"]


class CheckpointError(RlkitError):
    """A checkpoint could not be written or read."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint was written by another model: a tensor's shape differs from the model being resumed."""


_NDARRAY, _NPSCALAR, _BATCH = "__rlkit_ndarray__", "__rlkit_npscalar__", "__rlkit_batch__"


def to_plain(value: Any, where: str = "state") -> Any:
    """``value`` with numpy arrays / scalars and ``Batch`` objects as tagged dicts of plain values and
    tensors, which ``torch.load(weights_only=True)`` reads. Anything else that is not a tensor or a plain
    Python value raises ``CheckpointError`` naming its place (``where``): it would not load back."""
    import numpy as np
    import torch

    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, torch.Tensor, torch.Size, torch.dtype)
    ):
        return value
    if isinstance(value, np.ndarray):
        items = value.tolist()
        if value.dtype == object:
            items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(items)]
        return {_NDARRAY: items, "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return {_NPSCALAR: value.item(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: to_plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    from rlkit.batch import Batch

    if isinstance(value, Batch):
        fields = {k: to_plain(v, f"{where}.{k}") for k, v in value.non_tensors.items()}
        return {
            _BATCH: {
                "tensors": dict(value.tensors.items()),
                "non_tensors": fields,
                "meta": to_plain(value.meta, f"{where}.meta"),
            }
        }
    raise CheckpointError(
        f"cannot save {where} in a checkpoint: a {type(value).__name__} is not a tensor or plain Python "
        f"value, so torch.load(weights_only=True) would refuse it. Convert it to plain values (or tensors) "
        f"in its state_dict()."
    )


def from_plain(value: Any) -> Any:
    """Inverse of ``to_plain``."""
    import numpy as np

    if isinstance(value, dict):
        if _NDARRAY in value:
            if value["dtype"] == "object":
                out = np.empty(len(value[_NDARRAY]), dtype=object)
                out[:] = [from_plain(v) for v in value[_NDARRAY]]
                return out
            return np.array(value[_NDARRAY], dtype=value["dtype"]).reshape(value["shape"])
        if _NPSCALAR in value:
            return np.dtype(value["dtype"]).type(value[_NPSCALAR])
        if _BATCH in value:
            from rlkit.batch import Batch

            parts = value[_BATCH]
            return Batch(
                parts["tensors"],
                {k: from_plain(v) for k, v in parts["non_tensors"].items()},
                from_plain(parts["meta"]),
            )
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    return value


def load_state_file(path: str | Path) -> Any:
    """A ``.pt`` state file read with ``weights_only=True`` (tensors and plain values) and ``from_plain``
    applied. A file that needs anything else (a pickled object: arbitrary code) is refused."""
    import torch

    path = Path(path)
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = (str(exc).splitlines() or [""])[0]
        culprit = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), first)
        raise CheckpointError(
            f"refused to load {path}: it holds a pickled Python object, not only tensors and plain values "
            f"({culprit}). Loading it would run code from the file. rlkit writes its checkpoints without "
            f"such objects; use checkpoints written by rlkit from a source you trust, or start without this "
            f"one (trainer.resume=never)."
        ) from exc
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(
            f"cannot read the checkpoint file {path}: {type(exc).__name__}: {exc}. It may be truncated; "
            f"resume from an earlier checkpoint (trainer.resume=<folder>)."
        ) from exc
    return from_plain(state)
