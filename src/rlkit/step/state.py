"""The run's state on disk: a checkpoint's driver half (step, dataloader position, KL controller, tracker run
ids, driver RNG, batches generated ahead) beside the workers' shards, and ``run_info.json``.

    path = save(ctx, checkpoints, pipe)                 # atomic (rlkit.runtime.checkpoint.CheckpointManager)
    step = resume(ctx.recipe, rt, checkpoints, pipe)    # the step resumed at, or None when starting fresh
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from rlkit.model.state_file import load_state_file, to_plain
from rlkit.recipe import recipe_to_dict
from rlkit.step.context import StepContext

__all__ = ["resume", "save", "write_run_info"]

log = logging.getLogger("rlkit.step.state")


def save(ctx: StepContext, checkpoints: Any, pipe: Any | None) -> Path:
    rt = ctx.rt

    def write(tmp: Path) -> None:
        rt.save_workers(tmp)
        state = {
            "global_step": ctx.global_step,
            "dataloader": rt.train_loader.state_dict(),
            "kl_ctrl": rt.kl_ctrl.__dict__ if rt.kl_ctrl is not None else None,
            "tracker_run_ids": rt.tracking.run_ids(),
            "driver_rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()},
            # the generations the rollout pool made ahead (in flight ones are waited for): trained on after a
            # resume
            "rollout_queue": pipe.state_dict() if pipe is not None else None,
        }
        torch.save(to_plain(state, "trainer_state"), tmp / "trainer_state.pt")
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(ctx.recipe), sort_keys=False))

    path = checkpoints.save(ctx.global_step, write)
    log.info("saved checkpoint %s", path)
    return path


def resume(recipe: Any, rt: Any, checkpoints: Any, pipe: Any | None) -> int | None:
    """Restore the newest (``auto``) or given checkpoint; returns its step, or None when none was loaded."""
    checkpoints.clean_partial()
    path = checkpoints.resolve_resume(recipe.trainer.resume)
    if path is None:
        return None
    # weights_only: no pickled code runs (runtime.checkpoint)
    state = load_state_file(path / "trainer_state.pt")
    rt.load_workers(path)
    rt.train_loader.load_state_dict(state["dataloader"])
    if state["kl_ctrl"] is not None and rt.kl_ctrl is not None:
        rt.kl_ctrl.__dict__.update(state["kl_ctrl"])
    torch.set_rng_state(state["driver_rng"]["torch"])
    np.random.set_state(state["driver_rng"]["numpy"])
    queued = state.get("rollout_queue")
    if pipe is not None and queued is not None:
        pipe.load_state_dict(queued)
    elif queued and queued["items"]:
        log.warning(
            "the checkpoint holds %d batches generated ahead (trainer.mode was not sync); trainer.mode=sync "
            "discards them: their prompts are skipped",
            len(queued["items"]),
        )
    log.info("resumed from %s at step %d", path, state["global_step"])
    return state["global_step"]


def write_run_info(rt: Any, output_dir: Path) -> None:
    info = {
        "run_ids": rt.tracking.run_ids(),
        "mlflow_uri": rt.mlflow_uri,
        "started": time.time(),
        "output_dir": str(output_dir),
        "resolved": (rt.hardware.params() if rt.hardware is not None else {})
        | (rt.peak.params() if rt.peak is not None else {}),
    }  # auto's inputs, the MFU peak
    (output_dir / "run_info.json").write_text(json.dumps(info, indent=1))
