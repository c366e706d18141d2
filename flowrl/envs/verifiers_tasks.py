"""`verifiers` tasksets through the environment protocol: ``env v = verifiers("my_taskset")``.

verifiers 0.4 (``verifiers.v1``) splits an environment into a **taskset** (tasks: a prompt and
data, and ``@vf.reward`` / ``@vf.metric`` methods scoring a finished trace) and a **harness** (the
agent program that produces the trace, launched in a runtime with its own dependencies). The
adapter (:class:`VerifiersTasks`, named by the ``verifiers`` record of
:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`) takes the taskset and lets flowrl's rollout
be the agent:

* the taskset is a module exporting its ``Taskset`` subclass in ``__all__`` (verifiers' own rule),
  found in the flow file's folder, on ``PYTHONPATH`` or installed, or one of verifiers' built-in
  tasksets (``verifiers.v1.tasksets.<id>``); it is loaded once per environment worker with its
  config's defaults (``TasksetConfig(id = ...)``);
* the rows are the tasks: :func:`make_rows` (``python -m flowrl.envs.verifiers_tasks TASKSET >
  rows.jsonl``) writes each task's prompt (text, or chat messages for ``chat = true``) and its
  index ``task``;
* ``step(turn)``: the episode's trace is the task's prompt and the model's turn (the assistant's
  reply); the task scores it with its own rewards (``Task.score``, without a runtime: rewards that
  need the harness's runtime are skipped, as verifiers itself does offline), and the episode ends
  with the trace's reward (the weighted sum of its rewards).

What this path does not run: the taskset's harness (its agent program, tools served by its
toolsets, multi-turn user simulators). Those run over an OpenAI client: the rollout endpoint's
``agent`` path (docs/agents.md) is where they belong.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from flowrl.envs import StepResult

_LOADED: dict = {}
_LOCK = threading.Lock()


def taskset_class(target: str, folder: str | None):
    """The ``Taskset`` subclass a taskset module exports (``__all__``), or a built-in taskset's."""
    import importlib.util

    from verifiers.v1 import Taskset

    from flowrl.pyrefs import find_module, import_module_from

    builtin = f"verifiers.v1.tasksets.{target}"
    if "." not in target and find_module(target, folder) is None and importlib.util.find_spec(builtin) is not None:
        module = importlib.import_module(builtin)
    else:
        module = import_module_from(target, folder)
    exported = [getattr(module, name, None) for name in getattr(module, "__all__", ())]
    found = [c for c in exported if isinstance(c, type) and issubclass(c, Taskset)]
    if len(found) != 1:
        raise TypeError(f"taskset module `{target}` must export exactly one Taskset subclass in `__all__`, "
                        f"found {len(found)}")
    return found[0]


def load_tasks(target: str, folder: str | None) -> list:
    """The tasks of taskset ``target`` (its config's defaults), loaded once per process."""
    with _LOCK:
        key = (target, folder)
        if key not in _LOADED:
            from verifiers.v1.configs.taskset import TasksetConfig
            from verifiers.v1.utils.generic import concrete_type

            cls = taskset_class(target, folder)
            config = (concrete_type(cls, TasksetConfig) or TasksetConfig)(id=target)
            _LOADED[key] = list(cls(config))
        return _LOADED[key]


def _prompt(data) -> str | list[dict]:
    """A task's prompt as a dataset row holds it: text, or chat messages."""
    prompt = data.prompt
    if isinstance(prompt, str) or prompt is None:
        text = prompt or ""
        return [{"role": "system", "content": data.system_prompt}, {"role": "user", "content": text}] \
            if data.system_prompt else text
    return [{"role": m.role, "content": m.content if isinstance(m.content, str) else str(m.content)} for m in prompt]


def make_rows(target: str, folder: str | None = None) -> list[dict]:
    """One row per task of taskset ``target``: its prompt, its index ``task`` (``answer`` empty: the
    task's rewards score)."""
    return [{"prompt": _prompt(t.data), "answer": "", "task": i} for i, t in enumerate(load_tasks(target, folder))]


def score(task, messages: list, reply: str) -> tuple[float, dict]:
    """The task's reward for the trace ``messages`` + the model's ``reply``, and each reward's score."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    turns = [*messages, {"role": "assistant", "content": reply}]
    nodes = [MessageNode(parent=i - 1 if i else None, message=kinds[m["role"]](content=m["content"]),
                         sampled=i == len(turns) - 1)  # the model's reply: the one sampled message
             for i, m in enumerate(turns)]
    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                  agent=AgentInfo(config=AgentConfig()), nodes=nodes)
    asyncio.run(task.score(trace))
    return float(trace.reward), {k: (r.score if r is not None else None) for k, r in trace.rewards.items()}


class VerifiersTasks:
    """A verifiers task per episode, scored by its own rewards (see the module docstring)."""

    def __init__(self, options: dict):
        self.target = str(options["target"])
        self.folder = options.get("flow_folder")

    def reset(self, row: dict) -> None:
        tasks = load_tasks(self.target, self.folder)
        self.task = tasks[int(row["task"])]
        prompt = _prompt(self.task.data)
        self.messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt

    def step(self, turn: str) -> StepResult:
        reward, _ = score(self.task, self.messages, turn)
        return StepResult("", reward, True, {"tool_call": False, "tool_error": False})


if __name__ == "__main__":  # python -m flowrl.envs.verifiers_tasks TASKSET > rows.jsonl
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flowrl.envs.verifiers_tasks TASKSET > rows.jsonl")
    for r in make_rows(sys.argv[1], "."):
        print(json.dumps(r))
