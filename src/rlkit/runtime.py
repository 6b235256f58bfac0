"""Set-up and clean-up of one run: every component the trainer's step uses, built from the recipe.

``Runtime.start(recipe, registries)`` builds, in order: output folder → tokenizer → datasets and
loaders → reward manager → trackers → Ray cluster → worker groups (actor+rollout+ref colocated in
one process, the hybrid engine; a critic when the estimator needs one). ``close()`` undoes it, and
stops only the Ray cluster it started.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlkit.algos import make_kl_controller
from rlkit.batch import Batch
from rlkit.data.dataset import RLDataset
from rlkit.data.sampler import StatefulDataLoader
from rlkit.merge import save_hf_config
from rlkit.recipe import Recipe, recipe_to_dict, uses_critic, uses_ref
from rlkit.registry import Registries, load_object
from rlkit.rewards.dispatch import make_score_fn
from rlkit.rewards.managers import manager_kwargs
from rlkit.specs import EstimatorSpec
from rlkit.tracking import TrackerConfig, Tracking, start_tracker

__all__ = ["Runtime", "output_dir_of"]

log = logging.getLogger("rlkit.runtime")


def output_dir_of(recipe: Recipe) -> Path:
    t = recipe.trainer
    return Path(t.output_dir.format(project_name=t.project_name, experiment_name=t.experiment_name)).expanduser()


@dataclass
class Runtime:
    recipe: Recipe
    registries: Registries
    output_dir: Path
    tokenizer: Any
    train_loader: StatefulDataLoader
    val_loader: StatefulDataLoader | None
    total_steps: int
    reward: Any
    estimator: EstimatorSpec
    kl_ctrl: Any
    tracking: Tracking
    mlflow_uri: str | None
    cluster: Any = None
    actor: Any = None  # WorkerGroup of the hybrid actor_rollout_ref role
    critic: Any = None
    ref: Any = None  # "colocated" when the actor process holds the reference model
    groups: list[Any] = field(default_factory=list)
    n_params: int = 0
    peak_flops: float = 0.0

    # ----- building -----------------------------------------------------------------------------
    @classmethod
    def start(cls, recipe: Recipe, registries: Registries, *, run_ids: dict[str, str] | None = None) -> Runtime:
        from rlkit.models.load import load_tokenizer

        out = output_dir_of(recipe)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = load_tokenizer(recipe.model)
        train_loader, val_loader = _loaders(recipe, tokenizer)
        per_epoch = len(train_loader)
        total_steps = recipe.trainer.total_steps or per_epoch * recipe.trainer.total_epochs
        tracking, mlflow_uri = _tracking(recipe, registries, out, total_steps, run_ids or {})
        tracking.log_params(recipe_to_dict(recipe))
        rt = cls(
            recipe=recipe, registries=registries, output_dir=out, tokenizer=tokenizer,
            train_loader=train_loader, val_loader=val_loader, total_steps=total_steps,
            reward=_reward_manager(recipe, registries, tokenizer),
            estimator=registries.estimators.get(recipe.algorithm.estimator),
            kl_ctrl=_kl_controller(recipe), tracking=tracking, mlflow_uri=mlflow_uri,
        )
        try:
            rt._start_workers()
        except BaseException as exc:
            rt.close(status="KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        return rt

    def _start_workers(self) -> None:
        from rlkit.workers import RayCluster, ResourcePoolManager, WorkerGroup

        recipe, registries = self.recipe, self.registries
        self.cluster = RayCluster(recipe.resources).start()
        pools = ResourcePoolManager(recipe.resources)
        threads = recipe.resources.threads_per_worker
        with_ref = uses_ref(recipe)
        actor_cls = load_object(registries.roles.get("actor_rollout_ref").cls)
        actor_kwargs = {
            "model_config": recipe.model, "actor_config": recipe.actor, "rollout_config": recipe.rollout,
            "ref_config": recipe.ref if with_ref else None, "max_response_length": recipe.data.max_response_length,
            "total_steps": self.total_steps, "seed": recipe.trainer.seed,
        }
        self.actor = WorkerGroup(actor_cls, pools.pool_for("actor_rollout_ref"), role="actor_rollout_ref",
                                 threads=threads, role_kwargs=actor_kwargs)
        self.groups.append(self.actor)
        self.ref = "colocated" if with_ref else None
        if uses_critic(recipe, registries):
            critic_cls = load_object(registries.roles.get("critic").cls)
            critic_pool = pools.pool_for("critic")
            share = 0.5 if critic_pool is pools.pool_for("actor_rollout_ref") else 1.0  # two roles on one bundle
            critic_kwargs = {
                "model_config": recipe.model, "critic_config": recipe.critic, "rollout_n": recipe.rollout.n,
                "ppo_mini_batch_size": recipe.critic.ppo_mini_batch_size or recipe.actor.ppo_mini_batch_size,
                "total_steps": self.total_steps, "mixed_precision": recipe.actor.mixed_precision,
                "seed": recipe.trainer.seed,
            }
            self.critic = WorkerGroup(critic_cls, critic_pool, role="critic", threads=threads, share=share,
                                      role_kwargs=critic_kwargs)
            self.groups.append(self.critic)
        self.n_params = int(self.actor.call("num_params", dispatch="rank0"))
        self.peak_flops = _matmul_peak_flops(recipe.actor.mixed_precision, threads) * self.actor.world_size
        # Which processes this run owns (docs/reliability.md: nothing survives a killed driver).
        info = self.cluster.describe() | {"worker_pids": {g.role: g.pids() for g in self.groups}}
        self.cluster.watch_owned()  # the agents and workers, now that they run (a killed driver's reaper kills them)
        (self.output_dir / "ray_session.json").write_text(json.dumps(info, indent=1))

    # ----- calls the trainer makes --------------------------------------------------------------
    def ref_call(self, method: str, batch: Batch) -> Batch:
        return self.actor.call(method, batch, balance=self.recipe.trainer.balance_batch)

    def train_batches(self) -> Iterator[Batch]:
        """Batches forever: epoch after epoch (the loader's state says where a resumed run is)."""
        while True:
            yield from self.train_loader

    def save_workers(self, directory: Path) -> None:
        """Each role writes its own sub-folders (actor/, rollout/, critic/); hf_config/ lets merge rebuild the model."""
        self.actor.call("save_checkpoint", dispatch="all", directory=str(directory))
        if self.critic is not None:
            self.critic.call("save_checkpoint", dispatch="all", directory=str(directory))
        save_hf_config(self.recipe.model, self.tokenizer, directory / "hf_config")

    def load_workers(self, directory: Path) -> None:
        self.actor.call("load_checkpoint", dispatch="all", directory=str(directory))
        if self.critic is not None:
            self.critic.call("load_checkpoint", dispatch="all", directory=str(directory))

    def perf_metrics(self, batch: Batch, times: dict[str, float]) -> dict[str, float]:
        """perf/mfu/actor: 6·N·tokens·epochs FLOPs of the update over its time, against the measured peak."""
        seconds = times.get("update_actor", 0.0)
        if not seconds or not self.peak_flops:
            return {}
        tokens = float(batch["attention_mask"].sum())
        flops = 6.0 * self.n_params * tokens * self.recipe.actor.ppo_epochs
        return {"perf/mfu/actor": flops / seconds / self.peak_flops}

    def owned_processes(self) -> list[Any]:
        """``psutil.Process`` of every process this run started (a stop kills them by pid): the Ray
        cluster's, when rlkit started it, with its agents and workers."""
        return self.cluster.owned_processes() if self.cluster is not None else []

    def close(self, status: str = "FINISHED") -> None:
        """Undo ``start``. ``KILLED`` (a stop signal) kills the workers at once instead of letting them
        leave their process groups, and marks the tracking run before Ray goes down."""
        killed = status == "KILLED"
        for group in reversed(self.groups):
            try:
                group.kill() if killed else group.shutdown()
            except Exception as exc:  # noqa: BLE001 - keep closing the rest
                log.warning("could not shut down %s: %s", group, exc)
        self.groups.clear()
        close_reward = getattr(self.reward, "close", None)
        if close_reward:
            close_reward()
        if killed:
            self.tracking.finish(status)
        if self.cluster is not None:
            self.cluster.stop(grace_s=1.0 if killed else 2.0)
            self.cluster = None
        if not killed:
            self.tracking.finish(status)


def _loaders(recipe: Recipe, tokenizer: Any) -> tuple[StatefulDataLoader, StatefulDataLoader | None]:
    data = recipe.data

    def dataset(files: list[str]) -> RLDataset:
        return RLDataset(files, tokenizer, prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                         prompt_length_policy=data.prompt_length_policy)

    train = StatefulDataLoader(dataset(data.train_files), data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    val = None
    if data.val_files:
        val_set = dataset(data.val_files)
        val = StatefulDataLoader(val_set, data.val_batch_size or len(val_set), shuffle=False, drop_last=False)
    return train, val


def _reward_manager(recipe: Recipe, registries: Registries, tokenizer: Any) -> Any:
    reward = recipe.reward
    cls = load_object(registries.reward_managers.get(reward.manager).cls)
    custom = reward.custom_score.model_dump() if reward.custom_score else None
    score_fn = make_score_fn(registries, custom, batch_call=reward.manager == "batch")
    kwargs = manager_kwargs(cls, num_examine=reward.num_examine, default_score=reward.default_score,
                            timeout_s=reward.timeout_s, num_workers=reward.num_workers,
                            overlong_buffer=reward.overlong_buffer.model_dump(),
                            max_response_length=recipe.data.max_response_length)
    return cls(tokenizer, score_fn, **kwargs)


def _kl_controller(recipe: Recipe) -> Any:
    if not recipe.algorithm.use_kl_in_reward:
        return None
    ctrl = recipe.algorithm.kl_ctrl
    return make_kl_controller(ctrl.type, kl_coef=ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)


def _tracking(recipe: Recipe, registries: Registries, out: Path, total_steps: int,
              run_ids: dict[str, str]) -> tuple[Tracking, str | None]:
    cfg = TrackerConfig(
        project=recipe.trainer.project_name, experiment=recipe.trainer.experiment_name, output_dir=out,
        total_steps=total_steps, mlflow_uri=recipe.tracking.mlflow_uri,
        jsonl_path=Path(recipe.tracking.jsonl_path) if recipe.tracking.jsonl_path else None, run_ids=run_ids,
    )
    trackers = [start_tracker(load_object(registries.trackers.get(name).cls), cfg) for name in recipe.tracking.backends]
    mlflow_uri = next((getattr(t, "uri", None) for t in trackers if getattr(t, "name", "") == "mlflow"), None)
    return Tracking(trackers), mlflow_uri


def _matmul_peak_flops(mixed_precision: str, threads: int, size: int = 1024) -> float:
    """Measured matmul FLOP/s of one worker's thread count on this machine (CPU); 0 on failure."""
    if torch.cuda.is_available():
        return 0.0  # GPU peak is not measured here; mfu is reported on CPU only
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        import time

        start = time.perf_counter()
        reps = 3
        for _ in range(reps):
            a @ b
        seconds = time.perf_counter() - start
        return 2.0 * size**3 * reps / seconds
    except RuntimeError:
        return 0.0
    finally:
        torch.set_num_threads(previous)
