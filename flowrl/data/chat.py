"""Prompts as the model reads them: raw text, or chat messages rendered by the tokenizer's template.

A dataset's prompt field holds either a string or, for chat data, a list of messages
(``[{"role": "user", "content": "..."}]``). The flow chooses per dataset
(``jsonl(..., chat = true)``, the option in the dataset ops' catalogue records):

* ``chat = false`` (default): the prompt is a string, tokenized as it is (the tokenizer adds
  its BOS where it has one: Llama, Mistral; Qwen and GPT-2 add none);
* ``chat = true``: a messages list (a string is one user message) rendered by the model's own
  chat template with ``add_generation_prompt=True`` (the assistant turn's header ends the
  prompt), as vLLM's chat entry point and TRL do. The template writes the BOS itself, so
  :func:`encode` adds no second one.

Special tokens per tokenizer family (:func:`pad_id`): Llama 3, Mistral and GPT-2 have no pad
token, so batches are padded with EOS (padding is masked out of attention and of the loss by
``TokenBatch.response_mask``); the EOS a completion ends with is a response token (its
log-prob is trained: it is how the policy learns to stop). Generation stops at every EOS the
tokenizer and ``generation_config.json`` name (:func:`stop_ids`; Llama 3 instruct stops at
``<|eot_id|>`` and ``<|end_of_text|>``).

Checking a dataset (``flowrl check``) needs no tokenizer: :func:`message_problem` validates a
messages list, :func:`template_source` says where a checkpoint's template is (or that it has
none), reading files only.

>>> message_problem([{"role": "user", "content": "2+2?"}]) is None
True
>>> message_problem([{"role": "user"}])
"message 0 has no string 'content'"
>>> prompt_words([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
'Be brief.\\n2+2?'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.userfiles import read_bounded

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have."""


class ChatError(ValueError):
    """A prompt that cannot be rendered as asked (no template, malformed messages); says what to change."""


def is_messages(value: Any) -> bool:
    """A list of ``{"role": ..., "content": ...}`` dicts (what a chat dataset's prompt holds)."""
    return isinstance(value, list) and message_problem(value) is None


def message_problem(value: Any) -> str | None:
    """Why ``value`` is not a chat messages list, or None when it is one."""
    if not isinstance(value, list) or not value:
        return "a chat prompt is a non-empty list of messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"message {i} is a {type(m).__name__}, not an object with 'role' and 'content'"
        if m.get("role") not in ROLES:
            return f"message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"message {i} has no string 'content'"
    return None


def prompt_words(prompt: Any) -> str:
    """The text of a prompt without any template (a messages list: its contents, one per line).
    ``flowrl check`` counts its tokens: a lower bound of the rendered prompt's."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


def as_messages(prompt: Any) -> list[dict]:
    """A chat dataset's prompt as messages: a string is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    problem = message_problem(prompt)
    if problem is not None:
        raise ChatError(f"{problem}; e.g. [{{\"role\": \"user\", \"content\": \"...\"}}]")
    return prompt


TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Files transformers reads a chat template from, besides ``tokenizer_config.json``'s ``chat_template``."""


def template_source(model_dir: str | Path) -> str | None:
    """Where a checkpoint's chat template is (a file name), or None if it has none. Files only."""
    folder = Path(model_dir)
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            return name
    try:
        config = json.loads(read_bounded(folder / "tokenizer_config.json", 64 << 20))
    except (OSError, ValueError):
        return None
    return "tokenizer_config.json" if isinstance(config, dict) and config.get("chat_template") else None


def render(tokenizer: Any, prompt: Any, chat: bool) -> str:
    """The prompt text the model reads: ``prompt`` itself (``chat`` false), else the tokenizer's
    chat template applied to its messages with the assistant's turn opened
    (``add_generation_prompt=True``)."""
    if not chat:
        if not isinstance(prompt, str):
            raise ChatError("the prompt is a list of chat messages: give the dataset `chat = true` to render it "
                            "with the model's chat template")
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; give the "
                        "dataset `chat = false` and plain-text prompts, or use a checkpoint that has one "
                        f"({' / '.join(TEMPLATE_FILES)} or tokenizer_config.json's `chat_template`)")
    return tokenizer.apply_chat_template(as_messages(prompt), tokenize=False, add_generation_prompt=True)


def render_rows(rows: list[dict], field: str, tokenizer: Any, chat: bool) -> list[dict]:
    """Copies of ``rows`` whose ``field`` holds the rendered prompt text (:func:`render`)."""
    return [{**row, field: render(tokenizer, row[field], chat)} for row in rows]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt text with the tokenizer's special tokens (its BOS), except that a text
    already beginning with the BOS (a chat template wrote it) does not get a second one."""
    bos = getattr(tokenizer, "bos_token", None)
    special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=special).input_ids)


def pad_id(tokenizer: Any) -> int:
    """The id batches are padded with: the pad token, else EOS (Llama 3, Mistral, GPT-2 have no pad
    token); padding is masked, so only its being a valid id matters."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def stop_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """Every id generation stops at: the tokenizer's EOS and ``generation_config``'s ``eos_token_id``
    (an int or a list), sorted."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


__all__ = ["ChatError", "ROLES", "TEMPLATE_FILES", "as_messages", "encode", "is_messages", "message_problem",
           "pad_id", "prompt_words", "render", "render_rows", "stop_ids", "template_source"]
