"""Tools of an MCP server (stdio) as an environment: ``env tools = mcp("python -m my_server")``.

The adapter (:class:`MCPTools`, named by the ``mcp`` record of
:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`) talks to the server with the ``mcp``
package's own client over its stdio transport (:class:`MCPClient`: one server process per
environment worker, started on first use, shared by the worker's episodes; its calls run
concurrently on one session):

* the tools: ``list_tools`` gives each tool's name, description and input JSON schema; each
  schema is checked against JSON Schema's meta-schema (:func:`schema_problems`: E643 names the
  tool and the schema path). The driver lists them before the run starts and the model's chat
  template renders them into every chat prompt (``apply_chat_template(..., tools = ...)``,
  :func:`flowrl.runtime.env_prompts.with_tools`);
* ``step(turn)``: the tool calls in the model's turn, in its chat template's format
  (:mod:`flowrl.data.tool_calls`: ``format`` ``hermes``, ``llama3``, or ``auto``: the first
  that finds a call) are made with ``call_tool``; their results come back as ``tool`` messages
  (rendered by the chat template: :attr:`flowrl.envs.StepResult.messages`; as text,
  ``<tool_response>...</tool_response>``). A failed call (an unknown tool, arguments the server
  refuses, an error result) is a ``tool_error`` whose message the model reads. A turn without
  a call is the final answer: the episode ends with reward 1.0 if it equals the row's
  ``answer`` (as numbers when both are), else 0.0.

The command is split like a shell's (no shell runs it); a leading ``python`` / ``python3`` is
this interpreter. The server starts in the flow file's folder with that folder on
``PYTHONPATH`` and the ``mcp`` package's default environment (a few variables such as ``PATH``
and ``HOME``: none of the run's secrets).

:mod:`flowrl.envs.mcp_calc_server` is a small calculator server (tests, ``flows/mcp_calc.flow``).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import threading

from flowrl.data.tool_calls import FORMATS, parse_tool_calls
from flowrl.envs import StepResult
from flowrl.envs.calculator import same_answer

CALL_TIMEOUT_S = 60.0
"""The longest one tool call may take (the environment's own ``timeout`` usually ends it first)."""


def server_argv(command: str) -> list[str]:
    """The server's argv: ``command`` split like a shell's, a leading ``python``/``python3`` this interpreter.

    >>> server_argv("python -m my_server --x 1")[1:]
    ['-m', 'my_server', '--x', '1']
    """
    argv = shlex.split(command)
    if not argv:
        raise ValueError("the MCP server command is empty")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def openai_tools(tools) -> list[dict]:
    """MCP tools as the OpenAI ``tools`` entries chat templates render (``{"type": "function", ...}``)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": dict(t.input_schema or {"type": "object"})}}
            for t in tools]


def schema_problems(tools: list[dict]) -> list[str]:
    """What is wrong with each tool's input schema (OpenAI ``tools`` entries): not valid JSON Schema (the
    meta-schema's verdict, with the path inside the schema), or not an object schema. Empty: all valid.

    >>> schema_problems([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])[0][:61]
    "tool `f`: its input schema is not valid JSON Schema at 'type'"
    """
    import jsonschema

    out = []
    for t in tools:
        fn = t["function"]
        schema = fn.get("parameters")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(the root)"
            out.append(f"tool `{fn['name']}`: its input schema is not valid JSON Schema at '{where}': {e.message}")
            continue
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            out.append(f"tool `{fn['name']}`: its input schema must describe an object (the call's arguments), "
                       f"got type {schema.get('type') if isinstance(schema, dict) else schema!r}")
    return out


class MCPClient:
    """One MCP server process and its client session, on an event loop of its own (a daemon thread):
    :meth:`tools` and :meth:`call` may be called from any thread, concurrently."""

    _lock = threading.Lock()
    _shared: dict = {}

    @classmethod
    def shared(cls, command: str, folder: str | None) -> "MCPClient":
        """The process's client for ``command`` (started on first use)."""
        with cls._lock:
            key = (command, folder)
            if key not in cls._shared:
                cls._shared[key] = cls(command, folder)
            return cls._shared[key]

    def __init__(self, command: str, folder: str | None):
        self.command, self.folder = command, folder
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="mcp-client").start()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.session = None
        self.listed: list = []
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        if not self._ready.wait(CALL_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"the MCP server `{command}` did not start: "
                               f"{type(self._error).__name__ + ': ' + str(self._error) if self._error else 'timed out'}")

    async def _serve(self) -> None:
        from mcp import ClientSession, StdioServerParameters, stdio_client
        from mcp.client.stdio import get_default_environment

        self._stop = asyncio.Event()
        env = get_default_environment()
        if self.folder:
            env["PYTHONPATH"] = os.pathsep.join([self.folder] + [p for p in sys.path if p and os.path.isdir(p)])
        argv = server_argv(self.command)
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=self.folder)
        try:
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    self.listed = (await session.list_tools()).tools
                    self.session = session
                    self._ready.set()
                    await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the caller waiting for the start
            self._error = e
            self._ready.set()

    def tools(self) -> list[dict]:
        """The server's tools as OpenAI ``tools`` entries."""
        return openai_tools(self.listed)

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """The tool's result as text, and whether it is an error."""
        future = asyncio.run_coroutine_threadsafe(self.session.call_tool(name, arguments), self.loop)
        result = future.result(CALL_TIMEOUT_S)
        parts = [getattr(c, "text", None) or str(getattr(c, "data", "") or c) for c in result.content or ()]
        if not parts and result.structured_content is not None:
            parts = [str(result.structured_content)]
        return "\n".join(parts), bool(result.is_error)

    def close(self) -> None:
        """Stop the server (its session ends, its process exits); the next :meth:`shared` starts another."""
        with MCPClient._lock:
            if MCPClient._shared.get((self.command, self.folder)) is self:
                del MCPClient._shared[(self.command, self.folder)]
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)


class MCPTools:
    """The model's tool calls answered by an MCP server (see the module docstring)."""

    def __init__(self, options: dict):
        self.command = str(options["target"])
        fmt = str(options.get("format") or "auto")
        self.formats = FORMATS if fmt == "auto" else (fmt,)
        self.client = MCPClient.shared(self.command, options.get("flow_folder"))
        self.names = {t["function"]["name"] for t in self.client.tools()}

    def tools(self) -> list[dict]:
        """The server's tools (OpenAI ``tools`` entries); a schema that is not valid JSON Schema: ValueError."""
        tools = self.client.tools()
        problems = schema_problems(tools)
        if problems:
            raise ValueError("; ".join(problems))
        return tools

    def reset(self, row: dict) -> None:
        self.answer = str(row.get("answer", ""))

    def step(self, turn: str) -> StepResult:
        parsed = None
        for fmt in self.formats:
            parsed = parse_tool_calls(turn, fmt)
            if parsed.calls:
                break
        if not parsed.calls:
            return StepResult("", 1.0 if same_answer(parsed.content or turn, self.answer) else 0.0, True,
                              {"tool_call": False, "tool_error": bool(parsed.errors)})
        messages, texts, failed = [], [], False
        for call in parsed.calls:
            if call.name not in self.names:
                text, error = f"error: no tool `{call.name}`; tools: {', '.join(sorted(self.names))}", True
            else:
                text, error = self.client.call(call.name, call.arguments)
            failed = failed or error
            messages.append({"role": "tool", "content": text, "name": call.name, "tool_call_id": call.id})
            texts.append(f"<tool_response>\n{text}\n</tool_response>")
        return StepResult("\n" + "\n".join(texts) + "\n", 0.0, False, {"tool_call": True, "tool_error": failed},
                          messages=tuple(messages))


__all__ = ["MCPTools", "MCPClient", "openai_tools", "schema_problems", "server_argv"]
