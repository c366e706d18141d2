"""A dataset's row format: which fields a row must hold and how its prompt is written.

A row comes from a source (:mod:`flowrl.data.sources`) as a dict of the user's fields. The
flow names them (``prompt = "question", answer = "solution"``) or writes the prompt with a
``template``, whose ``{field}`` slots are filled from the row (``{{`` and ``}}`` are braces):

>>> fmt = RowFormat(template="Question: {question}\\nAnswer:")
>>> fmt.check("d.jsonl:1", {"question": "2+2?", "answer": 4})["prompt"]
'Question: 2+2?\\nAnswer:'
>>> template_slots("{a} and {{b}} and {c}")
[('a', 0), ('c', 18)]

A slot's value is written as text: a string as it is, a number or a boolean as JSON writes it, a
list or an object as JSON. A ``system`` prompt and the chat template are applied at run time,
where the tokenizer is (:func:`render_prompt`): with ``chat`` (or, unset, where the tokenizer has a
chat template) the prompt becomes ``[system, user]`` messages rendered by the template; else the
system prompt is written before the prompt, a blank line between.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Any

from flowrl.data.chat import as_messages, render
from flowrl.data.datasets import DatasetError, _check_row


class TemplateError(ValueError):
    """A template that cannot be filled (an unclosed brace, a slot with a format spec); says what to write."""


def template_slots(template: str) -> list[tuple[str, int]]:
    """``(field, offset of its ``{``)`` for each slot of ``template``, in order; :class:`TemplateError` if the
    template is malformed or a slot is more than a field name (``{a.b}``, ``{a[0]}``, ``{a!r}``, ``{a:>3}``)."""
    out: list[tuple[str, int]] = []
    offset = 0
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise TemplateError(f"{e}; hint: a slot is `{{field}}`, a literal brace is written `{{{{` or `}}}}`") from None
    for literal, name, spec, conversion in parsed:
        offset += len(literal.replace("{", "{{").replace("}", "}}"))
        if name is None:
            continue
        if not name or any(c in name for c in ".[]") or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise TemplateError(f"slot `{shown}` is not a field name; hint: write `{{field}}` (a row's field, "
                                "as it is); a literal brace is written `{{` or `}}`")
        out.append((name, offset))
        offset += len(name) + 2
    return out


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def fill(template: str, row: dict) -> str:
    """``template`` with each slot replaced by the row's field as text (the caller checked the fields exist)."""
    return "".join(literal + (_text(row[name]) if name is not None else "")
                   for literal, name, _, _ in string.Formatter().parse(template))


@dataclass(frozen=True)
class RowFormat:
    """The fields a row must hold and how its prompt is made (the dataset's options)."""

    prompt: str = "prompt"
    """The field that holds the prompt; with a template, the field the written prompt is put in."""
    fields: tuple[str, ...] = ("answer",)
    """Fields every row must hold besides the prompt (the answer's, the completion's)."""
    template: str = ""
    chat: bool = False
    """The prompt field may hold chat messages (``chat = true``)."""

    def needs(self) -> tuple[str, ...]:
        """Every field a row must hold: the template's slots (else the prompt field), then :attr:`fields`."""
        first = tuple(dict.fromkeys(n for n, _ in template_slots(self.template))) if self.template else (self.prompt,)
        return first + tuple(f for f in self.fields if f not in first)

    def check(self, where: str, row: Any) -> dict:
        """``row`` as a training row (its prompt written from the template where there is one); else
        :class:`DatasetError` naming ``where`` (``file:line``) and the field."""
        if not self.template:
            return _check_row(where, row, self.prompt, (self.prompt, *self.fields), self.chat)
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for name in self.needs():
            if name not in row:
                slot = " (a slot of the template)" if name not in self.fields else ""
                raise DatasetError(f"{where}: missing field {name!r}{slot}; the row has {sorted(row)}; hint: name "
                                   "the row's fields in the flow's dataset (template = \"...{field}...\", answer = ...)")
        text = fill(self.template, row)
        if not text.strip():
            raise DatasetError(f"{where}: the template writes an empty prompt; hint: every row needs a prompt")
        return {**row, self.prompt: text}


def render_prompt(tokenizer: Any, prompt: Any, *, chat: bool, chat_auto: bool = False, system: str = "") -> str:
    """The text the model reads for one prompt: through the tokenizer's chat template when ``chat`` (or
    ``chat_auto`` and the tokenizer has one), the system prompt as the first message; else the prompt as
    text, the system prompt before it. :class:`~flowrl.data.chat.ChatError` where ``chat`` and no template."""
    templated = chat or (chat_auto and bool(getattr(tokenizer, "chat_template", None)))
    if not templated:
        text = render(tokenizer, prompt, False)
        return f"{system}\n\n{text}" if system else text
    messages = as_messages(prompt)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return render(tokenizer, messages, True)


__all__ = ["RowFormat", "TemplateError", "fill", "render_prompt", "template_slots"]
