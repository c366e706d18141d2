"""OpenEnv environments in process: ``env e = openenv("my_env:MyEnv", action = "my_env:MyAction")``.

An OpenEnv environment (``openenv.core.env_server.interfaces.Environment``) has
``reset(seed, episode_id) -> Observation`` and ``step(action: Action) -> Observation``, where
its Action and Observation are pydantic models (``Observation`` has ``done`` and ``reward``).
The adapter (:class:`OpenEnvInProcess`, named by the ``openenv`` record of
:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`) builds one environment per episode in the
environment worker, and:

* ``reset(row)``: ``env.reset(seed = row["seed"], episode_id = ...)`` (the row's ``prompt`` is
  the model's first prompt; an environment whose first observation is the prompt makes its
  rows from it);
* ``step(turn)``: ``env.step(Action(**{field: turn}))``; the observation shown to the model is
  its ``observation`` field (an option), else its fields other than ``done``, ``reward`` and
  ``metadata`` as JSON; ``reward`` (None: 0) and ``done`` are the Observation's.
"""

from __future__ import annotations

import json
import uuid

from flowrl.envs import StepResult

_HIDDEN = ("done", "reward", "metadata")


def _load(ref: str):
    from flowrl.pyrefs import import_module_from, split_ref

    module, attr = split_ref(ref)
    return getattr(import_module_from(module, None), attr)


def observation_text(obs, field: str = "") -> str:
    """What the model reads of an OpenEnv Observation: ``field``, else its visible fields as JSON."""
    if field:
        value = getattr(obs, field)
        return value if isinstance(value, str) else json.dumps(value, default=str)
    data = obs.model_dump() if hasattr(obs, "model_dump") else dict(vars(obs))
    shown = {k: v for k, v in data.items() if k not in _HIDDEN}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown, default=str, sort_keys=True)


class OpenEnvInProcess:
    """One OpenEnv environment per episode, in the worker's process (see the module docstring)."""

    def __init__(self, options: dict):
        self.env_cls = _load(str(options["target"]))
        self.action_cls = _load(str(options["action"]))
        self.field = str(options.get("field") or "message")
        self.shown = str(options.get("observation") or "")

    def reset(self, row: dict) -> None:
        self.env = self.env_cls()
        self.env.reset(seed=row.get("seed"), episode_id=uuid.uuid4().hex)

    def step(self, turn: str) -> StepResult:
        obs = self.env.step(self.action_cls(**{self.field: turn}))
        reward = float(obs.reward or 0.0)
        if obs.done:
            return StepResult("", reward, True, {"tool_call": False, "tool_error": False})
        text = observation_text(obs, self.shown)
        return StepResult("\n" + text + "\n", reward, False, {"tool_call": False, "tool_error": False},
                          messages=({"role": "user", "content": text},))

    def close(self) -> None:
        closer = getattr(self.env, "close", None)
        if callable(closer):
            closer()
