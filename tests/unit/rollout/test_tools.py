"""The calculator never evaluates anything but arithmetic; call_tool never raises; registry wiring."""

from __future__ import annotations

import asyncio

import pytest

from rlkit.rollout.tools import Tool, ToolResult, build_tools, call_tool
from rlkit.rollout.tools.calculator import CalculatorError, CalculatorTool, evaluate


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("-(4 - 10) // 4", 1),  # 6 // 4
        ("7 % 4 + 2 ** 10", 1027),
        ("1 / 4", 0.25),
        ("-2 ** 2", -4),  # Python precedence: -(2 ** 2)
        ("2 ** -1", 0.5),
        ("  3.5*2 ", 7.0),
        ("10 ** 100", 10**100),  # 101 digits: under the default bound of 1000
    ],
)
def test_calculator_evaluates_arithmetic(expression, expected):
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x + 1", "Name is not allowed"),
        ("abs(-1)", "Call is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "constant 'a' is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("True + 1", "constant True is not allowed"),
        ("[1][0]", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("9 ** 9 ** 9", "exponent"),
        ("(10 ** 90) ** 90", "digits"),  # 8101 digits: refused before it is computed
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "not finite"),
    ],
)
def test_calculator_refuses_everything_else(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_calculator_tool_reports_errors_as_results():
    tool = CalculatorTool()
    ok = asyncio.run(call_tool(tool, {"expression": "(12 + 7) * 3"}))
    assert (ok.text, ok.ok) == ("57", True)
    assert asyncio.run(call_tool(tool, {"expression": "8 / 2"})).text == "4"
    bad = asyncio.run(call_tool(tool, {"expression": "open('x')"}))
    assert not bad.ok and bad.text.startswith("Error:")
    missing = asyncio.run(call_tool(tool, {"expr": "1"}))
    assert not missing.ok and "missing required argument(s): expression" in missing.text
    not_obj = asyncio.run(call_tool(tool, "1+1"))
    assert not not_obj.ok and "JSON object" in not_obj.text


def test_call_tool_turns_a_crashing_tool_into_an_error_result():
    class Broken(Tool):
        name = "broken"

        async def execute(self, arguments, **kw):
            raise RuntimeError("boom")

    res = asyncio.run(call_tool(Broken(), {}))
    assert isinstance(res, ToolResult) and not res.ok
    assert "RuntimeError: boom" in res.text and "wall_s" in res.metrics


def test_tool_schema_is_openai_function_format():
    schema = CalculatorTool().schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_builtin_tools_come_from_the_registry():
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.rollout.tools.python import PythonTool
    from rlkit.rollout.tools.sandbox import SandboxLimits

    registries = build_registries()
    assert {"calculator", "python"} <= set(registries.tools.names())
    resolved = [
        resolve(f"rollout.tools.{i}", "tools", name, registries)
        for i, name in enumerate(["calculator", "python"])
    ]
    assert not any(problems for _, problems in resolved)
    tools = build_tools([component for component, _ in resolved])
    assert sorted(tools) == ["calculator", "python"]
    assert type(tools["calculator"]).__name__ == "CalculatorTool"
    assert type(tools["python"]).__name__ == "PythonTool" and tools["python"].limits == SandboxLimits()
    assert PythonTool(wall_s=3).limits.wall_s == 3
