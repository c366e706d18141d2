"""Built-in verifiers: named functions that score completions against reference answers.

Every verifier has the reward-function signature used throughout flowrl::

    fn(completions: list[str], answers: list[str]) -> list[float]

one reward per completion, 1.0 for correct and 0.0 for wrong. They are looked up by
name (``get_verifier("math")``); a flow names them the same way. A verifier that needs
more of a sample than its answer takes the keyword ``rows`` (each sample's dataset row,
every field): ``code`` (:mod:`flowrl.rewards.code`) reads the row's ``tests``, ``reasoning_gym``
(:mod:`flowrl.rewards.reasoning_gym`) the row's task and entry.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable

from flowrl.rewards.code import code_tests
from flowrl.rewards.reasoning_gym import reasoning_gym_score
from flowrl.tasks.longtail import final_answer

Verifier = Callable[[list[str], list[str]], list[float]]


class UnknownVerifierError(KeyError):
    """A verifier name that is not registered."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def _check_lengths(name: str, completions: list[str], answers: list[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"verifier {name!r}: {len(completions)} completions but {len(answers)} answers; pass one answer per completion")


def exact_match(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where ``completion.strip() == answer.strip()``, else 0.0. Shapes: ``[N]`` in, ``[N]`` out."""
    _check_lengths("exact", completions, answers)
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


def math_equivalence(completions: list[str], answers: list[str], *, timeout_s: float = 5.0) -> list[float]:
    """1.0 where ``math_verify`` finds the completion's final answer equal to the reference.

    Uses ``math_verify.parse`` on both sides (LaTeX or plain expressions, e.g. ``"1/2"``
    equals ``"0.5"``) and ``math_verify.verify(gold, prediction)``. A completion with no
    parseable answer scores 0.0. ``math_verify`` guards each parse with ``signal.alarm``,
    which only works on a process's main thread; elsewhere its timeouts are disabled.
    ``timeout_s``: that limit (whole seconds, at least 1; a flow's ``verifier("math", timeout = S)``).
    """
    _check_lengths("math", completions, answers)
    from math_verify import parse, verify  # heavy import (sympy): only when used

    timeout = max(1, round(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        # math_verify warns once that its timeouts are off; off-main-thread that is by
        # design here, and the warning would land in the middle of the progress line.
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    out = []
    golds: dict[str, object] = {}
    for completion, answer in zip(completions, answers):
        c, a = completion.strip(), str(answer).strip()
        # Fast paths that math_verify would decide the same way (~1 ms per call saved):
        # identical text is equal; two plain integers are equal exactly when their values are.
        if c == a:
            out.append(1.0)
            continue
        if _INT.fullmatch(c) and _INT.fullmatch(a):
            out.append(float(int(c) == int(a)))
            continue
        if a not in golds:
            golds[a] = parse(a, parsing_timeout=timeout)
        gold = golds[a]
        pred = parse(completion, parsing_timeout=timeout)
        out.append(float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)))
    return out


_INT = re.compile(r"[-+]?\d+")


def final_match(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion's final answer (the digits after its last ``=``,
    :func:`flowrl.tasks.longtail.final_answer`) equals the reference as an integer, else 0.0 (also
    for a completion that gives no answer). The text is parsed, never evaluated. ``[N]`` -> ``[N]``."""
    _check_lengths("final", completions, answers)
    out = []
    for c, a in zip(completions, answers):
        got = final_answer(c)
        out.append(float(got is not None and _INT.fullmatch(str(a).strip()) is not None and int(got) == int(a)))
    return out


VERIFIERS: dict[str, Verifier] = {
    "exact": exact_match,
    "math": math_equivalence,
    "code": code_tests,
    "final": final_match,
    "reasoning_gym": reasoning_gym_score,
}


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name``."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise UnknownVerifierError(
            f"unknown verifier {name!r}; built-in verifiers are {sorted(VERIFIERS)}, "
            "or give your own reward as 'module:function'"
        ) from None
