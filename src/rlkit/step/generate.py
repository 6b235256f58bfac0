"""The generation phase: each prompt repeated ``rollout.n`` times (interleaved) as one group, then generated.

    batch, metrics = generate(prompts, ctx)             # the hybrid engine (the actor's workers)
    batch, metrics = generate(prompts, ctx, gen_batch=1) # a dynamic-sampling refill of the same step

Each group gets a ``uid`` naming step, generation batch and prompt, so groups from different generation
batches of one step never merge, and a ``group_id`` [B] (the estimators' group index), made here once. With a
rollout pool generating ahead (``trainer.mode`` one_step_off / async) the batch comes from
``rlkit.step.ahead.generated_ahead``.

Shapes: ``B`` = prompts × n samples.
"""

from __future__ import annotations

import numpy as np
import torch

from rlkit.batch import Batch
from rlkit.rollout.base import rollout_inputs
from rlkit.step.context import StepContext

__all__ = ["generate", "group_ids", "join_generation", "repeat_prompts"]


def generate(prompts: Batch, ctx: StepContext, gen_batch: int = 0) -> tuple[Batch, dict[str, float]]:
    """``prompts`` [B/n] → the generated batch [B]: the prompts' per-row fields, the generation's tensors,
    ``uid`` and ``group_id``; metrics: the agent loop's (``num_turns/*``, ``tool_call_counts/*``)."""
    prompts = Batch(prompts.tensors, prompts.non_tensors, prompts.meta)
    repeated = repeat_prompts(prompts, f"{ctx.global_step}-{gen_batch}", ctx.recipe.rollout.n)
    gen = ctx.rt.actor.call("generate_sequences", rollout_inputs(repeated), balance=False, n=1)
    return join_generation(repeated, gen)


def repeat_prompts(prompts: Batch, tag: str, n: int) -> Batch:
    """``prompts`` with ``uid`` ``<tag>-<row>`` (a group id), each row repeated ``n`` times (interleaved).
    Sets ``uid`` on ``prompts`` too."""
    prompts["uid"] = [f"{tag}-{i}" for i in range(len(prompts))]
    return prompts.repeat(n, interleave=True)


def join_generation(repeated: Batch, gen: Batch) -> tuple[Batch, dict[str, float]]:
    """The repeated prompts' per-row fields with the generation's tensors and a ``group_id`` [B]; the
    generation's own metrics."""
    metrics = gen.meta.pop("metrics", {})  # agent loops: num_turns/*, tool_call_counts/*
    # the generation's own per-sample fields too (env_reward, num_turns), where the prompts have no such field
    extra = {k: v for k, v in gen.non_tensors.items() if k not in repeated.non_tensors}
    batch = repeated.select(list(repeated.non_tensors)).union(Batch(gen.tensors, extra, gen.meta))
    batch["group_id"] = group_ids(batch)
    return batch, metrics


def group_ids(batch: Batch) -> torch.Tensor:
    """``uid`` strings → dense group ids [B] (0 .. groups - 1, in sorted uid order)."""
    _, inverse = np.unique(batch["uid"].astype(str), return_inverse=True)
    return torch.as_tensor(inverse, dtype=torch.long)
