"""The validation phase: ``mean@n`` / ``best@n`` of the validation data per data_source, and a table of
generations.

    metrics = validate(ctx)   # val-core/<data_source>/<key>/mean@n ... (rlkit.eval.metrics.core_metrics)

The samples table and the metric lines are ``rlkit eval``'s own (``rlkit.eval.metrics``), so a later
``rlkit eval`` of a checkpoint reports the same numbers for the same sampling (docs/eval.md).
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit.batch import Batch
from rlkit.eval.metrics import Samples, core_metrics, samples_from
from rlkit.rollout.base import rollout_inputs
from rlkit.step.context import StepContext
from rlkit.step.reward import reward_of

__all__ = ["validate"]


def validate(ctx: StepContext) -> dict[str, float]:
    rt, recipe = ctx.rt, ctx.recipe
    val = recipe.rollout.val
    samples, rows = Samples([], [], []), []
    eos = [rt.tokenizer.eos_token_id] if getattr(rt.tokenizer, "eos_token_id", None) is not None else []
    for prompts in rt.val_loader:
        prompts["uid"] = [f"val-{len(samples.score) + i}" for i in range(len(prompts))]
        repeated = prompts.repeat(val.n, interleave=True)
        gen = rt.actor.call(
            "generate_sequences",
            rollout_inputs(repeated),
            balance=False,
            n=1,
            do_sample=val.do_sample,
            temperature=val.temperature,
            top_p=val.top_p,
        )
        gen.meta.pop("metrics", None)
        # env_reward, num_turns
        own = {k: v for k, v in gen.non_tensors.items() if k not in repeated.non_tensors}
        batch = repeated.select(list(repeated.non_tensors)).union(Batch(gen.tensors, own, {}))
        result = reward_of(batch, ctx)
        samples.extend(samples_from(batch, result, eos))
        if len(rows) < recipe.tracking.log_generations:
            rows += generation_rows(batch, result.token_level_scores.sum(-1), rt.tokenizer)
    metrics = core_metrics(samples, val.n)
    table = "| prompt | response | score |\n|---|---|---|\n" + "\n".join(
        rows[: recipe.tracking.log_generations]
    )
    rt.tracking.log_text(table, f"generations/step_{ctx.global_step}.md")
    return metrics


def generation_rows(batch: Batch, scores: torch.Tensor, tok: Any) -> list[str]:
    """One Markdown table row per sample: the prompt's last 300 characters, the response, its score."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    rows = []
    for i in range(len(batch)):
        prompt = tok.decode(
            batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()]
        )
        response = tok.decode(batch["responses"][i][batch["response_mask"][i].bool()])
        rows.append(f"| {cell(prompt[-300:])} | {cell(response)} | {scores[i].item():.3f} |")
    return rows
