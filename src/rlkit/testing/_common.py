"""What every check shares: the failure type, naming the component, resolving a spec or a name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlkit.errors import RlkitError

__all__ = ["ContractError", "resolve_component", "who"]


class ContractError(RlkitError, AssertionError):
    """A component broke its contract. An ``AssertionError``, so any test runner reports it as a failure;
    the message names the component, what was expected, what came back, and where the contract is."""


def who(resolved: Any) -> str:
    """``estimators entry 'grpo' (from rlkit.builtin.algorithms (package rlkit 0.1.0))``."""
    return f"{resolved.kind} entry '{resolved.name}' (from {resolved.source})"


def resolve_component(kind: str, component: Any, params: Mapping[str, Any], registries: Any = None) -> Any:
    """``component`` → ``rlkit.recipe.compose.Resolved`` with ``params`` validated against its params model.

    ``component`` is a registered name (looked up in ``registries``, default: a fresh
    ``build_registries(make_plugin_manager())``, so installed plugins count), a spec of the registry's
    type (no installation needed), or, for class-carrying registries, the class itself.
    """
    from rlkit.plugin.hookspecs import REGISTRY_KINDS
    from rlkit.plugin.manager import PluginSource
    from rlkit.plugin.registry import Registry
    from rlkit.recipe.compose import resolve

    spec_type = REGISTRY_KINDS[kind][1]
    if isinstance(component, str):
        if registries is None:
            from rlkit.plugin.manager import make_plugin_manager
            from rlkit.plugin.registry import build_registries

            registries = build_registries(make_plugin_manager())
        name = component
    else:
        if isinstance(component, type) and "cls" in spec_type.__dataclass_fields__:
            component = spec_type(name=component.__name__, cls=component)
        if not isinstance(component, spec_type):
            raise ContractError(
                f"rlkit.testing: expected a name, a {spec_type.__name__} or a class for registry "
                f"`{kind}`, got {type(component).__name__} {component!r}."
            )
        one = Registry(kind)
        one.add(component, PluginSource("(spec given to rlkit.testing)", "-", "-"))
        registries, name = {kind: one}, component.name
    resolved, problems = resolve(f"<{kind}>", kind, {"name": name, **params}, registries)
    if problems:
        lines = "\n".join(f"  - {key}: {msg}" for key, msg in problems)
        raise ContractError(
            f"rlkit.testing could not resolve {kind} entry '{name}' with parameters {dict(params)}:\n{lines}"
        )
    return resolved
