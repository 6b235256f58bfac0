"""Where ``rlkit eval`` generates: in this process on one device, or on a Ray pool of rollout ranks.

    engine = open_engine(plan)          # InProcessEngine, or RayEngine when the pool has > 1 rank
    gens = engine.generate(jobs)        # jobs: [(chunk, prompts repeated n times)] → one Batch per job
    engine.close()

Both build the recipe's rollout backend over the evaluated model, wrapped in the agent loops when the
recipe (or a multi-turn environment) names one, exactly as training's rollout does, and generate each chunk
with the backend's sampling generator seeded ``trainer.seed · 1000 + chunk``. So a chunk's generations do
not depend on which engine or rank made them (for a backend that is deterministic for a given seed and
batch: HF on CPU is).

The Ray engine is chosen when ``resources`` gives the rollout's pool more than one rank (``nodes ×
bundles_per_node``; the pool of role ``rollout`` when ``resources.roles`` maps it, else the actor's) or
names a cluster (``resources.ray_address``). Each round hands one whole chunk to each rank
(``EvalRolloutWorker``, a ``RolloutWorker``); the driver scores and writes the chunks in chunk order.
"""

from __future__ import annotations

import math
from typing import Any

from rlkit.batch import Batch
from rlkit.rollout.base import rollout_inputs

__all__ = [
    "open_engine",
    "eval_pool",
    "uses_ray",
    "engine_description",
    "InProcessEngine",
    "RayEngine",
    "sampling_kwargs",
]


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """The ``generate`` keywords of the eval's sampling (one response per repeated prompt)."""
    return {
        "n": 1,
        "do_sample": sampling["do_sample"],
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
    }


def eval_pool(recipe: Any) -> tuple[str, int]:
    """The pool the eval's rollout ranks use and its rank count."""
    from rlkit.workers.pools import ResourcePoolManager

    res = recipe.resources
    role = "rollout" if "rollout" in res.roles else "actor_rollout_ref"
    name = ResourcePoolManager(res).pool_name_for(role)
    pool = res.pools[name]
    return name, pool.nodes * pool.bundles_per_node


def uses_ray(recipe: Any) -> bool:
    """Whether the eval generates on a Ray pool: its pool has several ranks, or a cluster is named."""
    return eval_pool(recipe)[1] > 1 or bool(recipe.resources.ray_address)


def engine_description(recipe: Any) -> str:
    """Where generation runs, in words (the terminal line and results.json's ``generation``)."""
    name, ranks = eval_pool(recipe)
    if uses_ray(recipe):
        return f"Ray pool '{name}', {ranks} rank{'s' if ranks > 1 else ''}"
    return "in-process, 1 rank"


def open_engine(plan: Any) -> InProcessEngine | RayEngine:
    """The Ray engine for a pool of several ranks (or a named cluster), else the in-process one."""
    if uses_ray(plan.recipe):
        return RayEngine(plan, eval_pool(plan.recipe)[0])
    return InProcessEngine(plan)


def _with_agent_loops(plan: Any, backend: Any) -> Any:
    """The backend under the agent loops when the recipe runs one (a multi-turn environment, a tool loop)."""
    from rlkit.rollout.agent import with_agent_loops

    pipe, recipe = plan.pipeline, plan.recipe
    return with_agent_loops(
        backend,
        plan.tokenizer,
        rollout_config=recipe.rollout,
        max_response_length=recipe.data.max_response_length,
        loops=dict(pipe.agent_loops),
        default_agent=pipe.default_agent,
        tools=pipe.tools,
        generate_ids=pipe.rollout_backend.spec.generate_ids,
    )


class InProcessEngine:
    """The model on ``resources.device`` in this process; a backend built per chunk with its seed."""

    ranks = 1

    def __init__(self, plan: Any):
        import torch

        from rlkit.model.load import load_model
        from rlkit.workers.pools import resolve_device

        self.plan = plan
        self.device = torch.device(resolve_device(plan.recipe.resources.device))
        self.model = load_model(plan.recipe.model, tokenizer=plan.tokenizer).to(self.device)

    def generate(self, jobs: list[tuple[int, Batch]], sampling: dict[str, Any]) -> list[Batch]:
        recipe, out = self.plan.recipe, []
        for chunk, repeated in jobs:
            backend = self.plan.pipeline.rollout_backend.build(
                module=self.model,
                tokenizer=self.plan.tokenizer,
                rollout_config=recipe.rollout,
                max_response_length=sampling["max_new_tokens"],
                device=self.device,
                seed=recipe.trainer.seed * 1000 + chunk,
            )
            rollout = _with_agent_loops(self.plan, backend)
            out.append(rollout.generate(rollout_inputs(repeated), **sampling_kwargs(sampling)))
        return out

    def close(self) -> None:
        self.model = None


class RayEngine:
    """``EvalRolloutWorker`` ranks on the recipe's pool of a Ray cluster (started here unless one runs or
    ``resources.ray_address`` names one); one chunk per rank per round."""

    def __init__(self, plan: Any, pool_name: str):
        from rlkit.eval.worker import EvalRolloutWorker
        from rlkit.workers import RayCluster, ResourcePoolManager, WorkerGroup

        recipe, pipe = plan.recipe, plan.pipeline
        self.plan = plan
        pools = ResourcePoolManager(recipe.resources)
        self.cluster = RayCluster(recipe.resources).start()
        try:
            pools.check({pool_name: ["rollout"]})
            self.group = WorkerGroup(
                EvalRolloutWorker,
                pools.pools[pool_name].create(roles=["rollout"]),
                role="rollout",
                threads=_threads(recipe.resources, pool_name),
                env_vars=_allocator_env(recipe.resources),
                role_kwargs={
                    "model_config": recipe.model,
                    "rollout_config": recipe.rollout,
                    "max_response_length": recipe.data.max_response_length,
                    "seed": recipe.trainer.seed,
                    "rollout_backend": pipe.rollout_backend,
                    "agent_loops": dict(pipe.agent_loops),
                    "default_agent": pipe.default_agent,
                    "tools": pipe.tools,
                },
            )
            self.cluster.watch_owned()  # a killed eval's workers go with it (rlkit.workers.reaper)
        except BaseException:
            self.cluster.stop(grace_s=1.0)
            raise
        self.ranks = self.group.world_size

    def generate(self, jobs: list[tuple[int, Batch]], sampling: dict[str, Any]) -> list[Batch]:
        """Job ``i`` goes to rank ``i`` (at most one job per rank); the generations in job order."""
        seed = self.plan.recipe.trainer.seed
        work = [(rank, seed * 1000 + chunk, rollout_inputs(b)) for rank, (chunk, b) in enumerate(jobs)]
        per_rank = self.group.call("generate_assigned", work, dispatch="all", **sampling_kwargs(sampling))
        return [per_rank[rank] for rank in range(len(jobs))]

    def close(self) -> None:
        try:
            self.group.shutdown()
        finally:
            self.cluster.stop()


def _allocator_env(resources: Any) -> dict[str, str]:
    """The eval workers' environment for ``resources.allocator`` (rlkit.hardware.allocator)."""
    from rlkit.hardware.allocator import plan_allocator
    from rlkit.workers.pools import resolve_device

    device = resolve_device(resources.device)
    return plan_allocator(resources.allocator, device, local=resources.ray_address is None).env


def _threads(resources: Any, pool_name: str) -> int:
    """``resources.threads_per_worker``; ``auto``: the pool's CPUs per bundle (at least 1)."""
    if resources.threads_per_worker != "auto":
        return int(resources.threads_per_worker)
    return max(1, math.floor(resources.pools[pool_name].cpus_per_bundle))
