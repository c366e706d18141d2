"""The calculator task as an agent program written with the ``openai`` client.

``agent("flowrl.envs.calculator_agent:run")`` plays the episodes of ``flows/agentic_calc.flow``'s
task through flowrl's rollout endpoint (:mod:`flowrl.runtime.endpoint`) instead of the
``env_step`` loop: the program asks the model, and answers its tool calls itself, for up to
:data:`MAX_CALLS` model calls.

* A model whose chat template has a tool-call format gets the ``calculator`` tool (:data:`TOOLS`) and
  calls it the OpenAI way: the endpoint parses the model's ``<tool_call>`` (Hermes/Qwen) or Llama 3
  JSON into ``tool_calls``; the program answers each with a ``tool`` message.
* A model without one (the tiny character-level ``arith_tool`` model) calls the calculator the way
  :class:`~flowrl.envs.calculator.Calculator` reads it: a turn that is only an expression
  (``6958+6408``) is a call, answered ``13366=`` in a ``tool`` message, which such a model reads
  appended to the conversation as it is, exactly as the ``env_step`` loop appends the observation.

Any other turn is the final answer: the program returns it, and the flow's reward scores it
(``verifier("math")`` against the row's ``answer``). After :data:`MAX_CALLS` calls the last turn is
the answer, as ``repeat max_turns`` ends the native loop.
"""

from __future__ import annotations

import json

from flowrl.envs.calculator import CalcError, Calculator, evaluate, show

MAX_CALLS = 3
"""Model calls per episode: the first turn and one after each of two tool results (the native
flow's first ``generate`` and ``repeat 2``)."""

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
"""The tool offered to models whose chat template can call tools."""


def calculate(arguments: str) -> str:
    """The calculator tool: ``{"expression": ...}`` (a JSON string) -> its value, or ``error: WHY``."""
    try:
        expr = json.loads(arguments).get("expression", "")
        return show(evaluate(str(expr)))
    except (CalcError, ValueError, AttributeError) as e:
        return f"error: {e}"


async def run(client, row: dict) -> str:
    """One episode: the model's turns, the calculator's answers; returns the final answer."""
    env = Calculator()
    env.reset(row)
    messages = [{"role": "user", "content": row["prompt"]}]
    text = ""
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        text = msg.content or ""
        if msg.tool_calls:
            messages.append({"role": "assistant", "content": msg.content,
                             "tool_calls": [c.model_dump() for c in msg.tool_calls]})
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
            continue
        step = env.step(text)  # the bare form: a turn that is only an expression is a call
        if step.done:
            return text
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": step.observation}]
    return text
