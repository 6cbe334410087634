"""calculator: evaluates an arithmetic expression safely (no eval of arbitrary code).

Every value, intermediate ones included, is bounded (MAX_BITS for integers; floats overflow
on their own), so no expression of MAX_CHARS characters takes more than microseconds:
`9**9**9**9` is refused before it is computed.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_BITS = 1024  # about 308 decimal digits, a float's range
MAX_CHARS = 200


def calculate(expression: str) -> str:
    """The value of `expression` as text, or "error: ..." (never raises)."""
    if len(expression) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError, MemoryError, RecursionError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent above {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_BITS:
                raise ValueError(f"result above {MAX_BITS} bits")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ValueError("complex result")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"result above {MAX_BITS} bits")
    return value
