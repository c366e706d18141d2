"""A calculator tool: the model may ask it to evaluate an arithmetic expression before answering.

Each episode is one problem (a dataset row with ``prompt`` and ``answer``). A model turn is
either a **tool call** or the **final answer**:

* a tool call is ``<calc>EXPR</calc>`` anywhere in the turn; the observation is
  ``<result>VALUE</result>`` (or ``<result>error: WHY</result>``);
* for character-level tokenizers without ``<``/``>`` (the tiny ``arith`` task's charset
  ``0123456789+-=``), a turn that is *only* an expression with an operator (``88+68``, or
  ``88+68=``) is a tool call too; its observation is ``VALUE=`` (e.g. ``156=``), so the
  conversation reads ``88+68=`` / ``88+68`` / ``156=`` / ``156``;
* any other turn is the final answer: the episode is done, with reward 1.0 if it equals the
  row's ``answer`` as a number (or as text), else 0.0.

Expressions are integers and decimals with ``+ - * / // % **`` and parentheses, evaluated
from the syntax tree (no ``eval``): exponents above :data:`MAX_EXPONENT` and results above
:data:`MAX_ABS` are tool errors.

>>> env = Calculator(); env.reset({"prompt": "88+68=", "answer": "156"})
>>> env.step("88+68")
StepResult(observation='156=', reward=0.0, done=False, info={'tool_call': True, 'tool_error': False})
>>> env.step("156")
StepResult(observation='', reward=1.0, done=True, info={'tool_call': False, 'tool_error': False})
>>> env.step("<calc>(2+3)*7</calc>").observation
'<result>35</result>'
"""

from __future__ import annotations

import ast
import operator
import re

from flowrl.envs import StepResult

MAX_EXPONENT = 64
MAX_ABS = 10 ** 30

_TAGGED = re.compile(r"<calc>(.*?)</calc>", re.S)
_BARE = re.compile(r"^\s*(\(*\s*-?\s*[\d.]+(?:\s*[-+*/%]{1,2}\s*\(*\s*-?[\d.]+\s*\)*)+)\s*=?\s*$")
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*$")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class CalcError(ValueError):
    """An expression the calculator refuses (syntax, a name, division by zero, too large)."""


_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


def evaluate(expr: str) -> int | float:
    """The value of an arithmetic expression; integers may have leading zeros, as zero-padded
    operands do (``0034``: 34; Python's syntax alone would refuse them).

    >>> evaluate("37*43"), evaluate("7/2"), evaluate("-(3-5)**2"), evaluate("0034+0567"), evaluate("10.05+0.5")
    (1591, 3.5, -4, 601, 10.55)
    """
    try:
        tree = ast.parse(_LEADING_ZEROS.sub("", expr.strip()), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expr.strip()!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise CalcError(f"exponent {b} is above {MAX_EXPONENT}")
        try:
            v = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        if isinstance(v, complex) or abs(v) > MAX_ABS:
            raise CalcError("result out of range")
        return v
    raise CalcError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def show(value: int | float) -> str:
    """A value as the calculator writes it: integers without a decimal point."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def same_answer(answer: str, expected: str) -> bool:
    """The final answer equals the expected one, as numbers when both are numbers, else as text."""
    a, e = answer.strip(), str(expected).strip()
    try:
        return abs(float(a) - float(e)) <= 1e-9 * max(1.0, abs(float(e)))
    except ValueError:
        return a == e


class Calculator:
    """A calculator tool and the final-answer check (see the module docstring)."""

    def reset(self, row: dict) -> None:
        self.answer = str(row.get("answer", ""))

    def step(self, turn: str) -> StepResult:
        tagged = _TAGGED.search(turn)
        bare = None if tagged else _BARE.match(turn)
        if bare is not None and _NUMBER.match(turn.rstrip("= ")):
            bare = None  # a plain number (a negative one included) is an answer, not a call
        if tagged is None and bare is None:
            return StepResult("", 1.0 if same_answer(turn, self.answer) else 0.0, True,
                              {"tool_call": False, "tool_error": False})
        expr = tagged.group(1) if tagged else bare.group(1)
        try:
            value, error = show(evaluate(expr)), None
        except CalcError as e:
            value, error = None, str(e)
        if tagged:
            text = f"<result>{value}</result>" if error is None else f"<result>error: {error}</result>"
        else:
            text = f"{value}=" if error is None else "="  # the charset has no letters: an empty result
        return StepResult(text, 0.0, False, {"tool_call": True, "tool_error": error is not None})
