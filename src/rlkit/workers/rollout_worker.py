"""``RolloutWorker``: a rollout engine in processes of its own (role ``rollout``, ``trainer.mode``
one_step_off / async).

Each rank holds a full copy of the policy (plain module, not sharded: ranks are independent generation
replicas; the group's torch.distributed group is only joined, never used by generation) and the
recipe's rollout backend on top of it. The driver sends it the actor's weights after every update as
a full state dict with a version number (``update_weights``; with ``actor.lora`` the module carries the same
adapter and only the adapter's tensors travel); generation calls and weight pushes run
in the order the driver submitted them (one Ray actor runs its calls one at a time), so a generation
always finishes under the weights it started with. ``rlkit.step.ahead`` drives it.

Checkpoints: ``save_checkpoint(dir)`` writes ``rollout_worker/rank<r>.pt`` (the sampling RNG and the
weights version); the weights themselves are the actor's, pushed again on resume.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.model.state_file import load_state_file
from rlkit.recipe.compose import Resolved
from rlkit.recipe.schema import LoraConfig, ModelConfig, RolloutConfig
from rlkit.workers.base import Worker

__all__ = ["RolloutWorker"]


class RolloutWorker(Worker):
    """A rollout-only rank: the backend over its own copy of the policy, weights by version."""

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
        rollout_config: RolloutConfig,
        max_response_length: int = 512,
        seed: int = 1,
        rollout_backend: Resolved | None = None,
        agent_loops: dict[str, Resolved] | None = None,
        default_agent: str | None = None,
        tools: tuple[Resolved, ...] = (),
        lora: LoraConfig | None = None,
    ):
        """Keywords as for ``ActorRolloutRefWorker``'s rollout part; ``seed``: ``trainer.seed`` (sampling is
        seeded ``seed * 1000 + 500 + rank``, apart from the actor's own engine); ``lora``: ``actor.lora`` (the
        module gets the same adapter, its values come with the first weight push)."""
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        from rlkit.model.load import load_model, load_tokenizer

        if rollout_backend is None:
            raise WorkerError("RolloutWorker needs rollout_backend (a resolved component).")
        self.tokenizer = load_tokenizer(model_config)
        torch.manual_seed(seed)
        module = load_model(model_config, "causal_lm", tokenizer=self.tokenizer).to(self.device)
        if lora is not None:
            from rlkit.model.lora import apply_lora

            module, _ = apply_lora(module, lora)
        module.requires_grad_(False)
        from rlkit.rollout.agent import build_rollout  # under agent loops where the recipe is multi-turn

        self.rollout = build_rollout(
            rollout_backend,
            module,
            self.tokenizer,
            rollout_config=rollout_config,
            max_response_length=max_response_length,
            device=self.device,
            seed=seed * 1000 + 500 + rank,
            agent_loops=agent_loops,
            default_agent=default_agent,
            tools=tools,
        )
        self.version = 0  # the actor update whose weights this rank holds (0 = the initial weights)
        self.sync_bytes = 0  # tensor bytes of the last weight push (metric rollout/weight_sync_bytes)

    def generate_sequences(self, prompts: Batch, **sampling) -> Batch:
        """As ``ActorRolloutRefWorker.generate_sequences``; every row also gets ``rollout_version [B]``
        (long), the weights version it was generated with."""
        start = time.perf_counter()
        out = self.rollout.generate(prompts, **sampling).to("cpu")  # the driver's side is host memory
        out["rollout_version"] = torch.full((len(out),), self.version, dtype=torch.long)
        metrics = out.meta.setdefault("metrics", {})
        metrics["perf/worker_s/gen"] = time.perf_counter() - start
        metrics.setdefault("rollout/weight_sync_bytes", float(self.sync_bytes))  # an engine's own count wins
        return out

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Load the actor's weights of ``version`` (every rank gets the same dict: the full state dict, or
        with ``actor.lora`` the adapter's tensors alone); returns the seconds it took."""
        start = time.perf_counter()
        self.rollout_engine().update_weights(state_dict)
        self.version = int(version)
        self.sync_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        return time.perf_counter() - start

    def weights_version(self) -> int:
        return self.version

    def rollout_engine(self):
        """The backend (under an agent-loop wrapper, its engine)."""
        return getattr(self.rollout, "backend", self.rollout)

    def save_checkpoint(self, directory: str) -> None:
        path = Path(directory) / "rollout_worker"
        path.mkdir(parents=True, exist_ok=True)
        generator = getattr(self.rollout_engine(), "generator", None)
        state = {
            "version": self.version,
            "generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
        }
        torch.save(state, path / f"rank{self.rank}.pt")

    def load_checkpoint(self, directory: str) -> None:
        """Restore the sampling RNG (a checkpoint of a sync run has none: nothing to restore)."""
        path = Path(directory) / "rollout_worker" / f"rank{self.rank}.pt"
        if not path.exists():
            return
        state = load_state_file(path)
        generator = getattr(self.rollout_engine(), "generator", None)
        if state["generator"] is not None and isinstance(generator, torch.Generator):
            generator.set_state(state["generator"])
        self.version = int(state["version"])

    def destroy(self) -> None:
        self.rollout = None
        super().destroy()
