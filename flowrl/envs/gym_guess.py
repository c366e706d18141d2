"""Guess the number as a Gymnasium environment with text spaces: ``gymnasium("flowrl.envs.gym_guess:GuessNumber-v0")``.

Importing this module registers ``GuessNumber-v0`` with gymnasium (gymnasium's ``"module:EnvId"``
syntax imports it first). The game is :mod:`flowrl.envs.guess`'s, written to the Gymnasium API:
``reset(seed)`` draws the secret in ``[0, 99]`` and observes ``"0-99="``; each action is a guess
(text), observed ``+`` (higher) or ``-`` (lower) with reward 0; the right guess terminates with
reward 1, a turn that is not a number with reward 0. The observations use the tiny ``arith``
tokenizer's characters, so a tiny model plays it (``flows/gymnasium_guess.flow``).

>>> import gymnasium
>>> env = gymnasium.make("flowrl.envs.gym_guess:GuessNumber-v0")
>>> env.reset(seed=3)[0]
'0-99='
>>> env.step("50")[:3]
('+', 0.0, False)
"""

from __future__ import annotations

import re

import gymnasium
from gymnasium import spaces

_INT = re.compile(r"^\s*(-?\d+)\s*=?\s*$")


class GuessNumberEnv(gymnasium.Env):
    """The guessing game (see the module docstring)."""

    metadata = {"render_modes": []}

    def __init__(self, low: int = 0, high: int = 99):
        self.low, self.high = low, high
        charset = "0123456789+-="
        self.observation_space = spaces.Text(max_length=16, charset=charset)
        self.action_space = spaces.Text(max_length=16, charset=charset)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.low, self.high + 1))
        return f"{self.low}-{self.high}=", {}

    def step(self, action: str):
        m = _INT.match(str(action))
        if m is None:
            return "", 0.0, True, False, {"invalid": True}
        guess = int(m.group(1))
        if guess == self.secret:
            return "", 1.0, True, False, {}
        return ("+" if self.secret > guess else "-"), 0.0, False, False, {}


gymnasium.register(id="GuessNumber-v0", entry_point=GuessNumberEnv, max_episode_steps=20)
