"""The built-in calculator tool: exact arithmetic on integers, decimals and fractions.

The expression is parsed into a syntax tree and each node is computed with `fractions.Fraction`:
nothing is ever `eval`ed, and sizes are bounded (input length, exponents, result digits), so a
call can neither run code nor run long. In the ground floor because two floors call it: the
tool box of an episode (rollout/tools.py) and the warm-up traces, which write its result into
their targets (data/traces.py).
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any, Mapping, Union


class ToolError(Exception):
    """A call that cannot be carried out; its message becomes the observation."""


MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 256
MAX_RESULT_DIGITS = 400

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: None}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: Union[str, Mapping[str, Any]]) -> str:
    """The exact value of an arithmetic expression: an integer (`56088`) or a fraction in lowest
    terms (`-7/3`). `^` is read as a power and `×`, `÷` as `*`, `/`; thousands separators go."""
    if isinstance(expression, Mapping):
        expression = expression.get("expression", "")
    text = str(expression).strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {text[:40]!r}") from None
    value = _value(tree.body)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            result = _power(left, right)
        else:
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise ToolError("division by zero")
            result = Fraction(_BINARY[type(node.op)](left, right))
        if max(len(str(abs(result.numerator))), len(str(result.denominator))) > MAX_RESULT_DIGITS:
            raise ToolError(f"result longer than {MAX_RESULT_DIGITS} digits")
        return result
    raise ToolError(f"not arithmetic: {type(node).__name__}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only whole-number exponents are exact")
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent beyond {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if bits * abs(int(exponent)) > MAX_RESULT_DIGITS * 3.33:
        raise ToolError(f"result longer than {MAX_RESULT_DIGITS} digits")
    return base ** int(exponent)
