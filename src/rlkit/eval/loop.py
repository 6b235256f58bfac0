"""The ``rlkit eval`` loop: check everything, generate in chunks (each written as it is scored), resume.

    plan = plan_eval(model, data, out=..., recipe_file=None, overrides=[...], registries=...)  # no generation
    plan = plan_eval(model, [], env="reasoning_gym", overrides=["env.task=...", ...], ...)  # an environment
    generate_all(plan)     # parts/chunk-NNNNNN.parquet, one per chunk of prompts; done prompts skipped
    table = collect(plan)  # generations.parquet: every sample, in prompt order

Sampling is the recipe's validation sampling (``rollout.val``: n, do_sample, temperature, top_p) and
``data.max_response_length`` (max new tokens), so an eval of a checkpoint with its run's recipe samples as
the run's validation did. Generation is the recipe's rollout backend (HF by default), in this process or on
a Ray pool of rollout ranks (``rlkit.eval.engines``); scoring is the recipe's reward step (reward manager +
registered ``compute_score`` functions, or an environment's own score: ``rlkit.eval.environment``).

Resume: a chunk's rows go to ``parts/`` (temp file + rename) after they are scored, so a killed eval loses
at most the chunks it was generating (one per rank); a rerun with the same ``--out`` skips every prompt
already in ``parts/`` (nothing written is generated or scored again). ``eval_config.json`` records model,
data and sampling; a rerun with other settings in the same folder is refused. Chunk ``c`` samples with
seed ``trainer.seed * 1000 + c``, whether resumed or not, on whichever rank.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkit.batch import Batch
from rlkit.eval.metrics import Samples, samples_from
from rlkit.eval.model import EvalError, ModelSource, resolve_model
from rlkit.plugin.registry import Registries
from rlkit.recipe import Recipe, recipe_to_dict
from rlkit.recipe.load import load_yaml
from rlkit.recipe.validate import validate_recipe

__all__ = ["EvalPlan", "plan_eval", "generate_all", "collect", "samples_of_table", "sampling_of"]

DEFAULT_MAX_PROMPT_LENGTH = 1024
DEFAULT_MAX_NEW_TOKENS = 512


@dataclass
class EvalPlan:
    recipe: Recipe  # model.path: the HF folder to load; data.val_files: the data; rollout.val: the sampling
    source: ModelSource
    out: Path
    batch_size: int  # prompts per chunk
    registries: Registries
    tokenizer: Any = None
    dataset: Any = None
    pipeline: Any = None
    data: list[str] = field(default_factory=list)  # the parquet files evaluated (an environment's: written)
    environment: dict[str, Any] | None = None  # --env: data.environment as validated, and the split used


def sampling_of(recipe: Recipe) -> dict[str, Any]:
    val = recipe.rollout.val
    greedy = not val.do_sample or val.temperature == 0
    return {
        "n": val.n,
        "do_sample": not greedy,
        "temperature": 0.0 if greedy else val.temperature,
        "top_p": val.top_p,
        "max_new_tokens": recipe.data.max_response_length,
        "seed": recipe.trainer.seed,
        "backend": recipe.rollout.backend.name,
    }


def _recipe(
    model_path: str,
    data: list[str],
    recipe_file: str | None,
    overrides: list[str],
    registries: Registries,
    env: str | None = None,
) -> Recipe:
    """The recipe file (or defaults) with model and data replaced by the eval's (files, or ``--env``'s
    ``data.environment``); overrides on top (``env.KEY=VALUE`` as ``data.environment.KEY=VALUE``)."""
    from rlkit.eval.environment import environment_overrides, environment_section

    raw: dict[str, Any] = load_yaml(recipe_file) if recipe_file else {}
    raw.setdefault("model", {})
    raw["model"]["path"] = model_path
    raw["model"].pop("tokenizer_path", None)  # the evaluated folder carries its own tokenizer
    raw.setdefault("data", {})
    raw["data"].setdefault("max_prompt_length", DEFAULT_MAX_PROMPT_LENGTH)
    raw["data"].setdefault("max_response_length", DEFAULT_MAX_NEW_TOKENS)
    if env is None:
        raw["data"].pop("environment", None)
        raw["data"]["train_files"] = list(data)
        raw["data"]["val_files"] = list(data)
    else:  # the environment gives the rows: no files beside it (validation refuses them)
        raw["data"]["environment"] = environment_section(env, raw["data"])
        raw["data"].pop("train_files", None)
        raw["data"].pop("val_files", None)
        overrides = environment_overrides(overrides)
    if not recipe_file:  # the default estimator (grpo) wants groups; eval itself reads only rollout.val
        raw.setdefault("rollout", {}).setdefault("n", 2)
    return validate_recipe(raw, overrides, source=recipe_file or "rlkit eval", registries=registries)


def plan_eval(
    model: str,
    data: list[str],
    *,
    out: Path | None,
    recipe_file: str | None,
    overrides: list[str],
    registries: Registries,
    batch_size: int | None = None,
    env: str | None = None,
) -> EvalPlan:
    """Check model, data files (or the environment and its parameters), data sources and settings; merge a
    checkpoint / adapter. No generation."""
    from rlkit.data.dataset import RLDataset
    from rlkit.eval.model import display_name, model_kind
    from rlkit.model.load import load_tokenizer
    from rlkit.recipe.compose import compose

    _check_data_given(data, env)
    kind = model_kind(model)  # a bad model folder fails here, before any merge or load
    folder = out or Path("outputs") / "eval" / display_name(model, kind)
    folder.mkdir(parents=True, exist_ok=True)
    source = resolve_model(model, folder)
    recipe = _recipe(source.path, data, recipe_file, overrides, registries, env)
    plan = EvalPlan(recipe, source, folder, batch_size or recipe.data.val_batch_size or 32, registries)
    plan.pipeline = compose(recipe, registries)
    plan.data = list(data)
    if env is not None:
        from rlkit.eval.environment import environment_files

        plan.data, split = environment_files(plan.pipeline, folder)
        plan.environment = {**recipe.data.environment.model_dump(), "split": split}
    plan.tokenizer = load_tokenizer(recipe.model)
    d = recipe.data
    plan.dataset = RLDataset(
        plan.data,
        plan.tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        prompt_length_policy=d.prompt_length_policy,
    )
    _check_sources(plan)
    _check_config(plan)
    return plan


def _check_data_given(data: list[str], env: str | None) -> None:
    if env is not None:
        if data:
            raise EvalError(
                f"--env {env} and --data both given: an environment gives the rows; drop one of them"
            )
        return
    missing = [f for f in data if not Path(f).is_file()]
    if not data or missing:
        raise EvalError(
            f"--data: {'no file given' if not data else 'no such file: ' + ', '.join(missing)}; give "
            "parquet files in veRL's row schema (rlkit data prepare writes them), or --env NAME"
        )


def _check_sources(plan: EvalPlan) -> None:
    if plan.recipe.reward.custom_score is not None:
        return  # one custom function scores every data source
    known = set(plan.pipeline.score_fns)
    if plan.pipeline.environment is not None:  # its rows' data_source: the environment scores them
        known.add(plan.pipeline.environment.name)
    unknown = sorted({str(s["data_source"]) for s in plan.dataset.samples} - known)
    if unknown:
        raise EvalError(
            f"--data: no compute_score is registered for data_source {', '.join(map(repr, unknown))} "
            f"(in {', '.join(plan.data)}). Known: {', '.join(sorted(known))}. Fix the "
            "data_source column, install the plugin that registers it, or pass a recipe with "
            "reward.custom_score."
        )


def _check_config(plan: EvalPlan) -> None:
    """Write ``eval_config.json``, or refuse a folder holding an eval with other settings."""
    config = {
        "model": plan.source.given,
        "data": [str(Path(f).resolve()) for f in plan.data],
        "sampling": sampling_of(plan.recipe),
    }
    if plan.environment is not None:
        config["environment"] = plan.environment
    path = plan.out / "eval_config.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if before != config:
            raise EvalError(
                f"{plan.out} holds an eval with other settings ({path}: {before}); this one is {config}. "
                "Give another --out, or delete that folder to start over."
            )
    else:
        path.write_text(json.dumps(config, indent=1) + "\n")


def _done(parts: Path) -> set[str]:
    import pyarrow.parquet as pq

    done: set[str] = set()
    for part in sorted(parts.glob("chunk-*.parquet")):
        done.update(pq.read_table(part, columns=["prompt_id"]).column("prompt_id").to_pylist())
    return done


def generate_all(plan: EvalPlan, *, progress: bool = True) -> int:
    """Generate and score every prompt not yet in ``parts/``, a chunk at a time (a round of one chunk per
    rank on a Ray pool); returns prompts generated now."""
    from tqdm import tqdm

    from rlkit.eval.engines import open_engine

    parts = plan.out / "parts"
    parts.mkdir(exist_ok=True)
    done = _done(parts)
    ds = plan.dataset
    chunks = [list(range(s, min(s + plan.batch_size, len(ds)))) for s in range(0, len(ds), plan.batch_size)]
    todo = {c: [i for i in rows if ds[i]["row"] not in done] for c, rows in enumerate(chunks)}
    todo = {c: rows for c, rows in todo.items() if rows}
    left = sum(map(len, todo.values()))
    if len(done):
        print(
            f"rlkit eval: resuming, {len(ds) - left} of {len(ds)} prompts already done in {parts}",
            file=sys.stderr,
            flush=True,
        )
    if not todo:
        return 0
    engine = open_engine(plan)
    reward = _reward_step(plan)
    bar = tqdm(
        total=len(ds),
        initial=len(ds) - left,
        desc="eval",
        unit="prompt",
        file=sys.stderr,
        disable=not progress,
    )
    sampling, pending = sampling_of(plan.recipe), list(todo.items())
    try:
        for start in range(0, len(pending), engine.ranks):
            jobs = [(chunk, _repeated(plan, rows)) for chunk, rows in pending[start : start + engine.ranks]]
            for (chunk, repeated), gen in zip(jobs, engine.generate(jobs, sampling)):
                _write_part(parts / f"chunk-{chunk:06d}.parquet", _scored(plan, reward, repeated, gen))
                bar.update(len(todo[chunk]))
    finally:
        bar.close()
        reward.close()
        engine.close()
    return left


def _reward_step(plan: EvalPlan) -> Any:
    from rlkit.runtime.build import _reward_step as build_reward_step

    return build_reward_step(plan.recipe, plan.pipeline, plan.tokenizer)


def _repeated(plan: EvalPlan, rows: list[int]) -> Batch:
    """The prompts ``rows`` (``uid``: their prompt ids), each ``rollout.val.n`` times (interleaved)."""
    ds = plan.dataset
    prompts = ds.collate([ds[i] for i in rows])
    prompts["uid"] = [ds[i]["row"] for i in rows]
    return prompts.repeat(plan.recipe.rollout.val.n, interleave=True)


def _scored(plan: EvalPlan, reward: Any, repeated: Batch, gen: Batch) -> dict[str, list]:
    """Score the generations ``gen`` of the prompts ``repeated``: the part's columns."""
    tok, n = plan.tokenizer, plan.recipe.rollout.val.n
    gen.meta.pop("metrics", None)
    # the reward step and the parquet read CPU tensors (a worker group hands the trainer CPU batches too);
    # the generation's own per-sample fields (a multi-turn episode's env_reward) go to the reward step too
    extra = {k: v for k, v in gen.non_tensors.items() if k not in repeated.non_tensors}
    batch = repeated.select(list(repeated.non_tensors)).union(Batch(gen.tensors.to("cpu"), extra, {}))
    result = reward(batch)
    texts = [tok.decode(batch["responses"][i][batch["response_mask"][i].bool()]) for i in range(len(batch))]
    samples = samples_from(batch, result, [tok.eos_token_id] if tok.eos_token_id is not None else [], texts)
    width = batch["prompts"].shape[1]
    prompt_texts = [
        tok.decode(batch["prompts"][i][batch["attention_mask"][i, :width].bool()]) for i in range(len(batch))
    ]
    extras = [{k: _plain(v[i]) for k, v in samples.extra.items()} for i in range(len(batch))]
    turns = batch["num_turns"] if "num_turns" in batch.non_tensors else [1] * len(batch)  # agent loops
    return {
        "prompt_id": samples.group,
        "sample": [i % n for i in range(len(batch))],
        "data_source": samples.data_source,
        "prompt": prompt_texts,
        "response": texts,
        "score": samples.score,
        "length": samples.length,
        "truncated": samples.truncated,
        "turns": [int(t) for t in turns],
        "extra": [json.dumps(e) for e in extras],
    }


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def _write_part(path: Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(pa.table(columns), tmp)
    os.replace(tmp, path)


def collect(plan: EvalPlan) -> Any:
    """Every part, in chunk order, as one table; written to ``generations.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted((plan.out / "parts").glob("chunk-*.parquet"))
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    pq.write_table(table, plan.out / "generations.parquet")
    return table


def samples_of_table(table: Any) -> Samples:
    """The metric rows of a generations table (``extra`` holds each sample's score extras as JSON)."""
    cols = table.to_pydict()
    extras = [json.loads(e) for e in cols["extra"]]
    keys = set.intersection(*(set(e) for e in extras)) if extras else set()
    return Samples(
        cols["data_source"],
        cols["prompt_id"],
        cols["score"],
        {k: [e[k] for e in extras] for k in keys},
        cols["length"],
        cols["truncated"],
        cols["response"],
    )


def recipe_params(plan: EvalPlan) -> dict[str, Any]:
    """MLflow params: model, data, sampling (and the effective recipe under ``recipe.``)."""
    return {
        "model": plan.source.given,
        "model_kind": plan.source.kind,
        "data": ",".join(plan.data),
        **({"environment": plan.environment} if plan.environment is not None else {}),
        "sampling": sampling_of(plan.recipe),
        "recipe": recipe_to_dict(plan.recipe),
    }
