"""``rlkit eval MODEL --data FILES|--env NAME [--recipe R] [flags] [overrides]``.
``rlkit eval --compare A.json B.json``.

MODEL: a Hugging Face folder or hub id, an rlkit checkpoint (``.../checkpoints/global_step_N``) or a PEFT
adapter folder. Everything is checked (model, files, data sources, settings) before the first generation;
the loop, its resume and the metrics: ``rlkit.eval`` (docs/eval.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlkit.errors import RlkitError

_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "TOKENIZERS_PARALLELISM": "false",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a model, checkpoint or adapter on parquet data or an environment (docs/eval.md)",
    )
    p.add_argument(
        "model", nargs="?", help="HF folder or hub id, rlkit checkpoint folder, or PEFT adapter folder"
    )
    p.add_argument(
        "overrides", nargs="*", help="recipe overrides key.sub=value (e.g. rollout.backend.name=hf)"
    )
    p.add_argument("--data", nargs="+", default=[], help="parquet files in veRL's row schema")
    p.add_argument(
        "--env",
        default=None,
        metavar="NAME",
        help="a registered environment instead of --data (registry `environments`); its parameters as "
        "env.KEY=VALUE (= data.environment.KEY=VALUE), e.g. --env reasoning_gym env.task=leg_counting "
        "env.val_size=16",
    )
    p.add_argument(
        "--recipe",
        default=None,
        help="recipe YAML whose sampling (rollout.val), data and reward settings "
        "to use (default: greedy, n=1, 512 new tokens, the registered compute_score functions)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default outputs/eval/<model name>); rerun with the same folder to resume",
    )
    p.add_argument("--n", type=int, default=None, help="responses per prompt (rollout.val.n)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; > 0 samples (rollout.val.*)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (rollout.val.top_p)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="data.max_response_length")
    p.add_argument("--seed", type=int, default=None, help="sampling and bootstrap seed (trainer.seed)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="prompts per chunk: generated together, written together (default data.val_batch_size or 32)",
    )
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the 95%% intervals")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="RESULTS",
        help="print the differences between results.json files (each against the first)",
    )
    p.set_defaults(func=run_eval)


def _overrides(args: argparse.Namespace) -> list[str]:
    out = list(args.overrides)
    if args.n is not None:
        out.append(f"rollout.val.n={args.n}")
    if args.temperature is not None:
        out += [
            f"rollout.val.temperature={args.temperature}",
            f"rollout.val.do_sample={args.temperature > 0}",
        ]
    if args.top_p is not None:
        out.append(f"rollout.val.top_p={args.top_p}")
    if args.max_new_tokens is not None:
        out.append(f"data.max_response_length={args.max_new_tokens}")
    if args.seed is not None:
        out.append(f"trainer.seed={args.seed}")
    return out


def run_eval(args: argparse.Namespace) -> int:
    if args.compare is not None:
        from rlkit.eval.report import compare

        print(compare(args.compare))
        return 0
    if not args.model:
        raise RlkitError(
            "rlkit eval needs a MODEL (or --compare A.json B.json): rlkit eval MODEL --data FILE.parquet"
        )
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # overrides typed after --data land in it: a key=value that is no file is an override
    data = [d for d in args.data if not ("=" in d and not Path(d).exists())]
    args.overrides += [d for d in args.data if d not in data]
    return evaluate(args, data)


def evaluate(args: argparse.Namespace, data: list[str]) -> int:
    from rlkit.eval.engines import engine_description
    from rlkit.eval.loop import collect, generate_all, plan_eval, recipe_params, samples_of_table, sampling_of
    from rlkit.eval.metrics import eval_metrics
    from rlkit.eval.report import log_mlflow, results_dict, table_text, write_results
    from rlkit.plugin.registry import build_registries

    plan = plan_eval(
        args.model,
        data,
        out=Path(args.out) if args.out else None,
        recipe_file=args.recipe,
        overrides=_overrides(args),
        registries=build_registries(),
        batch_size=args.batch_size,
        env=args.env,
    )
    where = engine_description(plan.recipe)
    print(
        f"rlkit eval: {plan.source.kind} {plan.source.given} on {len(plan.dataset)} prompts -> {plan.out}; "
        f"generating {where}",
        file=sys.stderr,
        flush=True,
    )
    generate_all(plan, progress=not args.no_progress)
    table = collect(plan)
    sampling = sampling_of(plan.recipe)
    metrics = eval_metrics(
        samples_of_table(table), sampling["n"], seed=sampling["seed"], bootstrap=args.bootstrap
    )
    meta = {
        "model": plan.source.given,
        "model_kind": plan.source.kind,
        "data": list(plan.data),
        **({"environment": plan.environment} if plan.environment is not None else {}),
        "sampling": sampling,
        "generation": where,
        "prompts": len(plan.dataset),
        "samples": table.num_rows,
    }
    results = results_dict(meta, metrics)
    json_path, md_path = write_results(plan.out, results)
    uri = log_mlflow(plan.out, plan.source.name, results, recipe_params(plan))
    print(table_text(results))
    print(f"wrote {json_path}, {md_path}, {plan.out / 'generations.parquet'}; MLflow run in {uri}")
    return 0
