"""The text that continues a conversation after the model's turn, rendered by the model's chat template.

An episode is one token row that only grows (:mod:`flowrl.runtime.episodes`): the model's turn
is kept as the engine sampled it, and what the environment says next is appended. For a chat
model, "what comes next" is the template's rendering of the new messages (a ``user`` or ``tool``
turn) and of the next assistant header, and also the end of the model's own turn that the
template writes after its content (``<|im_end|>\\n`` in ChatML, ``<|eot_id|>`` in Llama 3) when
the engine stopped before it. :func:`continuation` computes that text from the template itself,
so nothing is dropped between turns (the newline after ``<|im_end|>`` is the template's, and it
is in the continuation: the bug veRL #6719 describes is a continuation computed by rendering the
conversation twice and subtracting, which loses it).

How: render a probe conversation ``[user, assistant(MARK)]`` and the same with the new
messages and the generation prompt; the continuation is the second rendering after ``MARK``,
less the stop token when the model's turn already ended with it. The probe's user text and mark
are fixed strings; templates that render the assistant's content as it is (every template that
can be trained on its own renderings) give the same continuation whatever the conversation.
``tools`` are passed to the template too (a template may print them in the system turn: that is
before the mark, so it is not in the continuation).

>>> class T:  # a ChatML template, as Qwen's
...     eos_token = "<|im_end|>"
...     def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, tools=None):
...         s = "".join(f"<|im_start|>{m['role']}\\n{m['content']}<|im_end|>\\n" for m in messages)
...         return s + ("<|im_start|>assistant\\n" if add_generation_prompt else "")
>>> continuation(T(), [{"role": "user", "content": "lower"}], ended_with="<|im_end|>")
'\\n<|im_start|>user\\nlower<|im_end|>\\n<|im_start|>assistant\\n'
>>> continuation(T(), [{"role": "user", "content": "lower"}], ended_with=None)
'<|im_end|>\\n<|im_start|>user\\nlower<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

from typing import Any

_USER = "flowrl probe"
_MARK = "\u2063flowrl-turn\u2063"
"""The probe assistant's content: invisible separators around a word no template rewrites."""


class ContinuationError(ValueError):
    """The chat template does not render the assistant's content as it is (the continuation would be a guess)."""


def continuation(tokenizer: Any, messages: list[dict], ended_with: str | None, tools: list | None = None) -> str:
    """The text to append after a model turn so that the row reads as the chat template renders
    ``messages`` next, with the next assistant header; ``ended_with``: the text of the stop token
    the model's turn ended with (it is in the row already), or None (the turn was cut: the template's
    own end of turn comes first)."""
    probe = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MARK}]
    kwargs = {"tools": tools} if tools else {}
    full = tokenizer.apply_chat_template(probe + list(messages), tokenize=False, add_generation_prompt=True, **kwargs)
    at = full.rfind(_MARK)
    if at < 0:
        raise ContinuationError("the chat template does not write the assistant's message content as it is, so "
                                "the text after a model turn cannot be derived from it; use a template that does "
                                "(or give the model no chat template: observations are then appended as text)")
    text = full[at + len(_MARK):]
    if ended_with and text.startswith(ended_with):
        text = text[len(ended_with):]
    return text


def stop_text(tokenizer: Any, last_id: int, stop_ids: tuple[int, ...]) -> str | None:
    """The text of the model turn's last token when it is a stop token (the turn ended there), else None."""
    if last_id not in stop_ids:
        return None
    return tokenizer.convert_ids_to_tokens(int(last_id))


__all__ = ["continuation", "stop_text", "ContinuationError"]
