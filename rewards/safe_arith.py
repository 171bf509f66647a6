"""Safe exact arithmetic over model text: parse with ``ast`` (no eval/exec), walk a whitelist.

Only integer literals, ``+ - * /``, parentheses and (optionally) ``**`` with a small integer
exponent are accepted; anything else (names, calls, attributes, subscripts, floats, strings) is
rejected. Results are exact ``Fraction``s and their size is bounded, so ``9**9**9`` or a
thousand nested multiplications are refused in microseconds instead of hanging a worker.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_CHARS = 200  # an equation longer than this is not a countdown answer
MAX_EXPONENT = 16
MAX_BITS = 256  # numerator/denominator size cap for every intermediate value
MAX_NODES = 100


class UnsafeExpressionError(ValueError):
    """The text is not a bounded arithmetic expression over integer literals."""


def _check_size(value: Fraction) -> Fraction:
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise UnsafeExpressionError("intermediate value too large")
    return value


def _eval(node: ast.AST, literals: list[int], allow_pow: bool) -> Fraction:
    if isinstance(node, ast.Constant):
        # bool is an int subclass; True/False are not numbers in an equation.
        if type(node.value) is not int:
            raise UnsafeExpressionError(f"literal {node.value!r} is not an integer")
        literals.append(node.value)
        return _check_size(Fraction(node.value))
    if isinstance(node, ast.BinOp):
        left = _eval(node.left, literals, allow_pow)
        right = _eval(node.right, literals, allow_pow)
        op = node.op
        if isinstance(op, ast.Add):
            return _check_size(left + right)
        if isinstance(op, ast.Sub):
            return _check_size(left - right)
        if isinstance(op, ast.Mult):
            return _check_size(left * right)
        if isinstance(op, ast.Div):
            if right == 0:
                raise UnsafeExpressionError("division by zero")
            return _check_size(left / right)
        if isinstance(op, ast.Pow) and allow_pow:
            if right.denominator != 1 or abs(right.numerator) > MAX_EXPONENT:
                raise UnsafeExpressionError(f"exponent {right} not an integer in "
                                       f"[-{MAX_EXPONENT}, {MAX_EXPONENT}]")
            if left == 0 and right < 0:
                raise UnsafeExpressionError("zero to a negative power")
            # Bound the result size before computing it.
            bits = max(left.numerator.bit_length(), left.denominator.bit_length())
            if bits * abs(right.numerator) > MAX_BITS:
                raise UnsafeExpressionError("power too large")
            return _check_size(left ** right.numerator)
        raise UnsafeExpressionError(f"operator {type(op).__name__} not allowed")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, literals, allow_pow)
        return -value if isinstance(node.op, ast.USub) else value
    raise UnsafeExpressionError(f"{type(node).__name__} not allowed")


def evaluate(text: str, *, allow_pow: bool = False) -> tuple[Fraction, list[int]]:
    """Exact value of ``text`` and the integer literals it uses, or ``UnsafeExpressionError``."""
    if len(text) > MAX_CHARS:
        raise UnsafeExpressionError(f"expression longer than {MAX_CHARS} characters")
    text = text.replace("×", "*").replace("÷", "/").replace("−", "-").replace("^", "**")
    try:
        # mode="eval" parses one expression; ast.parse compiles to a syntax tree only.
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise UnsafeExpressionError("not a Python-syntax arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise UnsafeExpressionError(f"more than {MAX_NODES} syntax nodes")
    literals: list[int] = []
    return _eval(tree.body, literals, allow_pow), literals
