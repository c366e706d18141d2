"""What an environment's episodes read and write as chat: observations rendered by the chat template, tools in the prompt.

* :func:`observation_texts`: the text ``env_step`` appends after each model turn. An environment
  that gives its observation as chat messages (:attr:`flowrl.envs.StepResult.messages`) in a
  conversation that is a chat (its prompts were rendered with the tokenizer's chat template) gets
  the template's own rendering (:func:`flowrl.data.chat_turns.continuation`); otherwise its
  ``observation`` text as it is.
* :func:`with_tools`: the tokenizer the run renders its chat prompts with, given the tools of the
  environments that offer some (an MCP server's: their library's record says ``tools``): its
  ``apply_chat_template`` passes them (``tools = ...``), so the template renders them as the
  model was trained to read them. The driver calls it before it reads the datasets; a tool
  whose input schema is not valid JSON Schema stops the run there (E643, at the environment's
  declaration). The tools are in every chat prompt of the run (a flow with an MCP environment
  has its prompts for it).
"""

from __future__ import annotations

from typing import Any

from flowrl.catalog.env_libraries import ENV_LIBRARIES
from flowrl.catalog.ops import OpKind
from flowrl.plan import DatasetPlan, ExecutionPlan, OpPlan
from flowrl.runtime.errors import RuntimeFlowError


def prompt_datasets(plan: ExecutionPlan, op: OpPlan) -> list[DatasetPlan]:
    """The datasets ``op``'s inputs come from (through any ops, back to their ``sample`` ops)."""
    by_id = {o.id: o for o in plan.ops}
    datasets = {d.id: d for d in plan.datasets}
    out, todo, seen = [], [op], set()
    while todo:
        o = todo.pop()
        for src in o.inputs.values():
            if src in seen:
                continue
            seen.add(src)
            if o.kind == OpKind.SAMPLE.value and src in datasets:
                out.append(datasets[src])
            elif src in by_id:
                todo.append(by_id[src])
    return sorted(out, key=lambda d: d.id)


def is_chat(d: DatasetPlan, tokenizer: Any) -> bool:
    """``d``'s prompts are rendered with the chat template (``chat = true``, or left to the template's presence)."""
    has = bool(getattr(tokenizer, "chat_template", None))
    return has and (d.chat or bool(getattr(d, "chat_auto", False)))


def chat_episodes(plan: ExecutionPlan, op: OpPlan, tokenizer: Any) -> bool:
    """The episodes of ``op`` (an ``env_step``) are chats: their prompts went through the chat template."""
    return any(is_chat(d, tokenizer) for d in prompt_datasets(plan, op))


def observation_texts(tokenizer: Any, outcomes: list, last_ids: list[int], chat: bool) -> list[str]:
    """The text appended after each episode's model turn (``last_ids``: each turn's last token id)."""
    from flowrl.data.chat_turns import continuation

    specials = set(getattr(tokenizer, "all_special_ids", ()) or ())
    out = []
    for o, last in zip(outcomes, last_ids):
        if chat and o.messages and not o.done:
            ended = tokenizer.convert_ids_to_tokens(int(last)) if last in specials else None
            out.append(continuation(tokenizer, list(o.messages), ended))
        else:
            out.append(o.observation)
    return out


SCHEMA_CODE = "E643"
"""The diagnostic of a tool whose input schema is not valid JSON Schema (docs/language.md)."""


class ToolsTokenizer:
    """A tokenizer whose ``apply_chat_template`` renders ``tools`` unless the caller passes its own;
    everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, tools: list[dict]):
        self.__dict__["_tokenizer"], self.__dict__["tools"] = tokenizer, list(tools)

    def __getattr__(self, name: str) -> Any:
        if name == "_tokenizer" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._tokenizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tokenizer, name, value)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def apply_chat_template(self, conversation, *args, **kwargs):
        kwargs.setdefault("tools", self.tools)
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)


def env_tools(plan: ExecutionPlan) -> list[dict]:
    """The tools of every environment of ``plan`` whose library offers some (listed from the library,
    schemas checked: E643); in declaration order."""
    from flowrl.envs.mcp_tools import schema_problems
    from flowrl.pyrefs import folder_of, import_module_from, split_ref

    tools: list[dict] = []
    for env in plan.envs:
        lib = ENV_LIBRARIES.get(env.kind)
        if lib is None or not lib.tools:
            continue
        module, attr = split_ref(lib.adapter)
        try:
            adapter = getattr(import_module_from(module, None), attr)({**env.options, "flow_folder": folder_of(env.origin)})
            listed = adapter.client.tools()
            adapter.client.close()
        except Exception as e:  # noqa: BLE001 - the server would not start or list its tools: a user error
            raise RuntimeFlowError(f"{env.origin}: environment `{env.id}` (`{env.options.get('target')}`): its tools "
                                   f"could not be listed: {type(e).__name__}: {e}") from None
        problems = schema_problems(listed)
        if problems:
            raise RuntimeFlowError(f"{env.origin}: error[{SCHEMA_CODE}]: environment `{env.id}`: " + "; ".join(problems)
                                   + "; hint: fix the tool's input schema in the server (JSON Schema, an object)")
        tools += listed
    return tools


def with_tools(plan: ExecutionPlan, tokenizer: Any) -> Any:
    """``tokenizer``, rendering the tools of ``plan``'s environments into every chat prompt (see the module
    docstring); itself when no environment offers tools."""
    tools = env_tools(plan)
    return ToolsTokenizer(tokenizer, tools) if tools and tokenizer is not None else tokenizer


__all__ = ["prompt_datasets", "is_chat", "chat_episodes", "observation_texts", "ToolsTokenizer",
           "env_tools", "with_tools"]
