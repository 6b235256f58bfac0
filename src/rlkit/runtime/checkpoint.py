"""Atomic checkpoints: written to a temporary folder, then renamed; the last K kept.

Layout of ``<output_dir>/checkpoints/global_step_<N>/``::

    actor/ critic/ ...      each role's model, optimizer, scheduler and RNG states (written by the workers)
    trainer_state.pt        global step, data sampler state, KL controller, tracker run ids, driver RNG
    recipe.yaml             the effective recipe
    COMPLETE                written last; a folder without it is never resumed from

A kill at any moment leaves either the previous checkpoints untouched plus a ``.tmp-*`` folder
(removed at the next start, or published then if it already holds COMPLETE) or the new checkpoint
complete. A write that fails (full disk) raises ``CheckpointError`` naming the intact previous checkpoint.
Multi-node runs need ``trainer.output_dir`` on a file system every node sees.

Every ``.pt`` file is read with ``torch.load(weights_only=True)``
(``rlkit.model.state_file.load_state_file``): tensors and plain Python values only, so a checkpoint from
someone else cannot run code on resume. ``to_plain`` writes numpy arrays and scalars, ``Batch`` objects
(generations queued ahead) and tuples of them as tagged plain values; ``from_plain`` restores them.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.model.state_file import CheckpointError, CheckpointMismatchError

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointManager", "COMPLETE"]

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_step(folder: Path) -> int | None:
    """The step a COMPLETE marker in ``folder`` names, or None."""
    try:
        return int((folder / COMPLETE).read_text().strip())
    except (OSError, ValueError):
        return None


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; keeps the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 2, hooks: Any = None):
        self.root = Path(root)
        self.keep = keep
        self.hooks = hooks  # ``rlkit.step.hooks.RunHooks`` (``on_checkpoint``), or None

    def steps(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMPLETE).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1][1] if steps else None

    def clean_partial(self) -> list[Path]:
        """Remove folders a killed save left behind; returns what was removed.

        A ``.tmp-*`` folder that holds COMPLETE is whole (COMPLETE is written last and synced): when its
        step has no published folder (a kill between COMPLETE and the rename, or in the middle of
        replacing a step), it is published instead of removed; the newly written one wins over ``.tmp-old-*``.
        """
        removed = []
        if self.root.is_dir():
            for child in sorted(self.root.iterdir()):  # ".tmp-global_step_*" sorts before ".tmp-old-*"
                step = _complete_step(child)
                if (
                    child.name.startswith(".tmp-")
                    and step is not None
                    and not (self.root / f"global_step_{step}").exists()
                ):
                    child.rename(self.root / f"global_step_{step}")
            for child in self.root.iterdir():
                if child.name.startswith(".tmp-") or (
                    _STEP_DIR.match(child.name) and not (child / COMPLETE).exists()
                ):
                    shutil.rmtree(child, ignore_errors=True)
                    removed.append(child)
        return removed

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call ``write(tmp_dir)`` to fill a new checkpoint, then publish it atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"global_step_{step}"
        tmp = self.root / f".tmp-global_step_{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        previous = self.latest()
        try:
            tmp.mkdir()
            write(tmp)
            self._hook("checkpoint_write", step)
            marker = tmp / COMPLETE
            with marker.open("w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            self._hook("checkpoint_publish", step)
            if final.exists():  # saving the same step again (e.g. after a resume): replace it
                old = self.root / f".tmp-old-{step}-{os.getpid()}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync_dir(self.root)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            # A write that failed (full disk, quota, I/O error: an OSError here, or a worker's error while it
            # wrote its shards, which DCP reports as a RuntimeError) is a checkpoint error; a worker that
            # died (``died``) is left to the restart loop, and KeyboardInterrupt / SystemExit pass through.
            if isinstance(exc, Exception) and not getattr(exc, "died", False):
                raise CheckpointError(self._write_failed(step, previous, exc)) from exc
            raise
        self._prune()
        return final

    def _hook(self, phase: str, step: int) -> None:
        if self.hooks is not None:
            self.hooks.on_checkpoint(phase, step)

    def _write_failed(self, step: int, previous: Path | None, exc: Exception) -> str:
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        cause = (
            exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc).splitlines() or [""])[0]
        )
        try:
            free = f" ({shutil.disk_usage(self.root).free / 2**30:.1f} GiB free there now)"
        except OSError:
            free = ""
        return (
            f"could not write the checkpoint of step {step} under {self.root}: {type(exc).__name__}: "
            f"{cause}; {kept}. Free disk space{free} or set trainer.output_dir to another disk, then resume "
            "(trainer.resume=auto)."
        )

    def _prune(self) -> None:
        steps = self.steps()
        for _, path in steps[: max(len(steps) - self.keep, 0)]:
            shutil.rmtree(path, ignore_errors=True)

    def resolve_resume(self, mode: str) -> Path | None:
        """``auto`` → newest complete checkpoint or None; ``never`` → None; else a checkpoint path."""
        if mode == "never":
            return None
        if mode == "auto":
            return self.latest()
        path = Path(mode).expanduser()
        if not (path / COMPLETE).is_file():
            raise CheckpointError(
                f"trainer.resume={mode}: not a complete checkpoint folder (no {COMPLETE} file). "
                f"Complete checkpoints here: {[str(p) for _, p in self.steps()] or 'none'}."
            )
        return path
