"""The RL loop: ``fit()`` runs steps, validation and checkpoints; ``step()`` is veRL's data flow as a list of
phases.

One step (docs/concepts.md, "One step"); each phase is ``batch, metrics = phase(batch, ctx)`` in its own
module::

    gen            generate (rlkit.step.generate), or the rollout pool's batch made ahead (rlkit.step.ahead)
                   + greedy_baseline (rlkit.step.baseline) when the estimator needs one (ReMax)
    reward         score (rlkit.step.reward)
    (sampling)     dynamic_sampling (rlkit.step.sampling): DAPO's group filter, refilled by gen + reward
    old_log_prob   skipped when it must equal the current one (one epoch, one mini-batch), unless a rollout
                   correction or an estimator needing sum_pi_squared (OTB) uses it; never in bypass mode
    (correction)   correct_rollout (rlkit.step.correction): mismatch metrics and the recipe's correction
    ref, values    the reference's log-probs, the critic's values (rlkit.step.compute), when those roles exist
    adv            advantage (rlkit.step.advantage): KL-in-reward (optional), then the registered estimator
    update_critic, update_actor, sync_weights (rlkit.step.compute); push_weights to a rollout pool

The only branches are "is this role present" and "is this feature on". Everything named by the recipe comes
from the registries (``rlkit.runtime.build`` builds it). Metrics travel one way: returned by each phase.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import yaml

from rlkit.algos import DynamicSamplingAccumulator
from rlkit.batch import Batch
from rlkit.recipe import Recipe, recipe_to_dict
from rlkit.runtime.build import Runtime
from rlkit.runtime.checkpoint import CheckpointManager
from rlkit.runtime.watchdog import PhaseWatch
from rlkit.step import state
from rlkit.step.advantage import advantage
from rlkit.step.ahead import RolloutPipeline, generated_ahead, pipeline_depth, staleness_bound
from rlkit.step.baseline import greedy_baseline
from rlkit.step.compute import old_log_prob, ref_log_prob, sync_weights, update_actor, update_critic, values
from rlkit.step.context import StepContext
from rlkit.step.correction import bypass_on, correct
from rlkit.step.generate import generate
from rlkit.step.hooks import RunHooks
from rlkit.step.metrics import Timer, data_metrics, throughput_metrics, timing_metrics
from rlkit.step.reward import score
from rlkit.step.sampling import dynamic_sampling
from rlkit.step.validation import validate

__all__ = ["Trainer"]

log = logging.getLogger("rlkit.step.trainer")


class Trainer:
    """Owns the data flow; the worker groups in ``runtime`` do the compute."""

    def __init__(self, recipe: Recipe, runtime: Runtime, hooks: RunHooks | None = None):
        """``hooks``: what a caller does at the phases and checkpoint points (``rlkit.step.hooks``; the
        reliability tests' fault injection); None: nothing."""
        self.recipe = recipe
        self.rt = runtime
        self.hooks = hooks or RunHooks()
        self.global_step = 0
        self.output_dir = runtime.output_dir
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", keep=recipe.trainer.max_ckpt_to_keep, hooks=self.hooks
        )
        filter_groups = recipe.algorithm.filter_groups
        self.sampling = (
            DynamicSamplingAccumulator(
                recipe.data.train_batch_size, filter_groups.max_num_gen_batches, filter_groups.metric
            )
            if filter_groups.enable
            else None
        )
        spec = runtime.estimator.spec
        self.needs_baseline = spec.needs_greedy_baseline
        self.needs_sum_pi_squared = spec.needs_sum_pi_squared
        correction = runtime.pipeline.rollout_correction
        # pi_old := pi_rollout: never the pass (validation refuses OTB with it)
        self.bypass = bypass_on(correction)
        # One PPO epoch over one mini-batch is on-policy: the old log-prob equals the current one (the update
        # then logs the rollout mismatch from its own log-probs). A correction or OTB needs it before the
        # update.
        actor = recipe.actor
        one_pass = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == recipe.data.train_batch_size
        self.recompute_old_log_prob = not self.bypass and (
            not one_pass or correction is not None or self.needs_sum_pi_squared
        )
        # slow phases, silent ranks
        self.watch = PhaseWatch(lambda: list(runtime.groups), recipe.trainer.watchdog)
        t = recipe.trainer
        self.pipe = (
            RolloutPipeline(
                runtime.rollout,
                runtime.actor,
                depth=pipeline_depth(t.mode, t.max_staleness),
                max_staleness=staleness_bound(t.mode, t.max_staleness),
            )
            if runtime.rollout is not None
            else None
        )  # the rollout pool generating ahead

    # ----- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train for ``trainer.total_steps`` (or epochs), validating and saving on schedule."""
        self.watch.start()
        try:
            return self._fit()
        finally:
            self.watch.stop()

    def step(self, prompts: Batch | None, more_prompts: Any = None) -> dict[str, float]:
        """One RL step on ``prompts`` (``more_prompts``: the prompt iterator that refills the batch for
        dynamic sampling and feeds a rollout pool)."""
        ctx = self._context()
        timer = Timer(on_enter=self._on_phase, on_exit=self.watch.exit)
        metrics: dict[str, float] = {"training/global_step": float(self.global_step)}

        def run(name: str | None, phase, batch, *args) -> Batch:
            with timer(name) if name else contextlib.nullcontext():
                batch, more = phase(batch, ctx, *args)
            metrics.update(more)
            return batch

        # gen (+ ReMax's greedy baseline), then reward
        def generated(gen_batch: int, prompts: Batch) -> Batch:
            with timer("gen"):
                batch = run(None, generate, prompts, gen_batch)
                if self.needs_baseline:
                    batch = run(None, greedy_baseline, batch, prompts)
            return run("reward", score, batch)

        with timer("step"):
            if self.pipe is None:
                batch = generated(0, prompts)
            else:
                batch = run("reward", score, run("gen", generated_ahead, more_prompts, self.pipe))
            if self.sampling is not None:
                batch = run(
                    None, dynamic_sampling, batch, self.sampling, lambda i: generated(i, next(more_prompts))
                )
            if self.recompute_old_log_prob:
                batch = run("old_log_prob", old_log_prob, batch, self.needs_sum_pi_squared)
            if self.recompute_old_log_prob or self.bypass:
                batch = run(None, correct, batch)
            if self.rt.ref is not None:
                batch = run("ref", ref_log_prob, batch)
            if self.rt.critic is not None:
                batch = run("values", values, batch)
            batch = run("adv", advantage, batch)
            batch["advantages"] = self.hooks.advantages(batch["advantages"], self.global_step)
            if self.rt.critic is not None:
                batch = run("update_critic", update_critic, batch)
            batch = run("update_actor", update_actor, batch)
            # hybrid engine: the rollout samples the updated actor
            batch = run("sync_weights", sync_weights, batch)
            if self.pipe is not None:
                # the rollout pool gets this version behind what it already generates
                with timer("push_weights"):
                    self.pipe.push_weights(self.global_step)
        data = self.recipe.data
        metrics |= data_metrics(
            batch, max_prompt_length=data.max_prompt_length, max_response_length=data.max_response_length
        )
        metrics |= timing_metrics(timer.times, batch)
        metrics |= throughput_metrics(batch, timer.times["step"], self.rt.actor.world_size)
        metrics |= self.rt.perf_metrics(batch, timer.times, metrics)
        return metrics

    # ----- around the steps ---------------------------------------------------------------------
    def _fit(self) -> dict[str, float]:
        cfg = self.recipe.trainer
        # validate / save: watched, not timed
        timer = Timer(on_enter=self.watch.enter, on_exit=self.watch.exit)
        resumed = state.resume(self.recipe, self.rt, self.checkpoints, self.pipe)
        self.global_step = resumed or 0
        # the rollout pool starts from the actor's weights (a resumed run: the checkpoint's)
        if self.pipe is not None:
            self.pipe.push_weights(self.global_step)
        state.write_run_info(self.rt, self.output_dir)
        if resumed is None:
            self.rt.tracking.log_text(
                yaml.safe_dump(recipe_to_dict(self.recipe), sort_keys=False), "recipe.yaml"
            )
        last: dict[str, float] = {}
        if cfg.val_before_train and self.rt.val_loader is not None and resumed is None:
            with timer("validate"):
                last = validate(self._context())
            self.rt.tracking.log(last, self.global_step)
        batches = self.rt.train_batches()
        while self.global_step < self.rt.total_steps:
            # the rollout pool draws its own prompts ahead
            prompts = next(batches) if self.pipe is None else None
            self.global_step += 1
            self.watch.step = self.global_step
            metrics = self.step(prompts, batches)
            is_last = self.global_step == self.rt.total_steps
            if self.rt.val_loader is not None and (
                is_last or (cfg.test_freq > 0 and self.global_step % cfg.test_freq == 0)
            ):
                with timer("validate"):
                    metrics |= validate(self._context())
            self.rt.tracking.log(metrics, self.global_step)
            self.hooks.on_phase("logged", self.global_step)
            last = metrics
            if is_last or (cfg.save_freq > 0 and self.global_step % cfg.save_freq == 0):
                with timer("save"):
                    state.save(self._context(), self.checkpoints, self.pipe)
        if cfg.merge_at_end:
            self._merge_final()
        return last

    def _context(self) -> StepContext:
        return StepContext(recipe=self.recipe, rt=self.rt, global_step=self.global_step)

    def _on_phase(self, phase: str) -> None:
        """As each phase of the step starts: the hooks (``RunHooks.on_phase``), the watchdog."""
        self.hooks.on_phase(phase, self.global_step)
        self.watch.enter(phase)

    def _merge_final(self) -> Path:
        """The newest checkpoint's actor as an HF folder; its path is logged to the trackers."""
        from rlkit.runtime.merge import merge_checkpoint

        out = merge_checkpoint(self.checkpoints.latest(), self.output_dir / "hf_model")
        self.rt.tracking.log_text(str(out.resolve()), "merged_model_path.txt")
        log.info("merged the final actor into %s", out)
        return out
