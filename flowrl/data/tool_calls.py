"""Tool calls in a model's text, in its chat template's own format (parsed and written).

A chat model that was trained to call tools writes its calls in the format its chat template
teaches (the template renders earlier calls and the tool list the same way). Two formats cover
the open models people train:

* ``hermes`` (Qwen2/2.5/3, Hermes, many fine-tunes): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text
  around the calls is the message's content;
* ``llama3`` (Llama 3.1+ JSON tool calling): the message is a JSON object
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is accepted too), optionally after
  ``<|python_tag|>``; several calls are separated by ``;``.

:func:`format_of` picks the format from a chat template's source; :func:`parse_tool_calls`
returns the content and the calls (a call whose JSON does not parse, or lacks a name, is not a
call: it stays in the content and is listed in ``errors``); :func:`render_tool_call` writes a
call as the model would (tests, warm-start data); :func:`as_openai` gives the OpenAI API's
``tool_calls`` entries. Pure standard library: the endpoint and the MCP environment share it.

>>> text = 'Let me add.<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call>'
>>> parsed = parse_tool_calls(text, "hermes")
>>> parsed.content, [(c.name, c.arguments) for c in parsed.calls]
('Let me add.', [('add', {'a': 2, 'b': 3})])
>>> [(c.name, c.arguments) for c in parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "llama3").calls]
[('add', {'a': 1})]
>>> parse_tool_calls("The answer is 5.", "hermes").calls
[]
>>> format_of("{% for m in messages %}<tool_call>{% endfor %}"), format_of("<|python_tag|>"), format_of(None)
('hermes', 'llama3', 'hermes')
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3")
"""The tool-call formats :func:`parse_tool_calls` reads and :func:`render_tool_call` writes."""


@dataclass(frozen=True)
class ToolCall:
    """One call a model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict
    id: str = ""
    """The call's id (``call_<n>`` by position in its message): a tool message answering it names it."""


@dataclass(frozen=True)
class Parsed:
    """A model turn split into its content and its tool calls."""

    content: str
    calls: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    """Why each would-be call (a ``<tool_call>`` block, a JSON-looking llama3 message) is not one."""


def format_of(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches: ``llama3`` when it mentions ``<|python_tag|>`` or
    the ``ipython`` role, else ``hermes`` (the Qwen/Hermes tags, and the default: most open models)."""
    src = chat_template or ""
    if "<|python_tag|>" in src or "ipython" in src:
        return "llama3"
    return "hermes"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_UNCLOSED = re.compile(r"<tool_call>\s*(\{.*\})\s*$", re.S)  # a call cut by the stop token before its closing tag


def _call_of(obj, n: int, keys: tuple[str, ...]) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, "a tool call is a JSON object with a string \"name\""
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the OpenAI API does
        try:
            args = json.loads(args)
        except ValueError:
            return None, f"the arguments of `{obj['name']}` are a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"the arguments of `{obj['name']}` are not a JSON object"
    return ToolCall(obj["name"], args, f"call_{n}"), None


def _hermes(text: str) -> Parsed:
    calls, errors, kept, last = [], [], [], 0
    matches = list(_HERMES.finditer(text))
    tail = _UNCLOSED.search(text, matches[-1].end() if matches else 0)
    spans = [(m.start(), m.end(), m.group(1)) for m in matches] + ([(tail.start(), tail.end(), tail.group(1))]
                                                                   if tail else [])
    for start, end, body in spans:
        kept.append(text[last:start])
        last = end
        try:
            call, why = _call_of(json.loads(body), len(calls), ("arguments", "parameters"))
        except ValueError as e:
            call, why = None, f"not JSON ({e.msg} at character {e.pos})"
        if call is None:
            errors.append(why)
            kept.append(text[start:end])
        else:
            calls.append(call)
    kept.append(text[last:])
    return Parsed("".join(kept).strip(), calls, errors)


def _llama3(text: str) -> Parsed:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return Parsed(text.strip(), [], ["<|python_tag|> without a JSON call after it"] if tagged else [])
    calls, errors = [], []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError as e:
            return Parsed(text.strip(), [], [f"not JSON ({e.msg} at character {e.pos})"])
        call, why = _call_of(obj, len(calls), ("parameters", "arguments"))
        if call is None:
            return Parsed(text.strip(), [], [why])
        calls.append(call)
        pos = end
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
        if rest and not rest.startswith("{"):
            return Parsed(text.strip(), [], ["text after a JSON tool call"])
    return Parsed("", calls, errors)


_PARSERS = {"hermes": _hermes, "llama3": _llama3}


def parse_tool_calls(text: str, fmt: str = "hermes") -> Parsed:
    """``text`` (one assistant turn, decoded) split into content and calls in format ``fmt`` (:data:`FORMATS`)."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; formats: {', '.join(FORMATS)}")
    return _PARSERS[fmt](text)


def render_tool_call(call: ToolCall, fmt: str = "hermes") -> str:
    """The text a model of format ``fmt`` writes for ``call`` (what :func:`parse_tool_calls` reads back).

    >>> render_tool_call(ToolCall("add", {"a": 2}), "hermes")
    '<tool_call>\\n{"name": "add", "arguments": {"a": 2}}\\n</tool_call>'
    >>> render_tool_call(ToolCall("add", {"a": 2}), "llama3")
    '{"name": "add", "parameters": {"a": 2}}'
    """
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"
    if fmt == "llama3":
        return json.dumps({"name": call.name, "parameters": call.arguments})
    raise ValueError(f"unknown tool-call format {fmt!r}; formats: {', '.join(FORMATS)}")


def as_openai(calls: list[ToolCall]) -> list[dict]:
    """The OpenAI chat API's ``tool_calls`` entries of ``calls`` (arguments as a JSON string)."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]


__all__ = ["FORMATS", "ToolCall", "Parsed", "format_of", "parse_tool_calls", "render_tool_call", "as_openai"]
