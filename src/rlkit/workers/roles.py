"""The Ray-facing role classes: one instance per rank, built by ``WorkerGroup`` on a resource pool.

Every class takes the ``Worker`` arguments ``(rank, world_size, master_addr, master_port, device,
threads)`` then keyword-only recipe sections (pydantic objects, picklable) and scalars. Methods whose
first argument is a ``Batch`` are meant for ``dispatch="split"`` (each rank gets its part, results are
concatenated in the original order); the others for ``dispatch="all"`` / ``"rank0"``. Update methods
return the same metrics dict on every rank (already reduced over ranks).

- ``ActorRolloutRefWorker`` (roles actor_rollout_ref, actor, rollout): the hybrid engine. The actor's
  FSDP2 module, the HF rollout (sharing that module: no weight copy) and, when ``ref_config`` is given,
  a frozen reference copy live in one process. ``actor_config=None`` makes a rollout-only worker that
  loads its own sharded copy and receives weights through ``update_rollout_weights(state_dict)``;
  ``rollout_config=None`` an actor without rollout.
- ``CriticWorker`` (critic), ``RefWorker`` (ref), ``RewardModelWorker`` (reward_model).

Checkpoints: ``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` on every rank (``dispatch="all"``);
each role writes its own sub-folder (``actor/``, ``critic/``...) holding DCP shards of model and
optimizer and one file per rank with scheduler, counters and RNG states.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.model.state_file import load_state_file
from rlkit.recipe.compose import Resolved
from rlkit.recipe.schema import ActorConfig, CriticConfig, ModelConfig, RefConfig, RolloutConfig
from rlkit.workers.base import Worker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RefWorker", "RewardModelWorker"]


class ActorRolloutRefWorker(Worker):
    """Actor + rollout + optional reference in one process (veRL's hybrid engine)."""

    def __init__(
        self,
        rank,
        world_size,
        master_addr,
        master_port,
        device,
        threads=1,
        *,
        model_config: ModelConfig,
        actor_config: ActorConfig | None = None,
        rollout_config: RolloutConfig | None = None,
        ref_config: RefConfig | None = None,
        max_response_length: int = 512,
        total_steps: int = 1,
        seed: int = 1,
        policy_loss: Resolved | None = None,
        rollout_backend: Resolved | None = None,
        agent_loops: dict[str, Resolved] | None = None,
        default_agent: str | None = None,
        tools: tuple[Resolved, ...] = (),
    ):
        """``max_response_length``: ``data.max_response_length``; ``total_steps``: LR-schedule length;
        ``seed``: ``trainer.seed`` (model init is the same on every rank; sampling is seeded by rank).
        The resolved components (``rlkit.recipe.compose``) come from the driver: ``policy_loss`` (with an
        actor), ``rollout_backend``, ``agent_loops``/``default_agent``/``tools`` (with a rollout)."""
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        from rlkit.model.load import load_tokenizer

        if actor_config is None and rollout_config is None and ref_config is None:
            raise WorkerError(
                "ActorRolloutRefWorker needs at least one of actor_config, rollout_config, ref_config."
            )
        self.model_config = model_config
        self.tokenizer = load_tokenizer(model_config)
        temperature = rollout_config.temperature if rollout_config is not None else 1.0
        self.actor = self.rollout = self.ref = None
        if actor_config is not None:
            self.actor = self._build_actor(
                actor_config, policy_loss, rollout_config, total_steps, temperature, seed
            )
        self.backend_spec = rollout_backend.spec if rollout_backend is not None else None
        if rollout_config is not None:
            self.rollout = self._build_rollout(
                rollout_config,
                rollout_backend,
                max_response_length,
                seed * 1000 + rank,
                agent_loops,
                default_agent,
                tools,
            )
        if ref_config is not None:
            self.ref = self._build_ref(ref_config, actor_config, temperature)

    def _build_actor(self, actor_config, policy_loss, rollout_config, total_steps, temperature, seed):
        from rlkit.workers.actor import FSDPActor

        if policy_loss is None:
            raise WorkerError("ActorRolloutRefWorker with an actor needs policy_loss (a resolved component).")
        return FSDPActor(
            self.model_config,
            actor_config,
            policy_loss,
            rollout_n=rollout_config.n if rollout_config else 1,
            total_steps=total_steps,
            device=self.device,
            temperature=temperature,
            log_prob_micro_batch_size=(
                rollout_config.log_prob_micro_batch_size_per_rank if rollout_config else 8
            ),
            tokenizer=self.tokenizer,
            seed=seed,
        )

    def _build_rollout(
        self, rollout_config, rollout_backend, max_response_length, seed, agent_loops, default_agent, tools
    ):
        """The backend over the actor's module (or a module of its own without an actor), wrapped in the agent
        loops where the recipe has a default agent (multi-turn)."""
        from rlkit.model import fsdp
        from rlkit.model.load import load_model

        if rollout_backend is None:
            raise WorkerError(
                "ActorRolloutRefWorker with a rollout needs rollout_backend (a resolved component)."
            )
        if self.actor is not None:
            module = self.actor.module
        else:
            module = fsdp.fsdp_wrap(load_model(self.model_config, tokenizer=self.tokenizer), self.device)
        from rlkit.rollout.agent import build_rollout  # under agent loops where the recipe is multi-turn

        return build_rollout(
            rollout_backend,
            module,
            self.tokenizer,
            rollout_config=rollout_config,
            max_response_length=max_response_length,
            device=self.device,
            seed=seed,
            agent_loops=agent_loops,
            default_agent=default_agent,
            tools=tools,
        )

    def _build_ref(self, ref_config, actor_config, temperature):
        """A LoRA actor's base (its adapter off, no copy), else a module of its own."""
        if self.actor is not None and self.actor.peft_model is not None:
            from rlkit.model.lora import LoraRef

            return LoraRef(self.actor, ref_config, temperature=temperature)
        from rlkit.workers.ref import FSDPRef

        return FSDPRef(
            self.model_config,
            ref_config,
            device=self.device,
            temperature=temperature,
            mixed_precision=actor_config.mixed_precision if actor_config else "fp32",
            tokenizer=self.tokenizer,
        )

    def _need(self, part: str):
        obj = getattr(self, part)
        if obj is None:
            raise WorkerError(
                f"this ActorRolloutRefWorker was built without its {part} (pass {part}_config)."
            )
        return obj

    # ----- rollout ------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Batch, **sampling) -> Batch:
        """Responses for ``prompts`` (``input_ids``, ``attention_mask`` [B, P]); ``sampling`` overrides
        ``n, temperature, top_p, top_k, max_new_tokens, do_sample, stop``. Returns ``B * n`` rows in
        the layout of ``rlkit.rollout.base``. A split ``WorkerGroup`` call must return one row per input:
        send ``prompts.repeat(n, interleave=True)`` with ``n=1`` (same order, and balanced across ranks)."""
        start = time.perf_counter()
        rollout = self._need("rollout")
        self._wake_engine()
        try:
            out = rollout.generate(prompts, **sampling)
        finally:
            self._sleep_engine()
        out.meta.setdefault("metrics", {})["perf/worker_s/gen"] = time.perf_counter() - start
        return out.to("cpu")  # the driver's side of every role call is host memory

    def sync_weights(self) -> None:
        """Hand the actor's current weights to the rollout (shared module here: nothing is copied)."""
        self._wake_engine()  # an engine must hold its memory again before it can load weights
        self._need("rollout").update_weights(self._need("actor").module)

    # An engine with its own accelerator memory (SGLang: release/resume_memory) holds it only from the
    # weight sync through generation, so the colocated actor update can use it (veRL's wake/sleep).
    def _engine(self):
        return getattr(self.rollout, "backend", self.rollout)  # under an agent-loop wrapper, the engine

    def _wake_engine(self) -> None:
        if getattr(self, "_engine_asleep", False):
            self._engine().resume_memory()
        self._engine_asleep = False

    def _sleep_engine(self) -> None:
        if self.backend_spec is not None and self.backend_spec.memory_release:  # declared on the spec
            self._engine().release_memory()
            self._engine_asleep = True

    def update_rollout_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Rollout-only worker: load a full state dict (rank 0's; broadcast to the other ranks)."""
        self._need("rollout").update_weights(state_dict)

    # ----- actor / ref --------------------------------------------------------------------------
    def compute_log_prob(
        self, batch: Batch, with_entropy: bool = False, with_sum_pi_squared: bool = False
    ) -> Batch:
        """``old_log_prob [B, T]`` (+ ``entropy``, ``sum_pi_squared`` [B, T]) under the current actor
        weights."""
        return (
            self._need("actor")
            .compute_log_prob(batch, with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared)
            .to("cpu")
        )

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob [B, T]`` under the frozen reference model."""
        return self._need("ref").compute_ref_log_prob(batch).to("cpu")

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One training step of the policy (``FSDPActor.update``); ``actor/*`` metrics."""
        from rlkit.hardware import gpu_memory_metrics
        from rlkit.model import fsdp

        start = time.perf_counter()
        metrics = self._need("actor").update(batch)
        seconds = fsdp.all_reduce(torch.tensor([time.perf_counter() - start]), torch.distributed.ReduceOp.MAX)
        # the slowest rank's time (same on every rank); GPU memory peaks on CUDA only (rlkit.hardware)
        return metrics | {"perf/worker_s/update_actor": float(seconds)} | gpu_memory_metrics(self.device)

    def num_params(self) -> int:
        """Parameters of the full (unsharded) actor model, for the MFU estimate."""
        return sum(p.numel() for p in self._need("actor").module.parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The actor's full HF-style state dict on CPU (rank 0; ``{}`` elsewhere): use
        ``dispatch="rank0"``."""
        return self._need("actor").full_state_dict()

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """What a rollout pool needs after an update (rank 0; ``{}`` elsewhere; collective): the full state
        dict, or with ``actor.lora`` the adapter's tensors alone (``FSDPActor.rollout_state_dict``)."""
        return self._need("actor").rollout_state_dict()

    def save_checkpoint(self, directory: str) -> None:
        if self.actor is not None:
            self.actor.save_checkpoint(Path(directory) / "actor")
        sampler = self._sampling_generator()
        if sampler is not None:
            path = Path(directory) / "rollout"
            path.mkdir(parents=True, exist_ok=True)
            torch.save(sampler.get_state(), path / f"generator_rank{self.rank}.pt")

    def load_checkpoint(self, directory: str) -> None:
        if self.actor is not None:
            self.actor.load_checkpoint(Path(directory) / "actor")
            # an engine with its own copy of the weights (vllm, sglang) gets the restored ones
            if self.rollout is not None:
                self.sync_weights()
        path = Path(directory) / "rollout" / f"generator_rank{self.rank}.pt"
        sampler = self._sampling_generator()
        if sampler is not None and path.exists():
            sampler.set_state(load_state_file(path))

    def _sampling_generator(self) -> torch.Generator | None:
        """The rollout's torch RNG (under an agent-loop wrapper, its backend's), saved for exact resume."""
        backend = getattr(self.rollout, "backend", self.rollout)
        generator = getattr(backend, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def destroy(self) -> None:
        self.actor = self.rollout = self.ref = None
        super().destroy()


class CriticWorker(Worker):
    """The value model (``FSDPCritic``) of one rank."""

    def __init__(
        self,
        rank,
        world_size,
        master_addr,
        master_port,
        device,
        threads=1,
        *,
        model_config: ModelConfig,
        critic_config: CriticConfig,
        rollout_n: int,
        ppo_mini_batch_size: int,
        total_steps: int = 1,
        mixed_precision: str = "fp32",
        seed: int = 1,
    ):
        """``ppo_mini_batch_size``: ``actor.ppo_mini_batch_size`` (used unless the critic sets its own)."""
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        from rlkit.workers.critic import FSDPCritic

        self.critic = FSDPCritic(
            model_config,
            critic_config,
            rollout_n=rollout_n,
            total_steps=total_steps,
            ppo_mini_batch_size=ppo_mini_batch_size,
            device=self.device,
            mixed_precision=mixed_precision,
            seed=seed,
        )

    def compute_values(self, batch: Batch) -> Batch:
        """``values [B, T]``."""
        return self.critic.compute_values(batch).to("cpu")

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value update on ``values``, ``returns``; ``critic/*`` metrics."""
        return self.critic.update(batch)

    def save_checkpoint(self, directory: str) -> None:
        self.critic.save_checkpoint(Path(directory) / "critic")

    def load_checkpoint(self, directory: str) -> None:
        self.critic.load_checkpoint(Path(directory) / "critic")

    def destroy(self) -> None:
        self.critic = None
        super().destroy()


class RefWorker(Worker):
    """A stand-alone reference policy (when it is not colocated with the actor)."""

    def __init__(
        self,
        rank,
        world_size,
        master_addr,
        master_port,
        device,
        threads=1,
        *,
        model_config: ModelConfig,
        ref_config: RefConfig,
        temperature: float = 1.0,
        mixed_precision: str = "fp32",
    ):
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        from rlkit.workers.ref import FSDPRef

        self.ref = FSDPRef(
            model_config,
            ref_config,
            device=self.device,
            temperature=temperature,
            mixed_precision=mixed_precision,
        )

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob [B, T]``."""
        return self.ref.compute_ref_log_prob(batch).to("cpu")

    def save_checkpoint(self, directory: str) -> None:
        """The reference never changes: nothing to save."""

    def load_checkpoint(self, directory: str) -> None:
        """The reference never changes: nothing to load."""

    def destroy(self) -> None:
        self.ref = None
        super().destroy()


class RewardModelWorker(Worker):
    """A sequence-classification reward model; ``compute_rm_score`` writes ``rm_scores [B]``."""

    def __init__(
        self,
        rank,
        world_size,
        master_addr,
        master_port,
        device,
        threads=1,
        *,
        model_config: ModelConfig,
        reward_model_path: str,
        micro_batch_size: int = 8,
        mixed_precision: str = "fp32",
    ):
        """``model_config``: the policy's (tokenizer, dtype); ``reward_model_path``:
        ``reward.reward_model.path``."""
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        from rlkit.workers.reward_model import FSDPRewardModel

        self.rm = FSDPRewardModel(
            model_config,
            path=reward_model_path,
            device=self.device,
            micro_batch_size=micro_batch_size,
            mixed_precision=mixed_precision,
        )

    def compute_rm_score(self, batch: Batch) -> Batch:
        return self.rm.compute_rm_score(batch).to("cpu")

    def save_checkpoint(self, directory: str) -> None:
        """A frozen reward model: nothing to save."""

    def load_checkpoint(self, directory: str) -> None:
        """A frozen reward model: nothing to load."""

    def destroy(self) -> None:
        self.rm = None
        super().destroy()
