"""Gymnasium environments with text observations: ``env g = gymnasium("my_envs:Guess-v0")``.

The adapter (:class:`GymnasiumText`, named by the ``gymnasium`` record of
:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`) makes the environment with
``gymnasium.make(env_id, max_episode_steps = max_steps)`` for each episode; ``env_id`` is a
registered id or gymnasium's ``"module:EnvId"`` (the module is imported first: it registers its
environments).

* ``reset(row)``: ``env.reset(seed = row["seed"])``. The episode's first prompt is the first
  observation for that seed: the rows are made by :func:`make_rows`
  (``python -m flowrl.envs.gymnasium_envs ENV_ID N SEED > rows.jsonl``);
* ``step(turn)``: the model's turn is the action: the text itself for a ``Text`` action space,
  the turn's first integer for a ``Discrete`` one (a turn without one, or out of range, ends the
  episode as a ``tool_error`` with reward 0); ``env.step(action)`` gives the observation (text
  appended, and one user message for a chat model), the reward, and ``terminated or truncated``
  ends the episode.

Observations must be text (a ``Text`` observation space, or strings): the model reads them.
"""

from __future__ import annotations

import json
import re
import sys

from flowrl.envs import StepResult

_INT = re.compile(r"-?\d+")


def _make(env_id: str, max_steps: int | None):
    import gymnasium

    return gymnasium.make(env_id, max_episode_steps=max_steps, disable_env_checker=True)


def _text(obs) -> str:
    if not isinstance(obs, str):
        raise TypeError(f"a gymnasium environment for a language model must observe text, got {type(obs).__name__}")
    return obs


def _action(space, turn: str):
    """The action the model's ``turn`` stands for in ``space``, or None when it stands for none."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        m = _INT.search(turn)
        if m is None:
            return None
        a = int(m.group(0))
        return a if space.contains(a) else None
    return turn


class GymnasiumText:
    """One gymnasium environment per episode, the model's turns its actions (see the module docstring)."""

    def __init__(self, options: dict):
        self.env_id = str(options["target"])
        self.max_steps = options.get("max_steps")

    def reset(self, row: dict) -> None:
        self.env = _make(self.env_id, self.max_steps)
        self.env.reset(seed=int(row.get("seed", 0)))

    def step(self, turn: str) -> StepResult:
        action = _action(self.env.action_space, turn)
        if action is None:
            return StepResult("", 0.0, True, {"tool_call": False, "tool_error": True})
        obs, reward, terminated, truncated, _ = self.env.step(action)
        if terminated or truncated:
            return StepResult("", float(reward), True, {"tool_call": False, "tool_error": False})
        text = _text(obs)
        return StepResult("\n" + text + "\n", float(reward), False, {"tool_call": False, "tool_error": False},
                          messages=({"role": "user", "content": text},))

    def close(self) -> None:
        self.env.close()


def make_rows(env_id: str, n: int, seed: int) -> list[dict]:
    """``n`` episodes of ``env_id`` (seeds ``seed``, ``seed + 1``, ...): each row's ``prompt`` is the first
    observation, ``seed`` the reset's seed (``answer`` is empty: the environment's rewards score)."""
    rows = []
    for s in range(seed, seed + n):
        env = _make(env_id, None)
        obs, _ = env.reset(seed=s)
        rows.append({"prompt": _text(obs), "answer": "", "seed": s})
        env.close()
    return rows


if __name__ == "__main__":  # python -m flowrl.envs.gymnasium_envs ENV_ID N SEED > rows.jsonl
    if len(sys.argv) != 4:
        sys.exit("usage: python -m flowrl.envs.gymnasium_envs ENV_ID N SEED > rows.jsonl")
    for r in make_rows(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])):
        print(json.dumps(r))
