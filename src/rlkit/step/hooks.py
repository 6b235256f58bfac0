"""Points a caller can act at during a run: the reliability tests' fault injection (``rlkit.testing.faults``).

``RunHooks``' defaults do nothing. A run gets its hooks as an argument (``rlkit.cli.main(argv, hooks=...)`` →
``Trainer(..., hooks=)`` → ``CheckpointManager(..., hooks=)``): nothing in a run reads them from the
environment.
"""

from __future__ import annotations

import torch

__all__ = ["RunHooks"]


class RunHooks:
    def on_phase(self, phase: str, step: int) -> None:
        """As each phase of a step starts (and ``logged``: the step's metrics are written)."""

    def on_checkpoint(self, phase: str, step: int) -> None:
        """Inside the checkpoint writer: ``checkpoint_write`` (shards written), ``checkpoint_publish``."""

    def advantages(self, advantages: torch.Tensor, step: int) -> torch.Tensor:
        """The step's advantages [B, T], before the actor update."""
        return advantages
