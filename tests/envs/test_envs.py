"""The built-in environments and the protocol's result check."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

import flowrl.envs
import flowrl.envs.calculator
import flowrl.envs.guess
import flowrl.envs.python
from flowrl.envs import EnvProtocolError, StepResult, coerce_result
from flowrl.envs.calculator import Calculator, CalcError, evaluate
from flowrl.envs.guess import GuessNumber, make_rows
from flowrl.envs.python import PythonTool

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", [flowrl.envs, flowrl.envs.calculator, flowrl.envs.guess, flowrl.envs.python])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_calculator_calls_errors_and_answers():
    env = Calculator()
    env.reset({"prompt": "37*43=", "answer": "1591"})
    assert env.step("37*43") == StepResult("1591=", 0.0, False, {"tool_call": True, "tool_error": False})
    assert env.step("<calc>1/0</calc>").observation == "<result>error: division by zero</result>"
    assert env.step("1/0").info == {"tool_call": True, "tool_error": True}
    assert env.step("-5").done and env.step("-5").reward == 0.0  # a negative number is an answer, not a call
    assert env.step(" 1591 ").reward == 1.0
    for bad in ("__import__('os')", "2**9999", "x+1"):
        with pytest.raises(CalcError):
            evaluate(bad)


def test_guess_number_hints_until_found():
    env = GuessNumber()
    env.reset({"prompt": "0-99=", "answer": "63"})
    lo, hi, turns = 0, 99, 0
    while True:  # bisection wins within 7 guesses
        guess = (lo + hi) // 2
        r = env.step(str(guess))
        turns += 1
        if r.done:
            break
        lo, hi = (guess + 1, hi) if r.observation == "+" else (lo, guess - 1)
    assert (r.reward, guess, turns <= 7) == (1.0, 63, True)
    assert env.step("sixty").done and env.step("sixty").reward == 0.0


def test_guess_data_is_its_generator():
    for name, n, seed in (("train", 2000, 1), ("test", 200, 2)):
        rows = [json.loads(line) for line in (REPO / "data" / "guess" / f"{name}.jsonl").read_text().splitlines()]
        assert rows == make_rows(n, seed)


def test_python_tool_runs_code_in_the_sandbox():
    env = PythonTool()
    env.reset({"prompt": "2**10?", "answer": "1024"})
    r = env.step("```python\nprint(2**10)\n```")
    assert (r.observation, r.done, r.info["tool_error"]) == ("<output>1024\n</output>", False, False)
    assert env.step("```python\nraise SystemExit(3)\n```").info["tool_error"]
    assert env.step("1024") == StepResult("", 1.0, True, {"tool_call": False, "tool_error": False})


def test_step_results_are_checked():
    assert coerce_result(("x", 1, 0, {"tool_call": True})) == StepResult("x", 1.0, False, {"tool_call": True})
    for bad, match in ((["x", 1, True], "got list"), ((1, 0.0, True), "observation must be a str"),
                       (("x", "many", True), "reward must be a number"), (("x", float("nan"), True), "finite"),
                       (("x", 0.0, True, []), "info must be a dict")):
        with pytest.raises(EnvProtocolError, match=match):
            coerce_result(bad)
