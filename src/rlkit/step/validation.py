"""The validation phase: ``mean@n`` / ``best@n`` of the validation data per data_source, and a table of generations.

    metrics = validate(ctx)   # val-core/<data_source>/<key>/mean@n ... (rlkit.step.metrics.validation_metrics)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlkit.batch import Batch
from rlkit.step.context import StepContext
from rlkit.step.generate import rollout_inputs
from rlkit.step.reward import reward_of
from rlkit.step.metrics import validation_metrics

__all__ = ["validate"]


def validate(ctx: StepContext) -> dict[str, float]:
    rt, recipe = ctx.rt, ctx.recipe
    val = recipe.rollout.val
    sources, uids, scores, rows = [], [], [], []
    extra: dict[str, list[Any]] = {}
    for prompts in rt.val_loader:
        prompts["uid"] = [f"val-{len(uids) + i}" for i in range(len(prompts))]
        repeated = prompts.repeat(val.n, interleave=True)
        gen = rt.actor.call("generate_sequences", rollout_inputs(repeated), balance=False, n=1,
                            do_sample=val.do_sample, temperature=val.temperature, top_p=val.top_p)
        gen.meta.pop("metrics", None)
        own = {k: v for k, v in gen.non_tensors.items() if k not in repeated.non_tensors}  # env_reward, num_turns
        batch = repeated.select(list(repeated.non_tensors)).union(Batch(gen.tensors, own, {}))
        result = reward_of(batch, ctx)
        sources += list(batch["data_source"])
        uids += list(batch["uid"])
        scores += result.token_level_scores.sum(-1).tolist()
        for key, values in result.extra.items():
            extra.setdefault(key, []).extend(values)
        if len(rows) < recipe.tracking.log_generations:
            rows += generation_rows(batch, result.token_level_scores.sum(-1), rt.tokenizer)
    metrics = validation_metrics(np.array(sources, dtype=object), np.array(uids, dtype=object), scores, val.n,
                                 extra if len(next(iter(extra.values()), [])) == len(scores) else None)
    table = "| prompt | response | score |\n|---|---|---|\n" + "\n".join(rows[: recipe.tracking.log_generations])
    rt.tracking.log_text(table, f"generations/step_{ctx.global_step}.md")
    return metrics


def generation_rows(batch: Batch, scores: torch.Tensor, tok: Any) -> list[str]:
    """One Markdown table row per sample: the prompt's last 300 characters, the response, its score."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    rows = []
    for i in range(len(batch)):
        prompt = tok.decode(batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()])
        response = tok.decode(batch["responses"][i][batch["response_mask"][i].bool()])
        rows.append(f"| {cell(prompt[-300:])} | {cell(response)} | {scores[i].item():.3f} |")
    return rows
