"""``rlkit data gsm8k|math500|arithmetic``: write veRL-schema parquet files.

    rlkit data gsm8k --input ../shared/data/gsm8k --output data/gsm8k      # train + test.parquet
    rlkit data math500 --input ../shared/data/math500 --output data/math500  # test.parquet only
    rlkit data arithmetic --output data/arithmetic --train-size 2000 --test-size 50 --seed 0
    rlkit data reasoning-gym --task leg_counting --size 512 --seed 1 --output data/leg_counting

``reasoning-gym`` writes the rows the ``reasoning_gym`` environment gives a run (plugin rlkit-reasoning-gym;
docs/environments.md): the same function makes both.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="preprocess a dataset into veRL-schema parquet files")
    kinds = parser.add_subparsers(dest="dataset", metavar="DATASET", required=True)

    from rlkit.data import gsm8k, math500, synthetic

    for name, module, what in (
        ("gsm8k", gsm8k, "GSM8K: reads train.jsonl and test.jsonl; writes train.parquet and test.parquet"),
        ("math500", math500, "MATH-500: reads test.jsonl; writes test.parquet (MATH-500 has no train split)"),
    ):
        sub = kinds.add_parser(name, help=what, description=what)
        sub.add_argument("--input", required=True, help="folder with the upstream JSON Lines files")
        sub.add_argument("--output", required=True, help="folder to write the parquet files to")
        sub.add_argument(
            "--instruction",
            default=module.DEFAULT_INSTRUCTION,
            help=f"text appended to each question (default: {module.DEFAULT_INSTRUCTION!r}; '' for none)",
        )
        sub.set_defaults(func=_run_gsm8k if name == "gsm8k" else _run_math500)

    sub = kinds.add_parser(
        "arithmetic",
        help="seeded synthetic arithmetic task (train.parquet + test.parquet)",
        description=(
            "Seeded sums/differences a small model can learn on a CPU (data_source rlkit/arithmetic)."
        ),
    )
    sub.add_argument("--output", required=True, help="folder to write the parquet files to")
    sub.add_argument("--train-size", type=int, default=2000, help="training problems (default 2000)")
    sub.add_argument("--test-size", type=int, default=50, help="held-out test problems (default 50)")
    sub.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same files")
    sub.add_argument("--min-operand", type=int, default=0, help="smallest operand (default 0)")
    sub.add_argument("--max-operand", type=int, default=9, help="largest operand (default 9: one-digit)")
    sub.add_argument("--num-terms", type=int, default=2, help="operands per problem (default 2)")
    sub.add_argument("--ops", default="+", help="operators to use, from '+-' (default '+')")
    sub.add_argument(
        "--instruction", default=synthetic.DEFAULT_INSTRUCTION, help="text appended to each question"
    )
    sub.set_defaults(func=_run_arithmetic)

    what = "rows of a reasoning-gym task (plugin rlkit-reasoning-gym): train.parquet (+ test.parquet)"
    sub = kinds.add_parser(
        "reasoning-gym", help=what, description=what + "; the same rows data.environment gives."
    )
    sub.add_argument(
        "--task", required=True, help="reasoning-gym task, e.g. leg_counting or basic_arithmetic"
    )
    sub.add_argument("--size", type=int, default=256, help="training rows (default 256)")
    sub.add_argument("--val-size", type=int, default=32, help="test rows, seed + 1 (default 32; 0 = none)")
    sub.add_argument("--seed", type=int, default=1, help="seed of the training rows (default 1)")
    sub.add_argument("--output", required=True, help="folder to write the parquet files to")
    sub.add_argument(
        "params",
        nargs="*",
        help="more environment params, key=value as in data.environment (e.g. config.max_digits=1 "
        "answer_tags=last_number; docs/environments.md)",
    )
    sub.set_defaults(func=_run_reasoning_gym)


def _output_folder(path: str) -> str:
    """Create ``--output`` first, so a path that cannot be a folder is named before any work."""
    from pathlib import Path

    from rlkit.errors import DataError

    try:
        Path(path).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"--output {path}: cannot create the folder ({exc.strerror}). Give a folder you can write."
        ) from exc
    return path


def _report(written: dict) -> int:
    import pyarrow.parquet as pq

    for split, path in written.items():
        print(f"{split}: {pq.read_metadata(path).num_rows} rows -> {path}")
    return 0


def _run_gsm8k(args: argparse.Namespace) -> int:
    from rlkit.data import preprocess_gsm8k

    return _report(preprocess_gsm8k(args.input, _output_folder(args.output), instruction=args.instruction))


def _run_math500(args: argparse.Namespace) -> int:
    from rlkit.data import preprocess_math500

    return _report(preprocess_math500(args.input, _output_folder(args.output), instruction=args.instruction))


def _run_arithmetic(args: argparse.Namespace) -> int:
    from rlkit.data import generate_arithmetic

    written = generate_arithmetic(
        _output_folder(args.output),
        train_size=args.train_size,
        test_size=args.test_size,
        seed=args.seed,
        min_operand=args.min_operand,
        max_operand=args.max_operand,
        num_terms=args.num_terms,
        ops=tuple(args.ops),
        instruction=args.instruction,
    )
    return _report(written)


def _run_reasoning_gym(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlkit.data.environment import write_environment_rows
    from rlkit.errors import RecipeError
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.load import apply_overrides

    component = {
        "name": "reasoning_gym",
        "task": args.task,
        "size": args.size,
        "val_size": args.val_size,
        "seed": args.seed,
    }
    problems = apply_overrides(component, args.params)
    if not problems:
        resolved, problems = resolve(
            "rlkit data reasoning-gym", "environments", component, build_registries()
        )
    if problems:
        raise RecipeError(problems)
    out = Path(args.output)
    train, val = write_environment_rows(resolved, out)
    written = {"train": train[0]}
    if val:
        written["test"] = str(Path(val[0]).replace(out / "test.parquet"))
    return _report(written)
