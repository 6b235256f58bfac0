"""Build the plugin manager: hookspecs → built-in modules → entry points → ``check_pending()``.

Nothing here runs at import time; every caller (the CLI, the trainer, each test) builds its own
manager, so no global registry is ever mutated.

Two entry-point groups are read:

- ``rlkit``: a module (or object) of ``@rlkit.hookimpl`` functions, like the built-ins.
- ``rlkit.compute_score``: a plain ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None)`` function; the entry point's name is the ``data_source`` it scores.

A plugin that fails to import does not stop the others from loading: it is recorded in
``PluginSet.broken`` and the registries refuse to build from a set with broken plugins unless
asked to (``rlkit plugins`` asks, so it can show the broken one beside the rest).
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from rlkit.errors import PluginError
from rlkit.plugin import hookspecs
from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import ComputeScoreSpec

__all__ = [
    "BUILTIN_MODULES",
    "ENTRY_POINT_GROUP",
    "SCORE_ENTRY_POINT_GROUP",
    "PluginSource",
    "BrokenPlugin",
    "PluginSet",
    "make_plugin_manager",
]

ENTRY_POINT_GROUP = "rlkit"
SCORE_ENTRY_POINT_GROUP = "rlkit.compute_score"

# Modules of hook implementations that register every built-in.
BUILTIN_MODULES = (
    "rlkit.builtin.algorithms",
    "rlkit.builtin.rewards",
    "rlkit.builtin.rollout",
    "rlkit.builtin.workers",
    "rlkit.builtin.tracking",
    "rlkit.builtin.tools",
)


@dataclass(frozen=True)
class PluginSource:
    """Where a registered plugin came from, for `rlkit plugins` and error messages."""

    plugin: str  # the plugin's name in the manager
    package: str  # distribution name ("rlkit" for built-ins)
    version: str

    def __str__(self) -> str:
        return f"{self.plugin} (package {self.package} {self.version})"


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that could not be loaded."""

    entry_point: str  # "name = module:attr"
    group: str
    package: str
    version: str
    error: str  # the exception, one line
    traceback: str = ""

    def describe(self) -> str:
        return (
            f"entry point '{self.entry_point}' in group '{self.group}' of package "
            f"{self.package} {self.version} failed to load: {self.error}"
        )


@dataclass
class PluginSet:
    """A plugin manager plus what rlkit knows about each plugin's origin."""

    pm: pluggy.PluginManager
    sources: dict[str, PluginSource] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)

    def source_of(self, plugin: object) -> PluginSource:
        name = self.pm.get_name(plugin) or repr(plugin)
        return self.sources.get(name, PluginSource(name, "unknown", "unknown"))


def _rlkit_version() -> str:
    try:
        return metadata.version("rlkit")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "source"


def _dist_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", "unknown"
    return dist.metadata["Name"] or "unknown", dist.version or "unknown"


class _ScoreEntryPoint:
    """Adapts one ``rlkit.compute_score`` entry point to the ``compute_scores`` hook."""

    def __init__(self, data_source: str, fn: Any):
        self.data_source = data_source
        self.fn = fn

    @hookimpl
    def rlkit_register_compute_scores(self) -> list[ComputeScoreSpec]:
        doc = (getattr(self.fn, "__doc__", None) or "").strip().splitlines()
        return [ComputeScoreSpec(name=self.data_source, fn=self.fn, description=doc[0] if doc else "")]


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    # Deduplicate: an editable install can expose the same distribution twice on sys.path.
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        seen.setdefault((ep.name, ep.value), ep)
    return sorted(seen.values(), key=lambda ep: ep.name)


def make_plugin_manager(
    *, entry_points: bool = True, extra_plugins: tuple[tuple[str, object], ...] = ()
) -> PluginSet:
    """Build a fresh plugin manager.

    Args:
        entry_points: also load third-party plugins from the ``rlkit`` and ``rlkit.compute_score``
            entry-point groups (tests turn this off to get only the built-ins).
        extra_plugins: ``(name, plugin)`` pairs registered after the built-ins, as if they came
            from entry points (tests use this instead of installing packages).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    plugins = PluginSet(pm)
    version = _rlkit_version()

    for module_name in BUILTIN_MODULES:
        module = importlib.import_module(module_name)
        pm.register(module, name=module_name)
        plugins.sources[module_name] = PluginSource(module_name, "rlkit", version)

    if entry_points:
        for ep in _entry_points(ENTRY_POINT_GROUP):
            _load_entry_point(plugins, ep, ENTRY_POINT_GROUP)
        for ep in _entry_points(SCORE_ENTRY_POINT_GROUP):
            _load_entry_point(plugins, ep, SCORE_ENTRY_POINT_GROUP)

    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
        plugins.sources[name] = PluginSource(name, "(registered in code)", "-")

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"plugin {exc.plugin!r} implements a hook rlkit does not define: {exc}. "
            f"Valid hooks: {', '.join(name for name, _ in hookspecs.REGISTRY_KINDS.values())}."
        ) from exc
    return plugins


def _load_entry_point(plugins: PluginSet, ep: metadata.EntryPoint, group: str) -> None:
    package, version = _dist_of(ep)
    name = f"{group}:{ep.name}"
    try:
        obj = ep.load()
        plugin = _ScoreEntryPoint(ep.name, obj) if group == SCORE_ENTRY_POINT_GROUP else obj
        if group == SCORE_ENTRY_POINT_GROUP and not callable(obj):
            raise TypeError(f"{ep.value} is a {type(obj).__name__}, not a function")
        plugins.pm.register(plugin, name=name)
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not hide the others
        plugins.broken.append(
            BrokenPlugin(
                entry_point=f"{ep.name} = {ep.value}",
                group=group,
                package=package,
                version=version,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
        )
        return
    plugins.sources[name] = PluginSource(name, package, version)
