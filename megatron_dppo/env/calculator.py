"""``calculator``: a deterministic arithmetic tool. The assistant writes ``<calc>expression</calc>``; each call is
answered in one ``tool`` message (one result line per call); a turn without a call ends the episode.

Expressions: integers and decimals, ``+ - * / // % **``, unary signs and parentheses, nothing else (parsed with
``ast``, never ``eval``). Bounds keep every call cheap: at most ``max_digits`` digits in any operand or result and
an exponent of at most ``max_exponent``. A bad expression (syntax, division by zero, a bound) is answered with
``error: ...`` and counted as a tool error: the model sees its mistake, the episode goes on.
"""
from __future__ import annotations

import ast
import math
import operator

from megatron_dppo.env.protocol import Step, Task, Turn
from megatron_dppo.env.tool_calls import find_calls

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str, max_digits: int = 64, max_exponent: int = 64) -> int | float:
    """The value of an arithmetic expression (module docstring); CalculatorError when it is not one or breaks a
    bound."""
    if len(expression) > 4 * max_digits + 64:
        raise CalculatorError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None

    def check(value):
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite")
        if isinstance(value, int) and len(str(abs(value))) > max_digits:
            raise CalculatorError(f"result has more than {max_digits} digits")
        return value

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if not isinstance(right, int) or abs(right) > max_exponent:
                    raise CalculatorError(f"exponent must be an integer of at most {max_exponent}")
                if abs(left) > 1 and right > 0 and right * math.log10(abs(left)) > max_digits:
                    raise CalculatorError(f"result has more than {max_digits} digits")
            try:
                return check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result is too large") from None
        raise CalculatorError(f"unsupported element {type(node).__name__} in {expression!r}")

    return walk(tree)


def format_value(value: int | float) -> str:
    """Integers as written; floats with 12 significant digits, integral floats without the ``.0``."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else format(value, ".12g")
    return str(value)


class CalculatorEnv:
    """Args: tag (call tag, default "calc"), role (observation role, "tool"), max_calls (calls answered per turn;
    extra calls are answered with an error), max_digits, max_exponent (bounds of ``evaluate``)."""

    def __init__(self, tag: str = "calc", role: str = "tool", max_calls: int = 4, max_digits: int = 64,
                 max_exponent: int = 64):
        if role not in ("tool", "user"):
            raise ValueError(f"calculator role must be 'tool' or 'user', got {role!r}")
        if max_calls < 1:
            raise ValueError(f"calculator max_calls must be >= 1, got {max_calls}")
        self.tag, self.role, self.max_calls = tag, role, int(max_calls)
        self.max_digits, self.max_exponent = int(max_digits), int(max_exponent)
        find_calls("", tag)  # validates the tag

    def reset(self, task: Task, seed: int) -> list[dict]:
        return []

    def step(self, turn: Turn) -> Step:
        calls = find_calls(turn.text, self.tag)
        if not calls:
            return Step(done=True)
        lines, errors = [], 0
        for i, expression in enumerate(calls):
            if i >= self.max_calls:
                lines.append(f"error: at most {self.max_calls} calculations per turn")
                errors += 1
                continue
            try:
                lines.append(format_value(evaluate(expression, self.max_digits, self.max_exponent)))
            except CalculatorError as err:
                lines.append(f"error: {err}")
                errors += 1
        return Step(messages=[{"role": self.role, "content": "\n".join(lines)}], tool_calls=len(calls),
                    tool_errors=errors)
