"""Turn a YAML file plus overrides into a validated ``Recipe``: the one place parts meet.

Order: load YAML → apply overrides → apply the estimator's recipe defaults (only to keys the user
did not set) → schema validation → names against the live registries → cross-field rules →
files. Every problem found is collected; ``RecipeError`` lists them all at once.
Relative paths in a recipe are relative to the working directory, as in veRL.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlkit.errors import RecipeError
from rlkit.recipe.load import apply_overrides, get_path, has_path, load_yaml, set_path
from rlkit.recipe.schema import CriticConfig, Recipe
from rlkit.registry import Registries, build_registries, suggest

__all__ = ["load_recipe", "validate_recipe", "recipe_to_dict", "uses_critic", "uses_ref", "role_world_size"]

# recipe key -> registry kind, for names checked against the registries
_NAMED_KEYS = {
    "algorithm.estimator": "estimators",
    "actor.policy_loss": "policy_losses",
    "reward.manager": "reward_managers",
    "rollout.backend": "rollout_backends",
}
_NAMED_LISTS = {"tracking.backends": "trackers", "rollout.tools": "tools"}


def load_recipe(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    registries: Registries | None = None,
    check_files: bool = True,
) -> Recipe:
    """Load, override and validate a recipe file. Raises ``RecipeError`` listing every problem."""
    raw = load_yaml(path)
    return validate_recipe(raw, list(overrides), source=str(path), registries=registries, check_files=check_files)


def validate_recipe(
    raw: dict[str, Any],
    overrides: list[str] | None = None,
    *,
    source: str | None = None,
    registries: Registries | None = None,
    check_files: bool = True,
) -> Recipe:
    """Validate a recipe mapping (not modified). See the module docstring for the order."""
    registries = registries or build_registries()
    raw = copy.deepcopy(raw)
    problems = apply_overrides(raw, overrides or [])
    explicit = copy.deepcopy(raw)  # what the user wrote, before estimator defaults
    problems += _check_names(raw, registries)
    _apply_estimator_defaults(raw, registries)

    recipe = None
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        problems += [(_loc(err["loc"]), _message(err)) for err in exc.errors()]
        recipe = _validate_without_unknown_keys(raw, exc)  # so the rules below still run
    if recipe is not None:
        problems += _check_rules(recipe, explicit, registries)
        if check_files:
            problems += _check_files(recipe)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def _validate_without_unknown_keys(raw: dict, exc: ValidationError) -> Recipe | None:
    """Drop unknown keys (already reported) and try again; None if other errors remain."""
    if any(err["type"] != "extra_forbidden" for err in exc.errors()):
        return None
    pruned = copy.deepcopy(raw)
    for err in exc.errors():
        parent = get_path(pruned, [str(p) for p in err["loc"][:-1]]) if len(err["loc"]) > 1 else pruned
        if isinstance(parent, dict):
            parent.pop(err["loc"][-1], None)
    try:
        return Recipe.model_validate(pruned)
    except ValidationError:
        return None


def _valid_keys(loc: tuple) -> list[str]:
    """Field names of the section at ``loc`` (for did-you-mean on unknown keys)."""
    model: Any = Recipe
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if hasattr(c, "model_fields")), None)
        if model is None:
            return []
    return list(model.model_fields)


def _loc(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(err["loc"][:-1])
        hint = suggest(str(err["loc"][-1]), valid) or f" Valid keys here: {', '.join(valid)}." if valid else ""
        return "unknown key." + hint + " (`rlkit recipe show` prints every key with its value)"
    if err["type"] == "missing":
        return "required key is missing"
    value = err.get("input")
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return f"{err['msg']} (got {shown})"


def _check_names(raw: dict, registries: Registries) -> list[tuple[str, str]]:
    problems = []
    for key, kind in _NAMED_KEYS.items():
        name = get_path(raw, key)
        if isinstance(name, str) and name not in registries[kind]:
            problems.append((key, registries[kind].unknown_message(name)))
    for key, kind in _NAMED_LISTS.items():
        names = get_path(raw, key)
        for i, name in enumerate(names if isinstance(names, list) else []):
            if isinstance(name, str) and name not in registries[kind]:
                problems.append((f"{key}.{i}", registries[kind].unknown_message(name)))
    roles = get_path(raw, "resources.roles")
    for role in roles if isinstance(roles, dict) else {}:
        if role not in registries.roles:
            problems.append((f"resources.roles.{role}", registries.roles.unknown_message(role)))
    return problems


def _apply_estimator_defaults(raw: dict, registries: Registries) -> None:
    name = get_path(raw, "algorithm.estimator", "grpo")
    if not isinstance(name, str) or name not in registries.estimators:
        return
    for key, value in registries.estimators.get(name).recipe_defaults.items():
        if not has_path(raw, key):
            try:
                set_path(raw, key, copy.deepcopy(value))
            except ValueError:
                pass  # the user's own value at that path is wrong; schema validation reports it


def uses_critic(recipe: Recipe, registries: Registries) -> bool:
    """A critic runs when the estimator needs one (validation keeps ``critic.enable`` consistent)."""
    return registries.estimators.get(recipe.algorithm.estimator).needs_critic


def uses_ref(recipe: Recipe) -> bool:
    """A reference model runs when a KL term needs it, or when the recipe asks for one."""
    needed = recipe.actor.use_kl_loss or recipe.algorithm.use_kl_in_reward
    return needed if recipe.ref.enable is None else recipe.ref.enable


def role_world_size(recipe: Recipe, role: str) -> int:
    """Ranks of the pool a role is mapped to (unmapped roles use the first pool)."""
    pools = recipe.resources.pools
    pool = pools.get(recipe.resources.roles.get(role, ""), next(iter(pools.values())))
    return pool.nodes * pool.bundles_per_node


def _check_rules(recipe: Recipe, explicit: dict, registries: Registries) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = _check_batch_sizes(recipe)
    est_name = recipe.algorithm.estimator
    if est_name not in registries.estimators:
        return problems  # already reported by _check_names
    est = registries.estimators.get(est_name)
    default_critic = CriticConfig()
    critic_keys = sorted(  # critic options the user changed from their defaults
        k for k in (explicit.get("critic") or {}) if k != "enable" and getattr(recipe.critic, k, None) != getattr(default_critic, k, None)
    )
    if est.needs_critic and recipe.critic.enable is False:
        problems.append(("critic.enable", f"estimator '{est_name}' needs a critic; remove critic.enable=false or pick a critic-free estimator such as grpo"))
    if not est.needs_critic and recipe.critic.enable:
        problems.append(("critic.enable", f"estimator '{est_name}' uses no critic; set algorithm.estimator=ppo to train one, or remove critic.enable"))
    elif not est.needs_critic and critic_keys:
        problems.append((f"critic.{critic_keys[0]}", f"critic options ({', '.join(critic_keys)}) are set but estimator '{est_name}' uses no critic; remove them or set algorithm.estimator=ppo"))
    if est.needs_groups and recipe.rollout.n < 2:
        problems.append(("rollout.n", f"estimator '{est_name}' compares responses within a group; set rollout.n to 2 or more (got {recipe.rollout.n})"))
    if recipe.algorithm.filter_groups.enable and recipe.rollout.n < 2:
        problems.append(("algorithm.filter_groups.enable", "dynamic sampling filters groups of responses; it needs rollout.n >= 2"))
    if recipe.ref.enable is False and (recipe.actor.use_kl_loss or recipe.algorithm.use_kl_in_reward):
        problems.append(("ref.enable", "a KL term (actor.use_kl_loss or algorithm.use_kl_in_reward) needs the reference model; remove ref.enable=false or turn the KL term off"))
    for role, pool in recipe.resources.roles.items():
        if pool not in recipe.resources.pools:
            problems.append((f"resources.roles.{role}", f"unknown pool '{pool}'; pools: {', '.join(recipe.resources.pools)}"))
    if recipe.rollout.agent == "tool" and not recipe.rollout.tools:
        problems.append(("rollout.tools", "rollout.agent=tool needs at least one tool, e.g. rollout.tools=[calculator]"))
    return problems


def _check_batch_sizes(recipe: Recipe) -> list[tuple[str, str]]:
    problems = []
    data, actor = recipe.data, recipe.actor
    if data.train_batch_size % actor.ppo_mini_batch_size:
        problems.append(("actor.ppo_mini_batch_size", f"{actor.ppo_mini_batch_size} does not divide data.train_batch_size={data.train_batch_size}; both count prompts"))
    ranks = role_world_size(recipe, "actor")
    samples = actor.ppo_mini_batch_size * recipe.rollout.n
    if samples % ranks:
        problems.append(("actor.ppo_mini_batch_size", f"a mini-batch of {samples} samples (ppo_mini_batch_size × rollout.n) does not split evenly over {ranks} actor ranks"))
    return problems


def _check_files(recipe: Recipe) -> list[tuple[str, str]]:
    problems = []
    for key in ("train_files", "val_files"):
        for i, name in enumerate(getattr(recipe.data, key)):
            if not Path(name).expanduser().is_file():
                problems.append((f"data.{key}.{i}", f"file not found: {name} (relative paths are relative to {Path.cwd()}); `rlkit data --help` writes data sets"))
    custom = recipe.reward.custom_score
    if custom is not None and not Path(custom.path).expanduser().is_file():
        problems.append(("reward.custom_score.path", f"file not found: {custom.path}"))
    return problems


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The effective recipe as plain data (what `rlkit recipe show` prints and MLflow records)."""
    return recipe.model_dump(mode="json")
