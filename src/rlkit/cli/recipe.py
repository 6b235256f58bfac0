"""``rlkit validate RECIPE [overrides]`` and ``rlkit recipe show RECIPE [overrides]``."""

from __future__ import annotations

import argparse
import sys

import yaml

from rlkit.errors import RecipeError
from rlkit.plugin.registry import Registries, build_registries
from rlkit.recipe import Recipe, load_recipe, recipe_to_dict, uses_ref


def add_smoke_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="laptop profile: same algorithm, tiny model, a few rows, CPU, two steps (prints what it swaps)",
    )
    parser.add_argument(
        "--smoke-model",
        choices=("tiny", "smollm2"),
        default=None,
        help="with --smoke: tiny (random Qwen2 built locally, the default) or smollm2 (SmolLM2-135M)",
    )
    parser.add_argument(
        "--keep-backend",
        action="store_true",
        help="with --smoke: keep the recipe's rollout backend (e.g. sglang; its plugin must "
        "be installed) instead of hf; only its sizes shrink (one replica, tp 1)",
    )


def load_from_args(args: argparse.Namespace, registries: Registries, check_files: bool = True) -> Recipe:
    """The recipe the command line names: the file, ``--smoke`` applied (its table printed to stderr),
    overrides."""
    if args.smoke_model and not args.smoke:
        raise RecipeError(
            [("--smoke-model", "only means something with --smoke; add --smoke or drop it")], args.recipe
        )
    if args.keep_backend and not args.smoke:
        raise RecipeError(
            [("--keep-backend", "only means something with --smoke; add --smoke or drop it")], args.recipe
        )
    if not args.smoke:
        return load_recipe(args.recipe, args.overrides, registries=registries, check_files=check_files)
    from rlkit.cli.smoke import load_smoke_recipe

    recipe, table = load_smoke_recipe(
        args.recipe,
        args.overrides,
        registries=registries,
        model=args.smoke_model or "tiny",
        check_files=check_files,
        keep_backend=args.keep_backend,
    )
    print(table, file=sys.stderr)
    return recipe


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, ~key.sub removes a key")
    parser.add_argument("--no-check-files", action="store_true", help="do not check that data files exist")
    add_smoke_args(parser)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    validate = subparsers.add_parser("validate", help="report every problem in a recipe, start nothing")
    _recipe_args(validate)
    validate.set_defaults(func=run_validate)

    recipe = subparsers.add_parser("recipe", help="inspect recipes")
    recipe_sub = recipe.add_subparsers(dest="recipe_command", metavar="SUBCOMMAND", required=True)
    show = recipe_sub.add_parser("show", help="print the effective recipe (defaults and overrides applied)")
    _recipe_args(show)
    show.set_defaults(func=run_show)


def run_validate(args: argparse.Namespace) -> int:
    registries = build_registries()
    recipe = load_from_args(args, registries, check_files=not args.no_check_files)
    from rlkit.recipe.compose import compose

    placed = compose(recipe, registries).roles  # what a run would build: the same resolver
    roles = [f"{slot}={r.role.name}@{r.pool}" for slot, r in placed.items()]
    if uses_ref(recipe) and "ref" not in placed:
        roles.append("ref=colocated")
    print(
        f"{args.recipe}{' --smoke' if args.smoke else ''}: valid. estimator={recipe.algorithm.estimator} "
        f"policy_loss={recipe.actor.policy_loss} rollout={recipe.rollout.backend} n={recipe.rollout.n} "
        f"roles={','.join(roles)}"
    )
    return 0


def run_show(args: argparse.Namespace) -> int:
    recipe = load_from_args(args, build_registries(), check_files=not args.no_check_files)
    print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False), end="")
    return 0
