"""The RL loop: ``fit()`` runs steps, validation and checkpoints; ``step()`` is veRL's data flow.

One step, top to bottom (DESIGN.md, "One step")::

    gen      rollout.n responses per prompt (hybrid engine: the actor's own weights)
    reward   score → token_level_scores
    sampler  identity, or DAPO's group filter that refills the batch from new prompts
    old_log_prob   skipped when it must equal the current one (one epoch, one mini-batch), unless a
                   rollout correction or an estimator needing sum_pi_squared (OTB) uses it; always skipped
                   in bypass mode, where the rollout's log-probs are pi_old (``rlkit.offpolicy``)
    correction     rollout/trainer mismatch metrics; the recipe's rollout correction (``rlkit.offpolicy``)
    ref      reference log-probs, when a KL term needs them
    values   critic values, when the estimator needs a critic
    adv      KL-in-reward (optional), then the registered estimator
    update_critic, update_actor

The only branches are "is this role present". Everything named by the recipe comes from the
registries (``rlkit.runtime`` builds it). With a rollout pool (``trainer.mode`` one_step_off / async),
``gen`` takes a batch the pool generated ahead (``rlkit.async_rollout``) and the step ends by pushing
the updated weights to it (``push_weights``); docs/async.md.
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

from rlkit.algos import DynamicSamplingAccumulator, DynamicSamplingError, apply_kl_penalty, first_groups_mask
from rlkit.async_rollout import RolloutPipeline, pipeline_depth, staleness_bound
from rlkit.batch import Batch
from rlkit.checkpoint import CheckpointManager
from rlkit.metrics import Timer, data_metrics, throughput_metrics, timing_metrics, validation_metrics
from rlkit.offpolicy import bypass_on, correct_rollout, loss_batch
from rlkit.recipe import Recipe, recipe_to_dict
from rlkit.rollout.base import concat_rollouts
from rlkit.runtime import Runtime
from rlkit.watchdog import PhaseWatch

__all__ = ["RunHooks", "Trainer"]

log = logging.getLogger("rlkit.trainer")


class RunHooks:
    """Points a caller can act at (the reliability tests' fault injection, ``rlkit.testing.faults``); these
    defaults do nothing. Passed to ``Trainer`` as an argument: nothing in a run reads them from the
    environment."""

    def on_phase(self, phase: str, step: int) -> None:
        """As each phase of a step starts (and ``logged``: the step's metrics are written)."""

    def on_checkpoint(self, phase: str, step: int) -> None:
        """Inside the checkpoint writer: ``checkpoint_write`` (shards written), ``checkpoint_publish``."""

    def advantages(self, advantages: torch.Tensor, step: int) -> torch.Tensor:
        """The step's advantages, before the actor update."""
        return advantages


class Trainer:
    """Owns the data flow; the worker groups in ``runtime`` do the compute."""

    def __init__(self, recipe: Recipe, runtime: Runtime, hooks: RunHooks | None = None):
        self.recipe = recipe
        self.rt = runtime
        self.hooks = hooks or RunHooks()
        self.global_step = 0
        self.output_dir = runtime.output_dir
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints",
                                             keep=recipe.trainer.max_ckpt_to_keep, hooks=self.hooks)
        est = runtime.estimator
        self.dynamic_sampling = (
            DynamicSamplingAccumulator(recipe.data.train_batch_size, recipe.algorithm.filter_groups.max_num_gen_batches,
                                       recipe.algorithm.filter_groups.metric)
            if recipe.algorithm.filter_groups.enable else None
        )
        self.needs_baseline = est.spec.needs_greedy_baseline
        # One PPO epoch over one mini-batch is on-policy: the old log-prob equals the current one (the update
        # then logs the rollout mismatch from its own log-probs). A correction or OTB needs it before the update.
        actor = recipe.actor
        self.correction = runtime.pipeline.rollout_correction
        self.needs_sum_pi_squared = est.spec.needs_sum_pi_squared
        self.bypass = bypass_on(self.correction)  # pi_old := pi_rollout: never the pass (validation refuses OTB with it)
        self.recompute_old_log_prob = not self.bypass and (
            not (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == recipe.data.train_batch_size)
            or self.correction is not None or self.needs_sum_pi_squared)
        self.watch = PhaseWatch(lambda: list(runtime.groups), recipe.trainer.watchdog)  # slow phases, silent ranks
        t = recipe.trainer
        self.pipe = (RolloutPipeline(runtime.rollout, runtime.actor, depth=pipeline_depth(t.mode, t.max_staleness),
                                     max_staleness=staleness_bound(t.mode, t.max_staleness))
                     if runtime.rollout is not None else None)  # the rollout pool generating ahead

    # ----- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train for ``trainer.total_steps`` (or epochs), validating and saving on schedule."""
        self.watch.start()
        try:
            return self._fit()
        finally:
            self.watch.stop()

    def _fit(self) -> dict[str, float]:
        cfg = self.recipe.trainer
        timer = Timer(on_enter=self.watch.enter, on_exit=self.watch.exit)  # validate / save: watched, not timed
        resumed = self.resume()
        if self.pipe is not None:  # the rollout pool starts from the actor's weights (a resumed run: the checkpoint's)
            self.pipe.push_weights(self.global_step)
        self.write_run_info()
        if not resumed:
            self.rt.tracking.log_text(yaml.safe_dump(recipe_to_dict(self.recipe), sort_keys=False), "recipe.yaml")
        last: dict[str, float] = {}
        if cfg.val_before_train and self.rt.val_loader is not None and not resumed:
            with timer("validate"):
                last = self.validate()
            self.rt.tracking.log(last, self.global_step)
        batches = self.rt.train_batches()
        while self.global_step < self.rt.total_steps:
            prompts = next(batches) if self.pipe is None else None  # the rollout pool draws its own prompts ahead
            self.global_step += 1
            self.watch.step = self.global_step
            metrics = self.step(prompts, batches)
            is_last = self.global_step == self.rt.total_steps
            if self.rt.val_loader is not None and (is_last or (cfg.test_freq > 0 and self.global_step % cfg.test_freq == 0)):
                with timer("validate"):
                    metrics |= self.validate()
            self.rt.tracking.log(metrics, self.global_step)
            self.hooks.on_phase("logged", self.global_step)
            last = metrics
            if is_last or (cfg.save_freq > 0 and self.global_step % cfg.save_freq == 0):
                with timer("save"):
                    self.save()
        if cfg.merge_at_end:
            self.merge_final()
        return last

    def merge_final(self) -> Path:
        """The newest checkpoint's actor as an HF folder; its path is logged to the trackers."""
        from rlkit.merge import merge_checkpoint

        out = merge_checkpoint(self.checkpoints.latest(), self.output_dir / "hf_model")
        self.rt.tracking.log_text(str(out.resolve()), "merged_model_path.txt")
        log.info("merged the final actor into %s", out)
        return out

    def step(self, prompts: Batch, more_prompts: Any = None) -> dict[str, float]:
        """One RL step on ``prompts`` (``more_prompts`` refills the batch for dynamic sampling)."""
        rt = self.rt
        timer = Timer(on_enter=self.on_phase, on_exit=self.watch.exit)
        metrics: dict[str, float] = {"training/global_step": float(self.global_step)}
        with timer("step"):
            with timer("gen"):
                batch = self.rollout(prompts, metrics) if self.pipe is None else self.take_generated(more_prompts, metrics)
            with timer("reward"):
                batch = self.score(batch, metrics)
            if self.dynamic_sampling is not None:
                batch = self.fill_by_dynamic_sampling(batch, more_prompts, timer, metrics)
            if self.recompute_old_log_prob:
                with timer("old_log_prob"):
                    spp = {"with_sum_pi_squared": True} if self.needs_sum_pi_squared else {}  # OTB's sum_pi_squared
                    batch = batch.union(rt.actor.call("compute_log_prob", batch, balance=self.balance, **spp))
            if self.recompute_old_log_prob or self.bypass:
                batch, more = correct_rollout(batch, self.correction)
                metrics |= more
            if rt.ref is not None:
                with timer("ref"):
                    batch = batch.union(rt.ref_call("compute_ref_log_prob", batch))
            if rt.critic is not None:
                with timer("values"):
                    batch = batch.union(rt.critic.call("compute_values", batch, balance=self.balance))
            with timer("adv"):
                batch = self.compute_advantage(batch, metrics)
            if rt.critic is not None:
                with timer("update_critic"):
                    metrics |= rt.critic.call("update_critic", batch, balance=self.balance)[0]
            with timer("update_actor"):
                metrics |= rt.actor.call("update_actor", loss_batch(batch), balance=self.balance)[0]  # same on every rank
                metrics |= rt.actor.last_metrics  # global_seqlen/*: tokens per rank before and after balancing
            with timer("sync_weights"):  # hybrid engine: the rollout samples from the updated actor
                rt.actor.call("sync_weights", dispatch="all")
            if self.pipe is not None:
                with timer("push_weights"):  # the rollout pool gets this version behind what it already generates
                    self.pipe.push_weights(self.global_step)
        metrics |= data_metrics(batch, max_prompt_length=self.recipe.data.max_prompt_length,
                                max_response_length=self.recipe.data.max_response_length)
        metrics |= timing_metrics(timer.times, batch)
        metrics |= throughput_metrics(batch, timer.times["step"], rt.actor.world_size)
        metrics |= rt.perf_metrics(batch, timer.times)
        return metrics

    def on_phase(self, phase: str) -> None:
        """As each phase of the step starts: the hooks (``RunHooks.on_phase``), the watchdog."""
        self.hooks.on_phase(phase, self.global_step)
        self.watch.enter(phase)

    @property
    def balance(self) -> bool:
        return self.recipe.trainer.balance_batch

    # ----- phases -------------------------------------------------------------------------------
    def rollout(self, prompts: Batch, metrics: dict[str, float], gen_batch: int = 0) -> Batch:
        """Repeat each prompt rollout.n times (interleaved), give each group a uid, generate.

        The uid names step, generation batch (dynamic sampling's refills) and row, so groups from
        different generation batches of one step never merge."""
        n = self.recipe.rollout.n
        prompts = Batch(prompts.tensors, prompts.non_tensors, prompts.meta)
        repeated = self.repeat_prompts(prompts, f"{self.global_step}-{gen_batch}")
        gen = self.rt.actor.call("generate_sequences", self.rollout_inputs(repeated), balance=False, n=1)
        batch = self.join_generation(repeated, gen, metrics)
        if self.needs_baseline:  # ReMax: each prompt's greedy response score is its baseline
            greedy = self.rt.actor.call("generate_sequences", self.rollout_inputs(prompts), balance=False, n=1,
                                        do_sample=False)
            greedy_batch = prompts.select(list(prompts.non_tensors)).union(Batch(greedy.tensors, {}, {}))
            baseline = self.reward_of(greedy_batch).token_level_scores.sum(-1)  # [B/n]
            batch["reward_baselines"] = baseline.repeat_interleave(n)
        return batch

    def repeat_prompts(self, prompts: Batch, tag: str) -> Batch:
        """``prompts`` with ``uid`` ``<tag>-<row>`` (a group id), each row repeated rollout.n times (interleaved).
        Sets ``uid`` on ``prompts`` too."""
        prompts["uid"] = [f"{tag}-{i}" for i in range(len(prompts))]
        return prompts.repeat(self.recipe.rollout.n, interleave=True)

    @staticmethod
    def join_generation(repeated: Batch, gen: Batch, metrics: dict[str, float]) -> Batch:
        """The repeated prompts' per-row fields with the generation's tensors; the generation's metrics go to ``metrics``."""
        metrics |= gen.meta.pop("metrics", {})  # agent loops: num_turns/*, tool_call_counts/*
        return repeated.select(list(repeated.non_tensors)).union(Batch(gen.tensors, {}, gen.meta))

    def take_generated(self, more_prompts: Any, metrics: dict[str, float]) -> Batch:
        """The next batch the rollout pool generated ahead (waiting for it if needed); it draws new prompts
        from ``more_prompts`` to stay ``depth`` generations ahead. ``async/*`` metrics: the staleness of the
        batch's rows (actor version - ``rollout_version``) and the generations dropped as too stale."""

        def request(serial: int) -> tuple[Batch, Batch]:
            prompts = next(more_prompts)
            repeated = self.repeat_prompts(Batch(prompts.tensors, prompts.non_tensors, prompts.meta), f"g{serial}")
            return repeated, self.rollout_inputs(repeated)

        actor_version = self.global_step - 1  # updates the actor has made before this step's
        ahead = self.rt.total_steps - self.global_step  # nothing is generated for steps the run will not make
        item, dropped = self.pipe.take(actor_version, request, ahead=ahead)
        batch = self.join_generation(item.request, item.result, metrics)
        staleness = (actor_version - batch["rollout_version"]).float()  # [B]
        metrics |= {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
                    "async/dropped_stale": float(dropped), "async/weights_version": float(actor_version),
                    "async/queued": float(len(self.pipe.queue))}
        return batch

    @staticmethod
    def rollout_inputs(prompts: Batch) -> Batch:
        """What a backend reads: the prompt tensors, plus the per-row fields agent loops use."""
        keys = ["input_ids", "attention_mask", "position_ids"] + [k for k in ("agent_name", "extra_info") if k in prompts]
        return prompts.select(keys)

    def reward_of(self, batch: Batch) -> Any:
        """The reward step's result (``RewardResult``); the reward model scores the batch first when there is one."""
        if self.rt.reward_model is not None:
            batch = batch.union(self.rt.reward_model.call("compute_rm_score", batch, balance=self.balance))
        return self.rt.reward(batch)

    def score(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        result = self.reward_of(batch)
        batch["token_level_scores"] = result.token_level_scores
        for key, values in result.extra.items():
            batch[f"reward_extra/{key}"] = list(values)
        metrics |= result.metrics
        return batch

    def fill_by_dynamic_sampling(self, batch: Batch, more_prompts: Any, timer: Timer,
                                 metrics: dict[str, float]) -> Batch:
        """DAPO: keep groups whose metric varies; generate from new prompts until the batch is full.

        Each generation batch is padded to its own longest prompt, so the kept pieces are re-padded to
        one layout (``concat_rollouts``), then trimmed to the first ``train_batch_size`` whole groups."""
        acc = self.dynamic_sampling
        acc.reset()
        kept: list[Batch] = []
        while True:
            try:
                keep = acc.add(self.group_index(batch), self.filter_metric(batch))
            except DynamicSamplingError as exc:
                raise DynamicSamplingError(f"{exc} Metrics the scores carry: {self.score_metric_names(batch)}.") from None
            kept.append(batch[keep])
            if acc.full:
                break
            with timer("gen"):
                batch = self.rollout(next(more_prompts), metrics, gen_batch=acc.num_gen_batches)
            with timer("reward"):
                batch = self.score(batch, metrics)
        full = concat_rollouts(kept, self.rt.tokenizer.pad_token_id)
        full = full[first_groups_mask(self.group_index(full), acc.target_groups)]
        metrics |= acc.metrics()
        return full

    @staticmethod
    def score_metric_names(batch: Batch) -> list[str]:
        """Per-sample metrics a group filter can read: ``score`` plus the reward's extra values."""
        return ["score"] + sorted(k.split("/", 1)[1] for k in batch.keys() if k.startswith("reward_extra/"))

    def filter_metric(self, batch: Batch) -> torch.Tensor:
        """[B] values of ``algorithm.filter_groups.metric``."""
        name = self.recipe.algorithm.filter_groups.metric
        if name in ("score", "seq_final_reward"):
            return batch["token_level_scores"].sum(-1)
        if f"reward_extra/{name}" in batch:
            return torch.tensor([float(v) for v in batch[f"reward_extra/{name}"]])
        raise DynamicSamplingError(
            f"algorithm.filter_groups.metric={name!r}: the reward manager '{self.recipe.reward.manager}' gives no "
            f"such per-sample metric; valid here: {self.score_metric_names(batch)}.")

    @staticmethod
    def group_index(batch: Batch) -> torch.Tensor:
        """uid strings → dense group ids [B] (the estimators' ``index``)."""
        _, inverse = np.unique(batch["uid"].astype(str), return_inverse=True)
        return torch.as_tensor(inverse, dtype=torch.long)

    def compute_advantage(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        algo = self.recipe.algorithm
        scores = batch["token_level_scores"]
        if algo.use_kl_in_reward:
            old = batch["old_log_prob"] if "old_log_prob" in batch else batch["rollout_log_probs"]
            rewards, kl_metrics = apply_kl_penalty(scores, old, batch["ref_log_prob"], batch["response_mask"],
                                                   self.rt.kl_ctrl, algo.kl_penalty)
            metrics |= kl_metrics
        else:
            rewards = scores
        batch["token_level_rewards"] = rewards
        est = self.rt.estimator
        otb = {"old_log_prob": batch["old_log_prob"], "sum_pi_squared": batch["sum_pi_squared"],
               "rollout_is_weights": batch["rollout_is_weights"] if "rollout_is_weights" in batch else None
               } if est.spec.needs_sum_pi_squared else {}
        advantages, returns = est.fn(
            rewards, batch["response_mask"].to(rewards.dtype), self.group_index(batch),
            values=batch["values"] if "values" in batch else None,
            reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
            **otb, **est.kwargs,
        )
        batch["advantages"] = self.hooks.advantages(advantages, self.global_step)
        batch["returns"] = returns
        return batch

    # ----- validation ---------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """mean@n / best@n of the validation data per data_source; logs a table of generations."""
        val = self.recipe.rollout.val
        sources, uids, scores, rows = [], [], [], []
        extra: dict[str, list[Any]] = {}
        for prompts in self.rt.val_loader:
            prompts["uid"] = [f"val-{len(uids) + i}" for i in range(len(prompts))]
            repeated = prompts.repeat(val.n, interleave=True)
            gen = self.rt.actor.call("generate_sequences", self.rollout_inputs(repeated), balance=False, n=1,
                                     do_sample=val.do_sample, temperature=val.temperature, top_p=val.top_p)
            gen.meta.pop("metrics", None)
            batch = repeated.select(list(repeated.non_tensors)).union(Batch(gen.tensors, {}, {}))
            result = self.reward_of(batch)
            sources += list(batch["data_source"])
            uids += list(batch["uid"])
            scores += result.token_level_scores.sum(-1).tolist()
            for key, values in result.extra.items():
                extra.setdefault(key, []).extend(values)
            if len(rows) < self.recipe.tracking.log_generations:
                rows += self.generation_rows(batch, result.token_level_scores.sum(-1))
        metrics = validation_metrics(np.array(sources, dtype=object), np.array(uids, dtype=object), scores, val.n,
                                     extra if len(next(iter(extra.values()), [])) == len(scores) else None)
        table = "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows[: self.recipe.tracking.log_generations])
        self.rt.tracking.log_text(table, f"generations/step_{self.global_step}.md")
        return metrics

    def generation_rows(self, batch: Batch, scores: torch.Tensor) -> list[str]:
        tok = self.rt.tokenizer

        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", "<br>")

        rows = []
        for i in range(len(batch)):
            prompt = tok.decode(batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()])
            response = tok.decode(batch["responses"][i][batch["response_mask"][i].bool()])
            rows.append(f"| {cell(prompt[-300:])} | {cell(response)} | {scores[i].item():.3f} |")
        return rows

    # ----- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        def write(tmp: Path) -> None:
            self.rt.save_workers(tmp)
            state = {
                "global_step": self.global_step,
                "dataloader": self.rt.train_loader.state_dict(),
                "kl_ctrl": self.rt.kl_ctrl.__dict__ if self.rt.kl_ctrl is not None else None,
                "tracker_run_ids": self.rt.tracking.run_ids(),
                "driver_rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()},
                # the generations the rollout pool made ahead (in flight ones are waited for): trained on after a resume
                "rollout_queue": self.pipe.state_dict() if self.pipe is not None else None,
            }
            torch.save(state, tmp / "trainer_state.pt")
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(self.recipe), sort_keys=False))

        path = self.checkpoints.save(self.global_step, write)
        log.info("saved checkpoint %s", path)
        return path

    def resume(self) -> bool:
        """Restore the newest (``auto``) or given checkpoint; returns whether one was loaded."""
        self.checkpoints.clean_partial()
        path = self.checkpoints.resolve_resume(self.recipe.trainer.resume)
        if path is None:
            return False
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.rt.load_workers(path)
        self.global_step = state["global_step"]
        self.rt.train_loader.load_state_dict(state["dataloader"])
        if state["kl_ctrl"] is not None and self.rt.kl_ctrl is not None:
            self.rt.kl_ctrl.__dict__.update(state["kl_ctrl"])
        torch.set_rng_state(state["driver_rng"]["torch"])
        np.random.set_state(state["driver_rng"]["numpy"])
        queued = state.get("rollout_queue")
        if self.pipe is not None and queued is not None:
            self.pipe.load_state_dict(queued)
        elif queued and queued["items"]:
            log.warning("the checkpoint holds %d batches generated ahead (trainer.mode was not sync); trainer.mode=sync "
                        "discards them: their prompts are skipped", len(queued["items"]))
        log.info("resumed from %s at step %d", path, self.global_step)
        return True

    def write_run_info(self) -> None:
        info = {"run_ids": self.rt.tracking.run_ids(), "mlflow_uri": self.rt.mlflow_uri, "started": time.time(),
                "output_dir": str(self.output_dir)}
        (self.output_dir / "run_info.json").write_text(json.dumps(info, indent=1))
