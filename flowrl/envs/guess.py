"""Guess the number: a multi-step game with feedback.

The dataset row's ``answer`` is the secret (an integer in ``[low, high]``); its ``prompt``
states the range as ``"LOW-HIGH="`` (e.g. ``"0-99="``: the tiny ``arith`` tokenizer's
characters suffice). Each model turn is a guess; the observation is a hint:

* ``+`` the secret is higher, ``-`` it is lower: the game goes on (reward 0);
* a correct guess ends the game with reward 1; a turn that is not a number ends it with 0.

A model that bisects finds any secret of 0..99 in at most 7 guesses, so RL has a clear
signal: the final turn is scored (``verifier("exact")`` against ``answer``), and with
``max_turns`` below 7 only a good search strategy wins every game.

>>> g = GuessNumber(); g.reset({"prompt": "0-99=", "answer": "37"})
>>> [g.step(t).observation for t in ("50", "25", "40")]
['-', '+', '-']
>>> g.step("37")
StepResult(observation='', reward=1.0, done=True, info={'tool_call': False, 'tool_error': False})
>>> make_rows(2, seed=0)
[{'prompt': '0-99=', 'answer': '49'}, {'prompt': '0-99=', 'answer': '97'}]
"""

from __future__ import annotations

import random
import re

from flowrl.envs import StepResult

_INT = re.compile(r"^\s*(-?\d+)\s*=?\s*$")


class GuessNumber:
    """The guessing game (see the module docstring)."""

    def reset(self, row: dict) -> None:
        self.secret = int(str(row["answer"]).strip())

    def step(self, turn: str) -> StepResult:
        m = _INT.match(turn)
        if m is None:
            return StepResult("", 0.0, True, {"tool_call": False, "tool_error": True})
        guess = int(m.group(1))
        if guess == self.secret:
            return StepResult("", 1.0, True, {"tool_call": False, "tool_error": False})
        return StepResult("+" if self.secret > guess else "-", 0.0, False, {"tool_call": True, "tool_error": False})


def make_rows(n: int, seed: int, low: int = 0, high: int = 99) -> list[dict]:
    """``n`` games (``{"prompt": "LOW-HIGH=", "answer": secret}``), a function of ``seed``."""
    rng = random.Random(seed)
    return [{"prompt": f"{low}-{high}=", "answer": str(rng.randint(low, high))} for _ in range(n)]
