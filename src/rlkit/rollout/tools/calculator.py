"""``calculator``: arithmetic on numbers, evaluated by walking the ``ast`` — never ``eval``.

Allowed: int and float literals, ``+ - * / // % **``, unary ``+``/``-``, parentheses. Anything
else (names, calls, attributes, subscripts, strings, comparisons) is refused. Exponents are bounded
(``|exponent| <= max_exponent``) and so are intermediate integers (``max_digits``), so
``9**9**9`` is refused instead of hanging the rollout.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rlkit.rollout.tools.base import Tool, ToolResult

__all__ = ["CalculatorTool", "evaluate", "CalculatorError"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def evaluate(
    expression: str, *, max_exponent: int = 100, max_digits: int = 1000, max_length: int = 500
) -> float | int:
    """The value of an arithmetic ``expression``; raises ``CalculatorError`` for anything else."""
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression ({exc.msg})") from None

    def check(value: Any) -> Any:
        if isinstance(value, int) and value.bit_length() > max_digits * 3.33:
            raise CalculatorError(f"result has more than {max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite")
        return value

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise CalculatorError(f"exponent {right} is larger than {max_exponent}")
            if (
                isinstance(node.op, ast.Pow)
                and isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() * right > max_digits * 3.33
            ):
                raise CalculatorError(f"result has more than {max_digits} digits")
            try:
                return check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result is too large") from None
        what = type(node).__name__
        if isinstance(node, ast.Constant):
            what = f"constant {node.value!r}"
        raise CalculatorError(f"{what} is not allowed (only numbers, + - * / // % **, parentheses)")

    value = walk(tree)
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("result is not a real number")
    return value


def _format(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
        "required": ["expression"],
    }

    async def execute(self, arguments: dict[str, Any], **tools_kwargs: Any) -> ToolResult:
        expression = arguments["expression"]
        if not isinstance(expression, str):
            expression = str(expression)
        try:
            value = evaluate(expression, max_exponent=int(self.config.get("max_exponent", 100)))
        except CalculatorError as exc:
            return ToolResult(f"Error: {exc}", ok=False)
        return ToolResult(_format(value))
