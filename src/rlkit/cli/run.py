"""``rlkit run RECIPE [overrides]``: validate first (nothing starts before the recipe is valid), then train.

SIGINT (Ctrl-C) and SIGTERM stop the run within seconds (``rlkit.runtime.stop``): no partial checkpoint, a
message naming the checkpoint a resume will use, the tracking run marked KILLED, every Ray process of
the run gone; exit code 130 (SIGINT) or 143 (SIGTERM). A second signal kills at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from rlkit.cli.recipe import add_smoke_args, load_from_args
from rlkit.errors import RlkitError, WorkerError
from rlkit.model.state_file import CheckpointMismatchError, load_state_file
from rlkit.plugin.registry import Registries, build_registries
from rlkit.recipe import Recipe
from rlkit.recipe.hub import resolve_recipe_models
from rlkit.runtime.checkpoint import CheckpointManager
from rlkit.runtime.stop import StopHandler

if TYPE_CHECKING:
    from rlkit.step.hooks import RunHooks

log = logging.getLogger("rlkit")

# Quiet by default; a user's own setting wins. Hub access is the user's (rlkit never sets HF_HUB_OFFLINE):
# hub ids are downloaded, or found in the HF cache, once on the driver (rlkit.recipe.hub).
_ENV_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="train with a recipe (validates it first)")
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, ~key.sub removes a key")
    add_smoke_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    registries = build_registries()
    recipe = load_from_args(args, registries)
    stopper = StopHandler().install()
    try:
        final = train(recipe, registries, stopper, hooks=getattr(args, "hooks", None))
    except KeyboardInterrupt as exc:  # RunInterrupted, or a KeyboardInterrupt Ray raised in its place
        code = getattr(exc, "exit_code", None) or stopper.exit_code
        if stopper.installed:  # the clean stop is done: skip the interpreter's slow teardown of Ray and torch
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    finally:
        stopper.restore()
    shown = {
        k: round(v, 4) for k, v in sorted(final.items()) if k.startswith(("val-core/", "critic/score/mean"))
    }
    print(f"done: {shown}")
    return 0


def resume_hint(checkpoints: CheckpointManager) -> str:
    """Which checkpoint ``trainer.resume=auto`` (the default) would load now."""
    latest = checkpoints.latest()
    if latest is None:
        return (
            f"no checkpoint exists under {checkpoints.root}: running the same command starts from the "
            "beginning."
        )
    return f"running the same command resumes from {latest} (trainer.resume=auto)."


def train(
    recipe: Recipe, registries: Registries, stopper: StopHandler | None = None, hooks: RunHooks | None = None
) -> dict[str, float]:
    """Run to the end; with ``trainer.max_restarts > 0`` restart from the last checkpoint after a worker dies.

    The output folder is locked first (``rlkit.runtime.build.lock_run_outputs``): a second run into it refuses
    at once. ``hooks``: ``rlkit.step.hooks.RunHooks`` (the reliability tests' fault injection), None for a
    plain run."""
    from rlkit.runtime.lock import lock_run_outputs

    locks = lock_run_outputs(recipe)
    try:
        return _train_with_restarts(recipe, registries, stopper, hooks)
    finally:
        for lock in reversed(locks):
            lock.release()


def _train_with_restarts(
    recipe: Recipe, registries: Registries, stopper: StopHandler | None, hooks: RunHooks | None
) -> dict[str, float]:
    import torch

    from rlkit.rewards.managers import RewardFailureError
    from rlkit.runtime.build import output_dir_of

    torch.manual_seed(recipe.trainer.seed)
    recipe = resolve_recipe_models(recipe)  # hub ids -> local snapshot folders, here and not in the workers
    checkpoints = CheckpointManager(
        output_dir_of(recipe) / "checkpoints", keep=recipe.trainer.max_ckpt_to_keep
    )
    stopper = stopper or StopHandler()
    stopper.set_resume_hint(lambda: resume_hint(checkpoints))
    attempt = 0
    while True:
        try:
            return _train_once(recipe, registries, checkpoints, stopper, hooks)
        except KeyboardInterrupt:
            stopper.announce()
            raise
        except RewardFailureError as exc:
            latest = checkpoints.latest()
            where = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
            raise RewardFailureError(f"{exc}\nTraining stopped; {where}.") from exc
        except WorkerError as exc:
            mismatch = getattr(exc.__context__, "cause", None)  # the worker's exception (RayTaskError.cause)
            if isinstance(mismatch, CheckpointMismatchError):  # a restart cannot fix it; no remote traceback
                raise CheckpointMismatchError(f"role '{exc.role}', rank {exc.rank}: {mismatch}") from None
            latest = checkpoints.latest()
            where = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
            if attempt >= recipe.trainer.max_restarts:
                resume = " Resume with trainer.resume=auto." if latest else ""
                raise WorkerError(f"{exc}\nTraining stopped; {where}.{resume}") from exc
            attempt += 1
            log.warning(
                "a worker failed (%s); restart %d of %d from %s",
                exc,
                attempt,
                recipe.trainer.max_restarts,
                where,
            )
            recipe = recipe.model_copy(
                update={"trainer": recipe.trainer.model_copy(update={"resume": "auto"})}
            )


def _train_once(
    recipe: Recipe,
    registries: Registries,
    checkpoints: CheckpointManager,
    stopper: StopHandler,
    hooks: RunHooks | None = None,
) -> dict[str, float]:

    from rlkit.runtime.build import Runtime
    from rlkit.step.trainer import Trainer

    resume_from = checkpoints.resolve_resume(recipe.trainer.resume)
    run_ids = {}
    if resume_from is not None:  # continue the same tracking run
        run_ids = load_state_file(resume_from / "trainer_state.pt").get("tracker_run_ids", {})
    runtime = Runtime.start(recipe, registries, run_ids=run_ids)
    stopper.track(runtime.owned_processes)
    status = "FAILED"
    try:
        trainer = Trainer(recipe, runtime, hooks=hooks)
        stopper.set_where(trainer.watch.where)
        final = trainer.fit()
        status = "FINISHED"
        return final
    except KeyboardInterrupt:
        status = "KILLED"
        stopper.announce()  # the checkpoint writer has removed its partial folder by now
        raise
    finally:
        runtime.close(status=status)


__all__ = ["add_parser", "run", "train", "RlkitError"]
