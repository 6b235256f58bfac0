"""Registers rlkit's built-in tools entries through the public hooks."""

from __future__ import annotations

from rlkit.builtin.params import PythonToolParams
from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import ToolSpec


@hookimpl
def rlkit_register_tools() -> list[ToolSpec]:
    return [
        ToolSpec(
            name="calculator",
            cls="rlkit.rollout.tools.calculator:CalculatorTool",
            description="safe arithmetic (numbers, + - * / // % **, parentheses); no eval",
        ),
        ToolSpec(
            name="python",
            cls="rlkit.rollout.tools.python:PythonTool",
            params=PythonToolParams,
            description="Python in a sandboxed subprocess: time, CPU, memory limits; no network",
        ),
    ]
