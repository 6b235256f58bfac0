"""``rlkit validate RECIPE [overrides]`` and ``rlkit recipe show RECIPE [overrides]``."""

from __future__ import annotations

import argparse

import yaml

from rlkit.recipe import load_recipe, recipe_to_dict, uses_critic, uses_ref
from rlkit.registry import build_registries


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, ~key.sub removes a key")
    parser.add_argument("--no-check-files", action="store_true", help="do not check that data files exist")


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
    recipe = load_recipe(args.recipe, args.overrides, registries=registries, check_files=not args.no_check_files)
    roles = ["actor_rollout_ref"] + (["critic"] if uses_critic(recipe, registries) else []) + (["ref"] if uses_ref(recipe) else [])
    print(
        f"{args.recipe}: valid. estimator={recipe.algorithm.estimator} policy_loss={recipe.actor.policy_loss} "
        f"rollout={recipe.rollout.backend} n={recipe.rollout.n} roles={','.join(roles)}"
    )
    return 0


def run_show(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides, check_files=not args.no_check_files)
    print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False), end="")
    return 0
