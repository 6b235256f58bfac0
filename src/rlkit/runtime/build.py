"""Set-up and clean-up of one run: every component the trainer's step uses, built from the recipe.

``Runtime.start(recipe, registries)`` builds, in order: the pipeline (``rlkit.recipe.compose.compose``:
every name resolved once, here on the driver) → output folder → what ``auto`` precision and threads
mean on this machine (``rlkit.hardware``; printed, logged as ``resolved.*``, passed to the workers as
concrete values) → tokenizer → datasets and loaders →
reward step → trackers → Ray cluster → one worker group per placed role (the hybrid actor-rollout-ref,
and a rollout pool, a separate ref, a critic, a reward model when the recipe asks). Roles on one pool share
its bundles equally. ``close()`` undoes it, and stops only the Ray cluster it started.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rlkit.algos import make_kl_controller
from rlkit.batch import Batch
from rlkit.data.dataset import RLDataset
from rlkit.data.environment import write_environment_rows
from rlkit.data.sampler import StatefulDataLoader
from rlkit.hardware import RunHardware, matmul_flops, plan_run, warn_once
from rlkit.hardware.allocator import check_workers
from rlkit.plugin.registry import Registries, load_object
from rlkit.recipe import Recipe, recipe_to_dict, uses_ref
from rlkit.recipe.compose import Pipeline, PlacedRole, Resolved, compose
from rlkit.rewards.dispatch import make_score_fn
from rlkit.rewards.environment import EnvironmentScore
from rlkit.rewards.steps import OverlongShaping, RewardStep
from rlkit.runtime.merge import save_hf_config
from rlkit.runtime.tracking import TrackerConfig, Tracking, start_tracker

__all__ = ["Runtime", "output_dir_of"]

log = logging.getLogger("rlkit.runtime.build")


def output_dir_of(recipe: Recipe) -> Path:
    t = recipe.trainer
    return Path(
        t.output_dir.format(project_name=t.project_name, experiment_name=t.experiment_name)
    ).expanduser()


@dataclass
class Runtime:
    recipe: Recipe
    pipeline: Pipeline
    output_dir: Path
    tokenizer: Any
    train_loader: StatefulDataLoader
    val_loader: StatefulDataLoader | None
    total_steps: int
    reward: RewardStep
    estimator: Resolved
    kl_ctrl: Any
    tracking: Tracking
    mlflow_uri: str | None
    cluster: Any = None
    actor: Any = None  # WorkerGroup of the hybrid actor_rollout_ref role
    rollout: Any = None  # WorkerGroup of the rollout role (trainer.mode one_step_off / async), else None
    critic: Any = None
    ref: Any = None  # a WorkerGroup, or "colocated" when the actor process holds the reference model
    reward_model: Any = None
    groups: list[Any] = field(default_factory=list)
    n_params: int = 0
    peak: Any = None  # rlkit.model.flops.Peak of one actor rank (None: unknown, no perf/mfu/actor)
    hardware: RunHardware | None = None  # what the recipe's ``auto`` precision and threads became here
    driver_threads: int | None = None  # the driver's torch threads before the workers started

    # ----- building -----------------------------------------------------------------------------
    @classmethod
    def start(
        cls, recipe: Recipe, registries: Registries, *, run_ids: dict[str, str] | None = None
    ) -> Runtime:
        from rlkit.model.load import load_tokenizer

        pipeline = compose(recipe, registries)
        out = output_dir_of(recipe)
        out.mkdir(parents=True, exist_ok=True)
        hw = _plan_hardware(recipe, pipeline)
        tokenizer = load_tokenizer(recipe.model)
        train_loader, val_loader = _loaders(recipe, tokenizer, pipeline, out)
        per_epoch = len(train_loader)
        total_steps = recipe.trainer.total_steps or per_epoch * recipe.trainer.total_epochs
        tracking, mlflow_uri = _tracking(recipe, pipeline, out, total_steps, run_ids or {})
        peak = _actor_peak(recipe, hw)
        resolved = hw.params() | (peak.params() if peak else {})
        tracking.log_params(recipe_to_dict(recipe) | {"resolved": resolved})
        rt = cls(
            recipe=recipe,
            pipeline=pipeline,
            output_dir=out,
            tokenizer=tokenizer,
            train_loader=train_loader,
            val_loader=val_loader,
            total_steps=total_steps,
            reward=_reward_step(recipe, pipeline, tokenizer),
            estimator=pipeline.estimator,
            kl_ctrl=_kl_controller(recipe),
            tracking=tracking,
            mlflow_uri=mlflow_uri,
            hardware=hw,
            peak=peak,
        )
        try:
            rt._start_workers()
        except BaseException as exc:
            rt.close(status="KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        return rt

    def _start_workers(self) -> None:
        from rlkit.workers import RayCluster, ResourcePoolManager, WorkerGroup
        from rlkit.workers.cluster import local_node

        recipe = self.recipe
        pools = ResourcePoolManager(recipe.resources)
        placed = self.pipeline.roles
        per_pool: dict[str, int] = {}
        roles_by_pool: dict[str, list[str]] = {}
        for role in placed.values():
            per_pool[role.pool] = per_pool.get(role.pool, 0) + 1
            roles_by_pool.setdefault(role.pool, []).append(role.role.name)
        # A placement that can never fit fails at once, naming pools, roles and resources: before a local
        # cluster starts (against the node it would be), and against the live nodes once connected.
        if recipe.resources.ray_address is None and not _ray_running():
            pools.check(roles_by_pool, nodes={"local": local_node(recipe.resources)})
        self.cluster = RayCluster(recipe.resources).start()
        pools.check(roles_by_pool)
        groups = {}
        # the actor first: its ranks set the pace
        for slot in ("actor_rollout_ref", "rollout", "ref", "critic", "reward_model"):
            role = placed.get(slot)
            if role is None:
                continue
            pool = pools.pools[role.pool].create(roles=roles_by_pool[role.pool])
            groups[slot] = WorkerGroup(
                load_object(role.role.spec.cls),
                pool,
                role=role.role.name,
                threads=self.hardware.threads[slot],
                share=1.0 / per_pool[role.pool],
                role_kwargs=self._role_kwargs(role),
                env_vars=self.hardware.allocator.env,
            )
            self.groups.append(groups[slot])
        self._check_allocator()
        self.actor = groups["actor_rollout_ref"]
        self.critic = groups.get("critic")
        self.rollout = groups.get("rollout")
        self.reward_model = groups.get("reward_model")
        self.ref = groups.get("ref") or ("colocated" if uses_ref(recipe) else None)
        self.n_params = int(self.actor.call("num_params", dispatch="rank0"))
        # The workers own the cores now; the driver's own work (advantages, batching) is small.
        self.driver_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        # Which processes this run owns (docs/reliability.md: nothing survives a killed driver).
        info = self.cluster.describe() | {"worker_pids": {g.role: g.pids() for g in self.groups}}
        # the agents and workers, now that they run (a killed driver's reaper kills them)
        self.cluster.watch_owned()
        (self.output_dir / "ray_session.json").write_text(json.dumps(info, indent=1))

    def _check_allocator(self) -> None:
        """Ask the workers whether they started with the allocator's environment; log the answer and keep
        the plan as it took effect (``rlkit.hardware.allocator.check_workers``)."""
        if self.hardware.allocator.env:
            started, plan = check_workers(self.hardware.allocator, self.groups)
            self.tracking.log_params({"resolved": {"allocator_in_workers": started}})
            self.hardware = replace(self.hardware, allocator=plan)

    def _role_kwargs(self, placed: PlacedRole) -> dict[str, Any]:
        """The keyword arguments of the role class filling ``placed.slot`` (the slot's contract,
        ``rlkit.plugin.protocols``): recipe sections and the resolved components that slot uses."""
        recipe, pipe = self.recipe, self.pipeline
        precision = self.hardware.precision.mixed_precision  # concrete: workers never see ``auto``
        if placed.slot == "actor_rollout_ref":
            colocated_ref = uses_ref(recipe) and pipe.role("ref") is None
            return {
                "model_config": recipe.model,
                "actor_config": recipe.actor.model_copy(update={"mixed_precision": precision}),
                "rollout_config": recipe.rollout,
                "ref_config": recipe.ref if colocated_ref else None,
                "max_response_length": recipe.data.max_response_length,
                "total_steps": self.total_steps,
                "seed": recipe.trainer.seed,
                "policy_loss": pipe.policy_loss,
                "rollout_backend": _concrete_backend(pipe.rollout_backend, self.hardware),
                "agent_loops": dict(pipe.agent_loops),
                "default_agent": pipe.default_agent,
                "tools": pipe.tools,
            }
        if placed.slot == "rollout":
            return {
                "model_config": recipe.model,
                "rollout_config": recipe.rollout,
                "max_response_length": recipe.data.max_response_length,
                "seed": recipe.trainer.seed,
                "rollout_backend": _concrete_backend(pipe.rollout_backend, self.hardware),
                "agent_loops": dict(pipe.agent_loops),
                "default_agent": pipe.default_agent,
                "tools": pipe.tools,
                "lora": recipe.actor.lora,
            }
        if placed.slot == "ref":
            return {
                "model_config": recipe.model,
                "ref_config": recipe.ref,
                "temperature": recipe.rollout.temperature,
                "mixed_precision": precision,
            }
        if placed.slot == "critic":
            return {
                "model_config": recipe.model,
                "critic_config": recipe.critic,
                "rollout_n": recipe.rollout.n,
                "ppo_mini_batch_size": recipe.critic.ppo_mini_batch_size or recipe.actor.ppo_mini_batch_size,
                "total_steps": self.total_steps,
                "mixed_precision": precision,
                "seed": recipe.trainer.seed,
            }
        rm = recipe.reward.reward_model
        return {
            "model_config": recipe.model,
            "reward_model_path": rm.path,
            "micro_batch_size": rm.micro_batch_size_per_rank,
            "mixed_precision": precision,
        }

    # ----- calls the trainer makes --------------------------------------------------------------
    def ref_call(self, method: str, batch: Batch) -> Batch:
        group = self.actor if self.ref == "colocated" else self.ref
        return group.call(method, batch, balance=self.recipe.trainer.balance_batch)

    def train_batches(self) -> Iterator[Batch]:
        """Batches forever: epoch after epoch (the loader's state says where a resumed run is)."""
        while True:
            yield from self.train_loader

    def save_workers(self, directory: Path) -> None:
        """Each role writes its own sub-folders (actor/, rollout/, rollout_worker/, critic/); hf_config/ lets
        merge rebuild the model."""
        self.actor.call("save_checkpoint", dispatch="all", directory=str(directory))
        if self.rollout is not None:
            self.rollout.call("save_checkpoint", dispatch="all", directory=str(directory))
        if self.critic is not None:
            self.critic.call("save_checkpoint", dispatch="all", directory=str(directory))
        save_hf_config(self.recipe.model, self.tokenizer, directory / "hf_config")

    def load_workers(self, directory: Path) -> None:
        self.actor.call("load_checkpoint", dispatch="all", directory=str(directory))
        if self.rollout is not None:
            self.rollout.call("load_checkpoint", dispatch="all", directory=str(directory))
        if self.critic is not None:
            self.critic.call("load_checkpoint", dispatch="all", directory=str(directory))

    def perf_metrics(
        self, batch: Batch, times: dict[str, float], update: dict[str, float]
    ) -> dict[str, float]:
        """perf/mfu/actor: the update's executed FLOPs (``perf/flops/actor``, counted by the actor ranks in
        the layouts they ran: ``rlkit.model.flops``) over the driver's ``update_actor`` time and the stated
        peak of all actor ranks (``Runtime.peak`` × ranks). Absent where the peak is unknown (an unlisted
        GPU)."""
        seconds = times.get("update_actor", 0.0)
        executed = update.get("perf/flops/actor", 0.0)
        if not seconds or not executed or self.peak is None:
            return {}
        return {"perf/mfu/actor": executed / seconds / (self.peak.flops * self.actor.world_size)}

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
        self.reward.close()
        if self.driver_threads is not None:
            torch.set_num_threads(self.driver_threads)
            self.driver_threads = None
        if killed:
            self.tracking.finish(status)
        if self.cluster is not None:
            self.cluster.stop(grace_s=1.0 if killed else 2.0)
            self.cluster = None
        if not killed:
            self.tracking.finish(status)


def _loaders(
    recipe: Recipe, tokenizer: Any, pipeline: Pipeline, out: Path
) -> tuple[StatefulDataLoader, StatefulDataLoader | None]:
    """The train (and val) loaders: over data.train_files / val_files, or over the rows data.environment gives
    (written once to ``<output_dir>/environment/``, rlkit.data.environment)."""
    data = recipe.data
    train_files, val_files = data.train_files, data.val_files
    if pipeline.environment is not None:
        train_files, val_files = write_environment_rows(pipeline.environment, out / "environment")

    def dataset(files: list[str]) -> RLDataset:
        return RLDataset(
            files,
            tokenizer,
            prompt_key=data.prompt_key,
            max_prompt_length=data.max_prompt_length,
            prompt_length_policy=data.prompt_length_policy,
        )

    train = StatefulDataLoader(
        dataset(train_files), data.train_batch_size, shuffle=data.shuffle, seed=data.seed
    )
    val = None
    if val_files:
        val_set = dataset(val_files)
        val = StatefulDataLoader(val_set, data.val_batch_size or len(val_set), shuffle=False, drop_last=False)
    return train, val


def _reward_step(recipe: Recipe, pipeline: Pipeline, tokenizer: Any) -> RewardStep:
    """The reward manager the recipe names, then the reward-model and overlong steps it turns on."""
    reward = recipe.reward
    spec = pipeline.reward_manager.spec
    custom = reward.custom_score.model_dump() if reward.custom_score else None
    rm = reward.reward_model
    fallback = rm.enable and rm.combine == "fallback"
    sources = dict(pipeline.score_fns)
    if pipeline.environment is not None:  # its rows' data_source is its name: the environment scores them
        sources[pipeline.environment.name] = EnvironmentScore(pipeline.environment)
    score_fn = make_score_fn(
        sources, custom, batch_call=spec.batched_scores, unknown_score=0.0 if fallback else None
    )
    manager = pipeline.reward_manager.build(
        tokenizer,
        score_fn,
        num_examine=reward.num_examine,
        default_score=reward.default_score,
        timeout_s=reward.timeout_s,
    )
    overlong = None
    if reward.overlong_buffer.enable:
        ob = reward.overlong_buffer
        overlong = OverlongShaping(ob.len, ob.penalty_factor, recipe.data.max_response_length)
    has_rule = getattr(score_fn, "has_rule", None)
    return RewardStep(
        manager,
        reward_model=rm.combine if rm.enable else None,
        has_rule=has_rule,
        overlong=overlong,
        max_error_fraction=reward.max_error_fraction,
    )


def _kl_controller(recipe: Recipe) -> Any:
    if not recipe.algorithm.use_kl_in_reward:
        return None
    ctrl = recipe.algorithm.kl_ctrl
    return make_kl_controller(ctrl.type, kl_coef=ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)


def _tracking(
    recipe: Recipe, pipeline: Pipeline, out: Path, total_steps: int, run_ids: dict[str, str]
) -> tuple[Tracking, str | None]:
    cfg = TrackerConfig(
        project=recipe.trainer.project_name,
        experiment=recipe.trainer.experiment_name,
        output_dir=out,
        total_steps=total_steps,
        mlflow_uri=recipe.tracking.mlflow_uri,
        jsonl_path=Path(recipe.tracking.jsonl_path) if recipe.tracking.jsonl_path else None,
        run_ids=run_ids,
    )
    trackers = [start_tracker(load_object(t.spec.cls), cfg, t.params) for t in pipeline.trackers]
    mlflow_uri = next((getattr(t, "uri", None) for t in trackers if getattr(t, "name", "") == "mlflow"), None)
    return Tracking(trackers), mlflow_uri


def _ray_running() -> bool:
    """Whether this process is already connected to Ray (a test session's cluster, used as it is)."""
    import ray

    return ray.is_initialized()


def _actor_peak(recipe: Recipe, hw: RunHardware) -> Any:
    """The stated peak of one actor rank (``rlkit.model.flops.stated_peak``) in the run's resolved precision;
    on a CPU a best-of-3 1024² matmul probe on the worker's threads stands in where it beats the stated
    figure."""
    from rlkit.model.flops import stated_peak
    from rlkit.workers.pools import resolve_device

    device = resolve_device(recipe.resources.device)
    precision = hw.precision.mixed_precision
    threads = hw.threads["actor_rollout_ref"]
    probe = 0.0
    if not device.startswith("cuda"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        probe = max(
            matmul_flops(dtype, size=1024, threads=threads, budget_s=0.0, max_reps=3) for _ in range(3)
        )
    peak = stated_peak(device, precision, threads, probe=probe)
    if peak is None:
        log.info("no stated peak for %s (%s): perf/mfu/actor is not reported", device, precision)
    return peak


def _plan_hardware(recipe: Recipe, pipeline: Pipeline) -> RunHardware:
    """Resolve ``auto`` precision and threads once, print the choice, warn (once) about slow or crowded
    set-ups."""
    from rlkit.rollout.graph_probe import model_choice
    from rlkit.workers.pools import resolve_device

    backend = pipeline.rollout_backend
    decode = getattr(backend.params, "dtype", None)  # a backend with a decode-dtype parameter (hf)
    hf = backend.name == "hf"  # fbgemm fp16 weights are its own (an engine plugin's dtype is its engine's)
    sharded = _hybrid_ranks(recipe, pipeline) if hf else 0
    hw = plan_run(
        recipe,
        device=resolve_device(recipe.resources.device),
        placed={slot: role.pool for slot, role in pipeline.roles.items()},
        decode_dtype=decode,
        layer=(lambda: _decoder_layer(recipe)) if hf and sharded <= 1 else None,
        # a sharded hybrid actor decodes its own module with torch (validation refuses onnxruntime there)
        decode_linears=("torch" if sharded > 1 else backend.params.linears) if hf else None,
        graph=functools.partial(model_choice, recipe.model) if _graph_decodes(recipe, hf, sharded) else None,
    )
    if sharded > 1 and decode == "auto":  # no decode copy of an FSDP-sharded module: say what it decodes in
        own = recipe.model.dtype
        reason = (
            f"the hybrid actor is FSDP-sharded over {sharded} ranks and decodes with its own {own} weights"
        )
        hw = replace(hw, precision=replace(hw.precision, decode_dtype=own, decode_reason=reason))
    print(hw.summary(), flush=True)
    for message in hw.precision.warnings:
        log.warning(message)
    warn_once("oversubscribed", hw.oversubscribed)
    return hw


def _hybrid_ranks(recipe: Recipe, pipeline: Pipeline) -> int:
    """Ranks of the hybrid actor that generates (sync mode; above 1 its module is FSDP-sharded and the hf
    backend decodes it in its own dtype: validation refuses an explicit bfloat16/float16 there); 0 where a
    rollout pool generates (each rank a plain copy: rlkit.workers.rollout_worker)."""
    if recipe.trainer.mode != "sync":
        return 0
    pool = recipe.resources.pools[pipeline.roles["actor_rollout_ref"].pool]
    return pool.nodes * pool.bundles_per_node


def _graph_decodes(recipe: Recipe, hf: bool, sharded: int) -> bool:
    """Whether the hf backend could decode this policy as one ONNX Runtime graph (``rlkit.rollout.ort_step``):
    an unsharded fp32 module without a LoRA adapter (the architecture is the probe's to check)."""
    return hf and sharded <= 1 and recipe.actor.lora is None and recipe.model.dtype == "float32"


def _decoder_layer(recipe: Recipe):
    """The policy's decoder-layer linears (``rlkit.hardware.fp16.layer_shapes``) from its config, which
    ``auto`` asks for only on a CPU without fast bf16; None where the config does not say."""
    from transformers import AutoConfig

    from rlkit.hardware import layer_shapes
    from rlkit.model.load import resolve_model_path

    model = recipe.model
    config = AutoConfig.from_pretrained(
        resolve_model_path(model.path), trust_remote_code=model.trust_remote_code
    )
    return layer_shapes(config.to_dict())


def _concrete_backend(backend: Resolved, hw: RunHardware) -> Resolved:
    """The rollout backend with ``dtype: auto`` and ``linears: auto`` replaced by what ``hw`` resolved
    (workers never see ``auto``)."""
    if hw.precision.decode_dtype is None or getattr(backend.params, "dtype", None) is None:
        return backend
    update = {"dtype": hw.precision.decode_dtype}
    if hw.precision.decode_linears is not None and hasattr(backend.params, "linears"):
        update["linears"] = hw.precision.decode_linears
    return replace(backend, params=backend.params.model_copy(update=update))
