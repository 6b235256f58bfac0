"""Tools a multi-turn rollout may call (registry ``tools``).

Contract: ``rlkit.rollout.tools.base``. Built-ins: ``calculator`` (safe arithmetic) and ``python``
(sandboxed subprocess, ``rlkit.rollout.tools.sandbox``).
"""

from __future__ import annotations

from rlkit.rollout.tools.base import Tool, ToolResult, call_tool, truncate

__all__ = ["Tool", "ToolResult", "call_tool", "truncate", "build_tools"]


def build_tools(resolved) -> dict[str, Tool]:
    """Instantiate resolved tool components (``rlkit.recipe.compose.Resolved``, from the driver's pipeline),
    by the name the model calls them with."""
    tools: dict[str, Tool] = {}
    for component in resolved:
        tool = component.build()
        tools[tool.name or component.name] = tool
    return tools
