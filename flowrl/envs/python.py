"""A Python tool: the model writes code, the sandbox runs it, and the model sees its output.

A turn containing a fenced block (three backticks, optionally ``python``, the code, three
backticks) is a tool call: the code runs in :func:`flowrl.sandbox.run_code` (an unprivileged,
resource-limited, network-less sandbox: see docs/rewards.md) and the observation is
``<output>STDOUT</output>`` (stderr too when the program failed, both cut to
:data:`MAX_OUTPUT` characters). Any other turn is the final answer: the episode ends with
reward 1.0 if it equals the row's ``answer`` (as a number when both are numbers), else 0.0.

Class attributes set the limits: ``timeout_s`` and ``memory_mb`` per program (a subclass
changes them). Keep the environment's ``python_env(..., timeout = ...)`` above ``timeout_s``.

>>> code_of("Let me compute.\\n```python\\nprint(2**10)\\n```")
'print(2**10)\\n'
>>> code_of("1024") is None
True
"""

from __future__ import annotations

import re

from flowrl.envs import StepResult
from flowrl.envs.calculator import same_answer

MAX_OUTPUT = 500
"""Characters of the program's output shown to the model."""

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def code_of(turn: str) -> str | None:
    """The code of the turn's first fenced block, or None."""
    m = _FENCE.search(turn)
    return m.group(1) if m else None


class PythonTool:
    """Runs the model's code in the sandbox (see the module docstring)."""

    timeout_s = 5.0
    memory_mb = 256

    def reset(self, row: dict) -> None:
        self.answer = str(row.get("answer", ""))

    def step(self, turn: str) -> StepResult:
        code = code_of(turn)
        if code is None:
            return StepResult("", 1.0 if same_answer(turn, self.answer) else 0.0, True,
                              {"tool_call": False, "tool_error": False})
        from flowrl.sandbox import run_code

        r = run_code(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        failed = r.exit_code != 0 or r.timed_out or r.memory_exceeded
        text = r.stdout + (r.stderr if failed else "")
        if r.timed_out:
            text += f"\n[timed out after {self.timeout_s:g}s]"
        return StepResult(f"<output>{text[:MAX_OUTPUT]}</output>", 0.0, False,
                          {"tool_call": True, "tool_error": bool(failed)})
