"""``EvalRolloutWorker``: a ``RolloutWorker`` rank that generates whole eval chunks, each with its own seed.

``generate_assigned(work, **sampling)`` takes every rank's work (``[(rank, seed, prompts)]``, sent to all
ranks) and generates the entries addressed to this rank, reseeding the backend's sampling generator with
the entry's seed first, so a chunk samples as it would in the eval's own process (``rlkit.eval.engines``).
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.workers.rollout_worker import RolloutWorker

__all__ = ["EvalRolloutWorker"]


class EvalRolloutWorker(RolloutWorker):
    """A rollout rank of ``rlkit eval`` (the policy's weights are the evaluated model's: never pushed)."""

    def generate_assigned(self, work: list[tuple[int, int, Batch]], **sampling: Any) -> Batch | None:
        """The generation of this rank's entry of ``work`` (None when it has none this round)."""
        mine = [(seed, prompts) for rank, seed, prompts in work if rank == self.rank]
        if not mine:
            return None
        if len(mine) > 1:
            raise WorkerError(
                f"eval rank {self.rank} was given {len(mine)} chunks in one round; the driver sends at most "
                "one per rank (rlkit.eval.engines.RayEngine.generate)"
            )
        seed, prompts = mine[0]
        generator = getattr(self.rollout_engine(), "generator", None)
        if isinstance(generator, torch.Generator):
            generator.manual_seed(seed)
        return self.rollout.generate(prompts, **sampling)
