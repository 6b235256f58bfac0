"""Tools a multi-turn rollout may call (registry ``tools``).

Contract: ``rlkit.rollout.tools.base``. Built-ins: ``calculator`` (safe arithmetic) and ``python``
(sandboxed subprocess, ``rlkit.rollout.tools.sandbox``).
"""

from __future__ import annotations

from rlkit.rollout.tools.base import Tool, ToolResult, call_tool, truncate

__all__ = ["Tool", "ToolResult", "call_tool", "truncate", "build_tools"]


def build_tools(names: list[str], registries=None, config: dict | None = None) -> dict[str, Tool]:
    """Instantiate the named tools from the ``tools`` registry; ``config[name]`` is passed as kwargs."""
    from rlkit.registry import build_registries, load_object

    registries = registries or build_registries()
    config = config or {}
    tools: dict[str, Tool] = {}
    for name in names:
        spec = registries.tools.get(name)
        cls = load_object(spec.cls)
        tool = cls(**config.get(name, {}))
        tools[tool.name or name] = tool
    return tools
