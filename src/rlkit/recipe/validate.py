"""Turn a YAML file plus overrides into a validated ``Recipe``.

Order: load YAML → component short forms become ``{name: ...}`` → apply overrides → apply the
estimator's recipe defaults (only to keys the user did not set) → every component's name and
parameters through ``rlkit.recipe.compose.resolve`` (the resolver composition uses, so what validates is
what runs) → schema validation → cross-field rules (including the role plan) → files and this machine
(``rlkit.recipe.checks_files``). The cross-field rules are ``rlkit.recipe.rules``. Every problem found is
collected; ``RecipeError`` lists them all at once.
Relative paths in a recipe are relative to the working directory, as in veRL.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlkit.errors import RecipeError
from rlkit.plugin.registry import Registries, build_registries, suggest
from rlkit.recipe.checks_files import check_machine
from rlkit.recipe.compose import COMPONENT_KEYS, COMPONENT_LISTS, params_model, resolve
from rlkit.recipe.load import apply_overrides, get_path, has_path, load_yaml, set_path
from rlkit.recipe.rules import check_rules, role_world_size, uses_critic, uses_ref
from rlkit.recipe.schema import Recipe

__all__ = ["load_recipe", "validate_recipe", "recipe_to_dict", "uses_critic", "uses_ref", "role_world_size"]


def load_recipe(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    registries: Registries | None = None,
    check_files: bool = True,
) -> Recipe:
    """Load, override and validate a recipe file. Raises ``RecipeError`` listing every problem."""
    raw = load_yaml(path)
    return validate_recipe(
        raw, list(overrides), source=str(path), registries=registries, check_files=check_files
    )


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
    _long_forms(raw)
    problems = []
    for override in overrides or []:  # one at a time: `estimator=ppo` then `estimator.lam=0.9` works
        problems += apply_overrides(raw, [override])
        _long_forms(raw)
    explicit = copy.deepcopy(raw)  # what the user wrote, before estimator defaults
    _apply_estimator_defaults(raw, registries)
    problems += _check_components(raw, registries)

    recipe = None
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        problems += [(_loc(err["loc"]), _message(err)) for err in exc.errors()]
        recipe = _validate_without_unknown_keys(raw, exc)  # so the rules below still run
    if recipe is not None:
        problems += check_rules(recipe, explicit, registries)
        if check_files:
            problems += check_machine(recipe, registries)
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
        hint = (
            suggest(str(err["loc"][-1]), valid) or f" Valid keys here: {', '.join(valid)}." if valid else ""
        )
        return "unknown key." + hint + " (`rlkit recipe show` prints every key with its value)"
    if err["type"] == "missing":
        return "required key is missing"
    value = err.get("input")
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return f"{err['msg']} (got {shown})"


def _default_name(key: str) -> str | None:
    """The schema's default component name at ``key`` (``actor.policy_loss`` → ``ppo_clip``)."""
    section, field = key.split(".")
    factory = Recipe.model_fields[section].default_factory
    if factory is None:  # a required section (data): its optional components default to none
        return None
    default = factory().__class__.model_fields[field].default
    return getattr(default, "name", None)


def _long_forms(raw: dict) -> None:
    """``estimator: grpo`` → ``estimator: {name: grpo}`` so overrides and defaults can reach parameters;
    parameters given without a name (``actor.policy_loss.clip_ratio_high=0.28``) belong to the default."""
    for key in COMPONENT_KEYS:
        value = get_path(raw, key)
        if value is None and not has_path(raw, key) and _default_name(key):  # absent: the schema's default,
            value = _default_name(key)  # written out so its parameters get their defaults too
        if isinstance(value, str):
            try:
                set_path(raw, key, {"name": value})
            except ValueError:
                pass  # the section itself is not a mapping; schema validation reports it
        elif isinstance(value, dict) and "name" not in value and _default_name(key):
            value["name"] = _default_name(key)
    for key in COMPONENT_LISTS:
        values = get_path(raw, key)
        if isinstance(values, list):
            set_path(raw, key, [{"name": v} if isinstance(v, str) else v for v in values])


def _check_components(raw: dict, registries: Registries) -> list[tuple[str, str]]:
    """Every component's name and parameters; valid ones get their defaults written in (``recipe show``)."""
    problems = []
    for key, kind in COMPONENT_KEYS.items():
        value = get_path(raw, key)
        if value is None:
            continue
        resolved, more = resolve(key, kind, value, registries)
        problems += more
        if resolved is not None:
            set_path(
                raw, key, {"name": value["name"] if isinstance(value, dict) else value, **resolved.kwargs}
            )
    for key, kind in COMPONENT_LISTS.items():
        values = get_path(raw, key)
        for i, value in enumerate(values if isinstance(values, list) else []):
            resolved, more = resolve(f"{key}.{i}", kind, value, registries)
            problems += more
            if resolved is not None:
                values[i] = {"name": value["name"] if isinstance(value, dict) else value, **resolved.kwargs}
    return problems


def _accepts(raw: dict, key: str, registries: Registries) -> bool:
    """Whether a default at ``key`` can apply: a component parameter only if that component has it."""
    for component_key, kind in COMPONENT_KEYS.items():
        prefix = component_key + "."
        if key.startswith(prefix):
            name = get_path(raw, component_key + ".name")
            if not isinstance(name, str) or name not in registries[kind]:
                return False
            model = params_model(registries[kind].get(name))
            return model is not None and key[len(prefix) :].split(".")[0] in model.model_fields
    return True


def _apply_estimator_defaults(raw: dict, registries: Registries) -> None:
    name = get_path(raw, "algorithm.estimator.name", "grpo")
    if not isinstance(name, str) or name not in registries.estimators:
        return
    for key, value in registries.estimators.get(name).recipe_defaults.items():
        if not has_path(raw, key) and _accepts(raw, key, registries):
            try:
                set_path(raw, key, copy.deepcopy(value))
            except ValueError:
                pass  # the user's own value at that path is wrong; schema validation reports it


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The effective recipe as plain data (what `rlkit recipe show` prints and MLflow records)."""
    return recipe.model_dump(mode="json")
