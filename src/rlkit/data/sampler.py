"""A seeded dataloader whose state restores the exact data order, mid-epoch included.

Epoch ``e`` visits the dataset in the order ``permutation(seed, e)`` (numpy's PCG64 seeded with
``[seed, e]``; identity when ``shuffle`` is off). The state is just ``(epoch, position)``: the number
of samples already handed out in the current epoch. A batch counts as consumed when it is yielded,
so a checkpoint taken after step ``k`` resumes with batch ``k + 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rlkit.batch import Batch
from rlkit.errors import DataError

__all__ = ["epoch_order", "StatefulDataLoader"]


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The sample order of one epoch: a permutation of ``range(num_samples)``."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class StatefulDataLoader:
    """Batches of ``batch_size`` samples; ``for batch in loader`` runs the rest of the current epoch.

    Args:
        dataset: anything with ``__len__``/``__getitem__`` (``RLDataset``); ``collate_fn`` defaults
            to ``dataset.collate``.
        batch_size: samples per batch (``data.train_batch_size``: prompts, before rollout.n).
        shuffle, seed: ``data.shuffle``, ``data.seed``.
        drop_last: drop the epoch's last short batch (training wants equal batches).
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
    ):
        if batch_size < 1:
            raise DataError(f"batch size must be >= 1, got {batch_size}.")
        if drop_last and len(dataset) < batch_size:
            files = getattr(dataset, "files", None)
            where = f"{', '.join(map(str, files))}: " if files else ""
            raise DataError(
                f"{where}the dataset has {len(dataset)} rows, fewer than one batch of {batch_size}; "
                "lower data.train_batch_size or add data."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn or dataset.collate
        self.epoch = 0
        self.position = 0  # samples handed out in the current epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        n = len(self.dataset)
        order = epoch_order(n, self.epoch, self.seed, self.shuffle)
        end = (n // self.batch_size) * self.batch_size if self.drop_last else n
        while self.position < end:
            indices = order[self.position : self.position + self.batch_size]
            self.position += len(indices)
            yield self.collate_fn([self.dataset[int(i)] for i in indices])
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off; refuses a state from different data or settings."""
        mine = self.state_dict()
        changed = {
            k: (state.get(k), mine[k])
            for k in ("seed", "shuffle", "num_samples", "batch_size")
            if state.get(k) != mine[k]
        }
        if changed:
            raise DataError(
                "cannot restore the dataloader: the checkpoint was made with different data settings "
                + ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items())
                + ". Resume with the same data files, data.seed, data.shuffle and data.train_batch_size."
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
