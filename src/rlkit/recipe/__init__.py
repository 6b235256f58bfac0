"""Recipes: a pydantic schema, YAML loading, ``a.b=c`` overrides and composition."""

from rlkit.recipe.schema import Recipe
from rlkit.recipe.validate import (
    load_recipe,
    recipe_to_dict,
    role_world_size,
    uses_critic,
    uses_ref,
    validate_recipe,
)

__all__ = [
    "Recipe",
    "load_recipe",
    "validate_recipe",
    "recipe_to_dict",
    "uses_critic",
    "uses_ref",
    "role_world_size",
]
