"""Typed registries built from hook results.

``build_registries(plugins)`` calls every ``rlkit_register_<kind>s`` hook implementation one by
one (so each entry knows which plugin gave it), checks the specs, and refuses duplicates with
both plugins named. ``Registry.get(name)`` raises ``UnknownNameError`` listing the valid names
with a did-you-mean.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rlkit.errors import PluginError, UnknownNameError
from rlkit.plugin.hookspecs import REGISTRY_KINDS
from rlkit.plugin.manager import PluginSet, PluginSource, make_plugin_manager
from rlkit.plugin.specs import Spec

__all__ = ["Entry", "Registry", "Registries", "build_registries", "load_object", "suggest", "KNOWN_PROVIDERS"]

S = TypeVar("S", bound=Spec)

# Well-known names that a separately installed package registers: (registry kind, name) -> the install hint.
# Kept small: only the packages this repository ships under plugins/.
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    ("rollout_backends", "sglang"): (
        "pip install rlkit-sglang (or rlkit[sglang]; from a checkout: "
        "pip install -e plugins/rlkit-sglang), plus SGLang itself "
        "(docs/sglang.md)"
    ),
    ("rollout_backends", "vllm"): (
        "pip install rlkit-vllm (from a checkout: pip install -e "
        "plugins/rlkit-vllm), plus vLLM itself (docs/vllm.md)"
    ),
    ("environments", "reasoning_gym"): (
        "pip install -e plugins/rlkit-reasoning-gym (it installs reasoning-gym; docs/environments.md)"
    ),
    ("environments", "textarena"): (
        "pip install -e plugins/rlkit-textarena (it installs textarena; docs/environments.md)"
    ),
    ("environments", "verifiers"): (
        "pip install -e plugins/rlkit-verifiers (it installs verifiers 0.4.0; docs/environments.md)"
    ),
    ("agent_loops", "verifiers"): (
        "pip install -e plugins/rlkit-verifiers (it installs verifiers 0.4.0; docs/environments.md)"
    ),
}


def suggest(name: str, valid: list[str]) -> str:
    """`" Did you mean 'x'?"` or an empty string."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def load_object(ref: Any) -> Any:
    """Resolve a ``"package.module:attr"`` reference (lazy specs keep start-up imports light)."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Entry(Generic[S]):
    spec: S
    source: PluginSource


class Registry(Generic[S]):
    """Entries of one kind, by name; aliases resolve to their entry."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[S]] = {}
        self._aliases: dict[str, str] = {}

    def add(self, spec: S, source: PluginSource) -> None:
        for key in (spec.name, *spec.aliases):
            owner = self._owner(key)
            if owner is not None:
                raise PluginError(
                    f"registry '{self.kind}': name '{key}' is registered twice, by {owner.source} "
                    f"and by {source}. Uninstall one of the two packages, or rename the entry in one."
                )
        self._entries[spec.name] = Entry(spec, source)
        for alias in spec.aliases:
            self._aliases[alias] = spec.name

    def _owner(self, key: str) -> Entry[S] | None:
        name = self._aliases.get(key, key)
        return self._entries.get(name)

    def get(self, name: str) -> S:
        return self.entry(name).spec

    def entry(self, name: str) -> Entry[S]:
        found = self._owner(name)
        if found is None:
            raise UnknownNameError(self.unknown_message(name))
        return found

    def unknown_message(self, name: str) -> str:
        valid = self.names(with_aliases=True)
        provider = KNOWN_PROVIDERS.get((self.kind, name))
        if provider is not None:
            installed = ", ".join(valid) or "(none registered)"
            return (
                f"unknown {self.kind} entry '{name}': it is provided by a plugin that is not installed. "
                f"Install it with: {provider}. Installed names: {installed}."
            )
        return (
            f"unknown {self.kind} entry '{name}'. Valid names: {', '.join(valid) or '(none registered)'}."
            + suggest(name, valid)
        )

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._owner(name) is not None

    def names(self, with_aliases: bool = False) -> list[str]:
        names = list(self._entries)
        if with_aliases:
            names += list(self._aliases)
        return sorted(names)

    def __iter__(self) -> Iterator[Entry[S]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.spec.name))

    def __len__(self) -> int:
        return len(self._entries)


class Registries:
    """One ``Registry`` per kind in ``hookspecs.REGISTRY_KINDS``, as attributes."""

    estimators: Registry
    policy_losses: Registry
    reward_managers: Registry
    compute_scores: Registry
    rollout_backends: Registry
    roles: Registry
    trackers: Registry
    tools: Registry
    agent_loops: Registry
    rollout_corrections: Registry
    environments: Registry

    def __init__(self, plugins: PluginSet):
        self.plugins = plugins
        for kind in REGISTRY_KINDS:
            setattr(self, kind, Registry(kind))

    def __getitem__(self, kind: str) -> Registry:
        if kind not in REGISTRY_KINDS:
            raise UnknownNameError(f"unknown registry '{kind}'. Valid: {', '.join(REGISTRY_KINDS)}.")
        return getattr(self, kind)

    def items(self) -> list[tuple[str, Registry]]:
        return [(kind, getattr(self, kind)) for kind in REGISTRY_KINDS]


def build_registries(plugins: PluginSet | None = None, *, allow_broken: bool = False) -> Registries:
    """Fill the registries from every plugin's hooks.

    Raises ``PluginError`` if a plugin failed to load (unless ``allow_broken``), returned
    something that is not a spec of the right type, or claimed a name another plugin holds.
    """
    plugins = plugins or make_plugin_manager()
    if plugins.broken and not allow_broken:
        raise PluginError(
            "rlkit cannot start because a plugin failed to load:\n"
            + "\n".join(f"  - {b.describe()}" for b in plugins.broken)
            + "\nFix or uninstall that package (`rlkit plugins` shows everything that loaded)."
        )
    registries = Registries(plugins)
    for kind, (hook_name, spec_type) in REGISTRY_KINDS.items():
        caller = getattr(plugins.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):  # registration order
            source = plugins.source_of(impl.plugin)
            try:
                specs = impl.function()
            except Exception as exc:
                raise PluginError(f"{source}: hook {hook_name}() raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(specs, (list, tuple)):
                raise PluginError(
                    f"{source}: hook {hook_name}() must return a list of {spec_type.__name__}, got "
                    f"{type(specs).__name__}."
                )
            for spec in specs:
                if not isinstance(spec, spec_type):
                    raise PluginError(
                        f"{source}: hook {hook_name}() returned a {type(spec).__name__}; "
                        f"it must return {spec_type.__name__} objects (from rlkit.plugin.specs)."
                    )
                registries[kind].add(spec, source)
    return registries
