"""Environments written against the libraries' own APIs, for the adapters' tests (not flowrl's protocol).

* :class:`EchoCount` (OpenEnv): an ``Environment`` whose Action has a ``message``; it observes
  the message's length and ends after three steps with reward 1 when the last message was "done".
* :func:`first_word` (TextArena opponent): plays the first bracketed move it is shown, else ``[0]``.
"""

from __future__ import annotations

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    length: int = 0
    echoed: str = ""


class EchoCount(Environment):
    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed="start")

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        self._state.step_count += 1
        done = self._state.step_count >= 3
        reward = 1.0 if done and action.message == "done" else 0.0
        return EchoObservation(length=len(action.message), echoed=action.message, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


def first_word(observation: str) -> str:
    return "[0]"
