"""Weight sync into SGLang servers, without leaving files behind.

Two paths (``rollout.backend.weight_sync``; ``auto``: ``tensor`` for servers this backend launched on
its node, ``disk`` for attached ones, which may sit on other hosts):

- ``tensor`` — SGLang's in-memory update, ``POST /update_weights_from_tensor`` with
  ``load_format: flattened_bucket``. The tensors are copied into one shared-memory buffer per bucket
  (``BUCKET_BYTES``; torch's ``file_system`` sharing: a ``/dev/shm/torch_*`` segment that torch's
  ``torch_shm_manager`` unlinks when the last process holding it lets go), the request carries only
  the pickled handle and each tensor's name, dtype, shape and byte range (SGLang's
  ``MultiprocessingSerializer`` format: ``ForkingPickler`` bytes, base64), and the server copies the
  weights out of the buffer into its parameters. Same host only. Verified on CPU with SGLang
  0.5.15.post1 (docs/sglang.md); on CUDA servers the buffer is host memory the server copies to the GPU
  (not verified here).
- ``disk`` — one folder per run (``RunFolder``), rewritten in place at every sync and removed when the
  backend closes, at interpreter exit, or by the server's guard when the process that launched it dies
  (``_guard.py --remove``); a folder whose process was killed with its guard is swept by the next run that
  makes one in the same place (``sweep_stale``). Servers reload it with ``/update_weights_from_disk``.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

__all__ = [
    "BUCKET_BYTES",
    "RunFolder",
    "buckets",
    "flattened_bucket_payload",
    "file_system_sharing",
    "sweep_stale",
]

BUCKET_BYTES = 1 << 30  # one request (and one shared-memory buffer) per GiB of weights


def buckets(
    named: list[tuple[str, torch.Tensor]], limit: int = BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``limit`` bytes (a larger tensor is a group of its own), in order."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = limit
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > limit or not groups:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    return groups


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """torch's ``file_system`` sharing strategy for the duration: a shared CPU storage pickles as the name
    of its ``/dev/shm`` segment, which an unrelated process (the server) can open. The default
    ``file_descriptor`` strategy passes descriptors that only this process's children can receive."""
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def flattened_bucket_payload(named: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """``(payload, buffer)``: the base64 ``MultiprocessingSerializer`` bytes of SGLang's flattened bucket
    (``{"flattened_tensor", "metadata"}``) over one new shared-memory buffer holding the bytes of every
    tensor. Keep ``buffer`` alive until the server has answered; dropping it frees the segment."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    sizes = [t.numel() * t.element_size() for _, t in named]
    with file_system_sharing():
        storage = torch.UntypedStorage._new_shared(sum(sizes))
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        metadata, start = [], 0
        for (name, tensor), size in zip(named, sizes):
            source = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[start : start + size].copy_(source)
            metadata.append(
                SimpleNamespace(
                    name=name,
                    shape=tensor.shape,
                    dtype=tensor.dtype,
                    start_idx=start,
                    end_idx=start + size,
                    numel=size,
                )
            )
            start += size
        out = io.BytesIO()
        ForkingPickler(out).dump({"flattened_tensor": buffer, "metadata": metadata})
    return base64.b64encode(out.getvalue()).decode("ascii"), buffer


class RunFolder:
    """The one folder a run's weight syncs go through (``disk`` path, LoRA adapters): created under
    ``root`` (default: the temp dir) on first use, rewritten in place, removed by ``remove()``, at garbage
    collection and at interpreter exit (``weakref.finalize``)."""

    def __init__(self, root: str | None = None):
        self.root = root
        self.path: str | None = None
        self._finalizer: weakref.finalize | None = None

    def create(self) -> str:
        if self.path is None:
            base = self.root or tempfile.gettempdir()
            os.makedirs(base, exist_ok=True)
            sweep_stale(base)
            self.path = tempfile.mkdtemp(prefix=f"rlkit-sglang-{os.getpid()}-", dir=base)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)
        return self.path

    def remove(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # once


def sweep_stale(base: str) -> list[str]:
    """Remove the run folders in ``base`` whose process is gone (one SIGKILLed together with its servers'
    guards, before anything could clean up); returns what it removed."""
    removed = []
    for entry in os.scandir(base):
        parts = entry.name.split("-")
        if not (entry.name.startswith("rlkit-sglang-") and len(parts) >= 4 and parts[2].isdigit()):
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        except PermissionError:  # alive, someone else's
            pass
    return removed
