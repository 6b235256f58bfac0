"""The tool contract for multi-turn rollouts, and the one safe way to call a tool.

A tool is registered in ``tools`` (``ToolSpec.cls``) and constructed as ``cls(**config)`` (the
config is optional and tool-specific). It describes itself in the OpenAI function format, which is
what chat templates accept as ``tools=``::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": <JSON schema>}}

``await tool.execute(arguments, **tools_kwargs) -> ToolResult`` runs one call. ``arguments`` is the
``"arguments"`` object the model wrote; ``tools_kwargs`` are the row's per-tool keyword arguments
(``extra_info.tools_kwargs[tool_name]``, veRL's name), e.g. a ground truth the tool may check.

The agent loop never calls ``execute`` directly: it calls ``call_tool``, which checks the required
arguments and turns every exception into a failed ``ToolResult`` — a bad tool call becomes an error
message in the trajectory, never an exception out of the rollout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["Tool", "ToolResult", "call_tool", "truncate"]


@dataclass
class ToolResult:
    """What a tool call returns to the conversation."""

    text: str  # the content of the `tool` message the model sees next
    ok: bool = True  # False: the call failed (bad arguments, sandbox violation, ...); text says why
    metrics: dict[str, Any] = field(default_factory=dict)  # numbers for logging (e.g. wall_s)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]"


class Tool:
    """Base class: set ``name``, ``description`` and ``parameters``; implement ``execute``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # JSON schema of the arguments object (OpenAI function "parameters").
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}, "required": []}

    def __init__(self, **config: Any):
        self.config = config

    def schema(self) -> dict[str, Any]:
        """The OpenAI function description, for ``tokenizer.apply_chat_template(..., tools=[...])``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def execute(self, arguments: dict[str, Any], **tools_kwargs: Any) -> ToolResult:
        raise NotImplementedError(f"tool {self.name!r} does not implement execute()")


async def call_tool(tool: Tool, arguments: Any, **tools_kwargs: Any) -> ToolResult:
    """Run one call of ``tool``; never raises (every failure is a ``ToolResult`` with ``ok=False``)."""
    start = time.perf_counter()
    if not isinstance(arguments, dict):
        return ToolResult(
            f"Error: arguments of tool '{tool.name}' must be a JSON object, got {type(arguments).__name__}.",
            ok=False,
        )
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return ToolResult(
            f"Error: tool '{tool.name}' is missing required argument(s): {', '.join(missing)}.", ok=False
        )
    try:
        result = await tool.execute(arguments, **tools_kwargs)
    except Exception as exc:  # a tool bug must not end the rollout
        result = ToolResult(f"Error: tool '{tool.name}' failed: {type(exc).__name__}: {exc}", ok=False)
    if not isinstance(result, ToolResult):
        result = ToolResult(str(result))
    result.metrics.setdefault("wall_s", time.perf_counter() - start)
    return result
