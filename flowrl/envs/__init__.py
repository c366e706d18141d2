"""Environments for multi-turn (agentic) flows: the protocol, and the built-in ones.

An environment is a Python class named in a flow as ``python_env("module:Class")``. The
runtime (:mod:`flowrl.runtime.env_pool`) makes one instance per episode (a conversation: one
completion of the first ``generate`` and its later turns), in a pool of Ray actors, and calls:

``__init__()``
    no arguments (options belong in the dataset row or in class attributes);
``reset(row: dict) -> None``
    once, before the episode's first step: ``row`` is the dataset row the episode's prompt came
    from, every field of it (``prompt``, ``answer``, and any other column such as ``tests``);
``step(turn: str) -> StepResult`` (or a tuple ``(observation, reward, done[, info])``)
    the model's latest turn, decoded; returns the observation text to append to the
    conversation (tokenized without special tokens, masked out of the loss), a reward for this
    turn, whether the episode is over, and ``info`` (``tool_call``/``tool_error`` booleans are
    counted in the run's ``env/*`` metrics);
``close() -> None`` (optional)
    when the episode ends.

An exception in any of them ends that episode only, with the error recorded (``events.log``
and ``env/errors``); a call running past the environment's ``timeout`` ends its episode too.

Built-in environments: :class:`flowrl.envs.calculator.Calculator` (a calculator tool),
:class:`flowrl.envs.guess.GuessNumber` (a game with higher/lower hints) and
:class:`flowrl.envs.python.PythonTool` (model-written code run in :mod:`flowrl.sandbox`).

>>> coerce_result(("= 5", 0.0, False))
StepResult(observation='= 5', reward=0.0, done=False, info={})
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


class Environment(Protocol):
    """What ``python_env("module:Class")`` names (see the module docstring)."""

    def reset(self, row: dict) -> None:
        """Start an episode on dataset row ``row``."""

    def step(self, turn: str) -> "StepResult":
        """The observation, reward and done flag after the model's ``turn``."""


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Environment.step` returns."""

    observation: str
    """Text appended to the conversation after the model's turn ("" for none)."""
    reward: float = 0.0
    """This turn's reward (summed over the episode into the ``rewards`` field of ``env_step``)."""
    done: bool = False
    """The episode is over: no more turns are generated for it."""
    info: dict = field(default_factory=dict)
    """Counted by the runtime: ``tool_call`` (the turn called a tool), ``tool_error`` (the call failed)."""
    messages: tuple = field(default=(), repr=False)
    """The observation as chat messages (``{"role": "user" | "tool", "content": ...}``): for a model
    with a chat template the runtime appends their rendering by that template (the end of the
    model's turn, the messages, the next assistant header) instead of ``observation``
    (:func:`flowrl.data.chat_turns.continuation`); empty: ``observation`` as it is."""


class EnvProtocolError(TypeError):
    """An environment's ``step`` returned something that is not a :class:`StepResult` (or its tuple)."""


def coerce_result(value: Any) -> StepResult:
    """A :class:`StepResult` from what ``step`` returned; a clear error for anything else."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) in (3, 4):
        result = StepResult(*value) if len(value) == 4 else StepResult(value[0], value[1], value[2])
    else:
        raise EnvProtocolError(f"step() must return a flowrl.envs.StepResult or (observation, reward, done[, info]), "
                               f"got {type(value).__name__}")
    if not isinstance(result.observation, str):
        raise EnvProtocolError(f"step(): the observation must be a str, got {type(result.observation).__name__}")
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        raise EnvProtocolError(f"step(): the reward must be a number, got {result.reward!r}") from None
    if not math.isfinite(reward):
        raise EnvProtocolError(f"step(): the reward must be finite, got {reward}")
    if not isinstance(result.info, dict):
        raise EnvProtocolError(f"step(): info must be a dict, got {type(result.info).__name__}")
    messages = tuple(result.messages or ())
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise EnvProtocolError(f"step(): messages must be dicts with a string 'role' and 'content', got {m!r}"[:300])
    return StepResult(result.observation, reward, bool(result.done), dict(result.info), messages)


__all__ = ["Environment", "StepResult", "EnvProtocolError", "coerce_result"]
