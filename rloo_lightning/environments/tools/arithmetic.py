"""A built-in tool: :func:`calculator` evaluates arithmetic without ``eval``.

It parses the expression with :mod:`ast` and evaluates only numbers and ``+ - * / // % **`` with bounded
exponents, to a finite real number: a tool runs with the policy's arguments, which are untrusted input.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

__all__ = ["calculator"]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
_LARGEST = 10 ** 308  # about the largest float: no result beyond it (an int could have thousands of digits)


def _real(value: Any) -> float:
    """``value`` if it is a finite real number within ±1e308, else ValueError."""
    if isinstance(value, complex):
        raise ValueError(f"the result {value} is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large (beyond ±1e308)" if math.isinf(value) else "the result is undefined")
    if isinstance(value, int) and abs(value) > _LARGEST:
        raise ValueError("the result is too large (beyond ±1e308)")
    return value


def _apply(op: Callable, *args: float) -> float:
    try:
        return _real(op(*args))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large (beyond ±1e308)") from None


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _real(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _apply(_OPERATORS[type(node.op)], _evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        return _apply(_OPERATORS[type(node.op)], left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(7 + 5) * 3".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression ({err.msg})") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
