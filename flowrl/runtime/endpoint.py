"""An OpenAI-compatible rollout endpoint in front of a flow's rollout engine, with exact tokens.

An agent program (``agent("my_agent:run")``, :mod:`flowrl.runtime.agents`) or an environment
library that drives an OpenAI client talks to the policy through this endpoint while a step's
``agent_rollout`` runs. It serves, on the driver's node (``127.0.0.1``, a free port):

* ``POST /v1/chat/completions`` (``tools``, ``stream = true`` as server-sent events),
* ``POST /v1/completions`` (a prompt string, or token ids),
* ``GET /v1/models`` (the one model the step samples from; a request's ``model`` may name any: there
  is no other).

**Sessions.** One per episode: :meth:`RolloutEndpoint.open_episode` gives it an API key (a random
token; the OpenAI client sends it as ``Authorization: Bearer KEY``); a client that cannot set a key
may put it in the base URL instead (``http://HOST:PORT/e/KEY/v1``). A key that names no episode in
flight is answered 401 with what happened.

**Batching.** Requests of every episode wait in one queue; the driver thread (the step's handler)
calls :meth:`RolloutEndpoint.pump`, which takes the waiting requests, waits a short window
(:data:`BATCH_WINDOW_S` after the last that came, :data:`BATCH_MAX_WAIT_S` at most) for more unless
every episode in flight already has one waiting, and calls the engine's generate once for all of them.

**Token fidelity.** The trainer's token ids are the ones the engine saw and sampled, never a
re-tokenization of text. Each call of an episode is recorded (:class:`Call`: its prompt ids, the
sampled completion ids and their log-probs). A later call of the episode whose messages start with
an earlier call's messages followed by the assistant message that call returned (compared as
messages: role, content, tool calls) reuses that call's ids for that whole prefix, and only the
*new* messages (tool results, user turns) are tokenized: the chat template's rendering of the
conversation minus its rendering up to the reused assistant turn, plus the end of that turn that the
engine did not sample (Qwen's ``\\n`` after ``<|im_end|>``; the whole end-of-turn when the
completion stopped at ``max_tokens``). The episode's row (:class:`Trajectory`) is the last call's
prompt and completion: mask 1 exactly on the tokens the engine sampled in this episode, 0 on the
prompt, the observations and the template's text. A model without a chat template reads the
messages' contents concatenated (as ``env_step`` appends observations).

**Tool calls.** When a request offers ``tools`` and the model has a chat template, the model's text
is parsed in the template's own tool-call format (:mod:`flowrl.data.tool_calls`: Hermes / Qwen
``<tool_call>{json}</tool_call>``, Llama 3 JSON) into OpenAI ``tool_calls``; tool messages go back
through the chat template.

**Sampling parameters come from the flow.** What a request sends (``temperature``, ``top_p``,
``max_tokens``, ``n``, ``stop``, ``seed``, ``logprobs``...) must equal the flow's value or be
absent; anything else is refused (400) naming the parameter and the flow's value.

>>> message_key({"role": "assistant", "content": None, "refusal": None}) == message_key({"role": "assistant", "content": ""})
True
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from flowrl.data.tool_calls import as_openai, format_of, parse_tool_calls

BATCH_WINDOW_S = 0.02
"""How long the driver waits for one more request before calling the engine (the window restarts with
each request that arrives), unless every episode in flight already has a request waiting."""

BATCH_MAX_WAIT_S = 0.25
"""The longest the first request of a batch waits for the others (requests trickling in, each within
:data:`BATCH_WINDOW_S` of the last, are batched up to this)."""

CHUNK_TOKENS = 4
"""Tokens per server-sent event of a streamed completion."""


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP ``status``, an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


# ---- the chat template: rendering and tool calls -------------------------------------------------


def _content(value: Any) -> str:
    """A message's content as text (OpenAI's list of parts: their text, in order)."""
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text")
    return value if isinstance(value, str) else ""


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def message_key(m: dict) -> tuple:
    """What makes two messages the same for prefix matching: role, content, tool calls (name and parsed
    arguments), tool call id and name; fields an SDK adds (``refusal: null``, ``audio``...) do not count."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_args(c.get("function", {}).get("arguments")),
                                                                 sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return (m.get("role"), _content(m.get("content")), calls, m.get("tool_call_id") or "", m.get("name") or "")


class ChatRenderer:
    """Messages -> text as the model reads them: the tokenizer's chat template, or (a model without
    one) the messages' contents concatenated. Tokenizes whole prompts and deltas."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) or None
        self.tool_format = format_of(self.template) if self.template else None
        self.eot = self._end_of_turn()

    def render(self, messages: list[dict], tools: list | None, open_turn: bool) -> str:
        if self.template is None:
            return "".join(_content(m.get("content")) for m in messages)
        msgs = []
        for m in messages:
            out = {"role": m.get("role"), "content": _content(m.get("content"))}
            if m.get("tool_calls"):
                out["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                      "function": {"name": c.get("function", {}).get("name"),
                                                   "arguments": _args(c.get("function", {}).get("arguments"))}}
                                     for c in m["tool_calls"]]
            for k in ("tool_call_id", "name"):
                if m.get(k):
                    out[k] = m[k]
            msgs.append(out)
        try:
            return self.tok.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                                add_generation_prompt=open_turn)
        except Exception as e:  # noqa: BLE001 - a template's own error (jinja's raise_exception): the agent's messages
            raise EndpointError(400, f"the model's chat template refused these messages: {type(e).__name__}: {e}",
                                "messages") from None

    def _end_of_turn(self) -> str:
        """The text a chat template writes after an assistant message's content ("" without a template)."""
        if self.template is None:
            return ""
        mark = "\x00flowrl-mark\x00"
        try:
            text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}], None, False)
        except EndpointError:
            return ""
        return text[text.rfind(mark) + len(mark):] if mark in text else ""

    def encode_prompt(self, text: str) -> list[int]:
        """A whole prompt: with the tokenizer's BOS unless the template wrote it (:func:`flowrl.data.chat.encode`)."""
        from flowrl.data.chat import encode

        return encode(self.tok, text)

    def encode_delta(self, text: str) -> list[int]:
        """Text appended to tokens already in the row: no BOS, special tokens in it parsed as such."""
        return list(self.tok(text, add_special_tokens=False).input_ids) if text else []

    def unsampled_end(self, completion: "Completion") -> str:
        """The part of the template's end of an assistant turn that ``completion`` did not sample: all
        of it after ``max_tokens``, what follows the sampled end token after a stop (``\\n`` after
        Qwen's ``<|im_end|>``)."""
        if not self.eot or not completion.response_ids:
            return self.eot
        last = self.tok.convert_ids_to_tokens(int(completion.response_ids[-1]))
        if completion.finish_reason == "stop" and isinstance(last, str) and self.eot.startswith(last):
            return self.eot[len(last):]
        return self.eot


# ---- sessions and their records -------------------------------------------------------------------


@dataclass
class Call:
    """One model call of an episode, as the engine saw and answered it."""

    prompt_ids: list[int]
    prompt_mask: list[float]
    """1 on the prompt's tokens that an earlier call of this episode sampled, else 0."""
    prompt_logprobs: list[float]
    completion_ids: list[int]
    logprobs: list[float]
    """The sampler's log-probs of ``completion_ids``."""
    version: int
    """The rollout version (weights) that sampled it."""
    finish_reason: str
    text: str
    messages: tuple = ()
    """Chat calls: the request's messages (:func:`message_key` each)."""
    reply: tuple | None = None
    """Chat calls: the assistant message returned (:func:`message_key`)."""
    prompt_text: str | None = None
    """Text completions: the prompt's text (None for token-id prompts)."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def mask(self) -> list[float]:
        return self.prompt_mask + [1.0] * len(self.completion_ids)

    @property
    def row_logprobs(self) -> list[float]:
        return self.prompt_logprobs + list(self.logprobs)


@dataclass
class Trajectory:
    """An episode's tokens for the trainer: the row ending with its last call (prompt + every turn)."""

    ids: list[int]
    mask: list[float]
    """1 exactly on tokens the engine sampled in this episode."""
    logprobs: list[float]
    """The sampler's log-probs where ``mask`` is 1, else 0."""
    calls: list[Call]
    off_row: int
    """Calls whose tokens are not a prefix of the row (a sub-call, a rewritten history): not trained."""
    version: int
    truncated: bool


@dataclass
class Session:
    episode: str
    key: str
    max_calls: int | None
    calls: list[Call] = field(default_factory=list)
    requests: int = 0
    truncated: bool = False
    refused: list[str] = field(default_factory=list)
    """Why each refused request of this episode was refused (status and message)."""

    def trajectory(self, fallback_prompt: list[int]) -> Trajectory:
        if not self.calls:
            return Trajectory(list(fallback_prompt), [0.0] * len(fallback_prompt), [0.0] * len(fallback_prompt),
                              [], 0, 0, self.truncated)
        last = self.calls[-1]
        ids = last.ids
        off = sum(1 for c in self.calls if ids[:len(c.ids)] != c.ids)
        return Trajectory(ids, last.mask, last.row_logprobs, list(self.calls), off,
                          min(c.version for c in self.calls), self.truncated)


@dataclass
class Pending:
    session: Session
    prompt_ids: list[int]
    future: Future


# ---- the endpoint ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """The flow's sampling parameters for the endpoint's calls (one completion each)."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: tuple[str, ...]
    seed: int


class RolloutEndpoint:
    """The server (a thread with its own event loop) and the sessions (see the module docstring)."""

    def __init__(self, tokenizer: Any, model: str, host: str = "127.0.0.1"):
        from aiohttp import web

        self.renderer = ChatRenderer(tokenizer)
        self.model = model
        self.sessions: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._closed_keys: dict[str, str] = {}
        self._queue: "queue.Queue[Pending]" = queue.Queue()
        self._lock = threading.Lock()
        self.sampling: Sampling | None = None
        self.context_limit: int | None = None
        self.engine_calls = 0
        """Engine calls made (:meth:`pump`), and the requests they served (``batched``)."""
        self.batched = 0
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for prefix in ("/v1", "/e/{key}/v1"):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_get(prefix + "/models", self._models)
        self._loop = asyncio.new_event_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        self._runner = web.AppRunner(app, access_log=None)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="flowrl-endpoint", daemon=True)
        self._thread.start()
        started.wait(30)

    # ---- the driver's side ----

    def begin(self, sampling: Sampling, context_limit: int | None) -> None:
        """A step's ``agent_rollout`` starts: the flow's sampling parameters for its calls."""
        self.sampling, self.context_limit = sampling, context_limit

    def open_episode(self, episode: str, max_calls: int | None = None) -> str:
        """A session for ``episode``: its API key."""
        key = "flowrl-" + secrets.token_urlsafe(18)
        s = Session(episode, key, max_calls)
        with self._lock:
            self.sessions[episode] = s
            self._by_key[key] = s
        return key

    def base_url(self, key: str) -> str:
        """The base URL that carries the episode's key in its path (for clients that cannot set a key)."""
        return self.url.removesuffix("/v1") + f"/e/{key}/v1"

    def close_episode(self, episode: str, why: str = "its episode is over") -> Session:
        with self._lock:
            s = self.sessions.pop(episode)
            self._by_key.pop(s.key, None)
            self._closed_keys[s.key] = why
        return s

    def pump(self, generate: Callable[[list[list[int]]], tuple[list, int]], live: int, wait: float) -> int:
        """Serve the waiting requests with one engine call: take what waits (up to ``wait`` seconds for
        the first), then more while they keep coming (each within :data:`BATCH_WINDOW_S` of the last, up to
        :data:`BATCH_MAX_WAIT_S` in all) unless ``live`` episodes all have one waiting.
        ``generate(prompts) -> (completions, version)``, one completion per prompt. Returns how many
        requests it served."""
        try:
            batch = [self._queue.get(timeout=wait)]
        except queue.Empty:
            return 0
        first = time.monotonic()
        while len(batch) < live:
            left = min(BATCH_WINDOW_S, first + BATCH_MAX_WAIT_S - time.monotonic())
            try:
                batch.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        self.engine_calls += 1
        self.batched += len(batch)
        try:
            completions, version = generate([p.prompt_ids for p in batch])
        except Exception as e:  # noqa: BLE001 - handed to each waiting request, then raised in the driver
            for p in batch:
                p.future.set_exception(e)
            raise
        for p, c in zip(batch, completions):
            p.future.set_result((c, version))
        return len(batch)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # ---- the server's side ----

    def _session(self, request) -> Session:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        with self._lock:
            s = self._by_key.get(key)
            why = self._closed_keys.get(key)
        if s is not None:
            request["flowrl_session"] = s  # a refusal of this request is counted in its session
            return s
        if why is not None:
            raise EndpointError(404, f"this API key's episode is closed ({why}); keys are valid while their "
                                     "episode runs", None, "episode_closed")
        raise EndpointError(401, "unknown API key: it names no episode of this run (flowrl gives each episode "
                                 "its own key and base URL; use the client flowrl passes to your program)",
                            None, "invalid_api_key")

    async def _json(self, request) -> dict:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body
            raise EndpointError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise EndpointError(400, "the request body is not a JSON object")
        return body

    async def _guard(self, request, work):
        from aiohttp import web

        try:
            return await work(request)
        except EndpointError as e:
            session = request.get("flowrl_session")
            if session is not None:
                session.refused.append(f"{e.status} {e.message}")
            return web.json_response(e.body(), status=e.status)

    async def _models(self, request):
        from aiohttp import web

        async def work(req):
            self._session(req)
            return web.json_response({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "flowrl"}]})
        return await self._guard(request, work)

    def _check(self, session: Session, body: dict) -> None:
        """The request's model and sampling parameters against the flow's (see the module docstring)."""
        s = self.sampling
        if s is None:
            raise EndpointError(409, "no step is sampling now", None, "not_sampling")
        if body.get("model") is not None and not isinstance(body.get("model"), str):
            raise EndpointError(400, "`model` must be a string (the endpoint serves one model: GET /v1/models)", "model")
        flow = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens,
                "max_completion_tokens": s.max_tokens, "n": 1, "top_k": s.top_k, "seed": s.seed,
                "stop": list(s.stop), "presence_penalty": 0.0, "frequency_penalty": 0.0, "best_of": 1,
                "top_logprobs": 0, "echo": False, "suffix": None}
        for name, want in flow.items():
            got = body.get(name)
            if got is None or got == want:
                continue
            if name == "stop" and isinstance(got, str) and [got] == want:
                continue
            if isinstance(want, float) and isinstance(got, (int, float)) and abs(float(got) - want) < 1e-9:
                continue
            what = {"n": "one completion per call (its episodes are the group)"}.get(name, repr(want))
            raise EndpointError(400, f"`{name} = {got!r}` conflicts with the flow: it samples with {name} = {what}; "
                                     "sampling parameters come from the flow (drop it, or send the flow's value)",
                                name, "flow_sampling_conflict")
        if session.max_calls is not None and session.requests >= session.max_calls:
            raise EndpointError(400, f"this episode reached max_turns = {session.max_calls} model calls; "
                                     "return the answer", None, "max_turns")

    async def _sample(self, session: Session, prompt_ids: list[int], prompt_mask: list[float],
                      prompt_lp: list[float]):
        """Queue one call for the driver's next engine call; its completion and version."""
        if self.context_limit is not None and len(prompt_ids) + self.sampling.max_tokens > self.context_limit:
            session.truncated = True
            raise EndpointError(400, f"the conversation ({len(prompt_ids)} tokens) leaves no room for a turn of "
                                     f"max_tokens = {self.sampling.max_tokens} within the model's context of "
                                     f"{self.context_limit} tokens", "messages", "context_length_exceeded")
        session.requests += 1
        fut: Future = Future()
        self._queue.put(Pending(session, prompt_ids, fut))
        return await asyncio.wrap_future(fut)

    def _chat_prompt(self, session: Session, messages: list[dict], tools: list | None):
        """Prompt ids, mask and log-probs of a chat request: the recorded ids of the longest matching
        earlier call, then the new messages' rendering (see the module docstring)."""
        keys = tuple(message_key(m) for m in messages)
        best = None
        for c in session.calls:
            k = len(c.messages)
            if c.reply is not None and k < len(keys) and keys[:k] == c.messages and keys[k] == c.reply:
                if best is None or k >= len(best.messages):
                    best = c
        if best is None:
            ids = self.renderer.encode_prompt(self.renderer.render(messages, tools, True))
            return ids, [0.0] * len(ids), [0.0] * len(ids), keys
        k = len(best.messages)
        before = self.renderer.render(messages[:k + 1], tools, False)
        after = self.renderer.render(messages, tools, True)
        if not after.startswith(before):
            raise EndpointError(400, "the model's chat template renders the earlier turns differently once new "
                                     "messages follow, so the new messages cannot be appended to the sampled tokens; "
                                     "flowrl trains only on token rows it sampled", "messages", "template_not_prefix_stable")
        last = _as_completion(best)
        delta = self.renderer.encode_delta(self.renderer.unsampled_end(last) + after[len(before):])
        return (best.ids + delta, best.mask + [0.0] * len(delta), best.row_logprobs + [0.0] * len(delta), keys)

    async def _chat(self, request):
        async def work(req):
            session = self._session(req)
            body = await self._json(req)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise EndpointError(400, "`messages` must be a non-empty list of message objects", "messages")
            self._check(session, body)
            tools = body.get("tools") or None
            ids, mask, lp, keys = self._chat_prompt(session, messages, tools)
            c, version = await self._sample(session, ids, mask, lp)
            parsed = parse_tool_calls(c.text, self.renderer.tool_format) if tools and self.renderer.tool_format else None
            tool_calls = as_openai(parsed.calls) if parsed is not None else []
            reply = {"role": "assistant", "content": (parsed.content or None) if tool_calls else c.text}
            if tool_calls:
                reply["tool_calls"] = tool_calls
            session.calls.append(Call(ids, mask, lp, list(c.response_ids), list(c.logprobs), version,
                                      c.finish_reason, c.text, keys, message_key(reply)))
            finish = "tool_calls" if tool_calls else c.finish_reason
            logprobs = self._logprobs(c) if body.get("logprobs") else None
            if body.get("stream"):
                return await self._stream_chat(req, reply, finish, c, len(ids), logprobs)
            return self._reply("chat.completion", [{"index": 0, "message": reply, "finish_reason": finish,
                                                    "logprobs": logprobs}], len(ids), len(c.response_ids))
        return await self._guard(request, work)

    async def _completions(self, request):
        async def work(req):
            session = self._session(req)
            body = await self._json(req)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            self._check(session, body)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids, text = list(prompt), None  # token in: exactly these ids
                mask, lp = [0.0] * len(ids), [0.0] * len(ids)
                for c in session.calls:  # still mark what this episode sampled, where the ids extend a call
                    if ids[:len(c.ids)] == c.ids and len(c.ids) > sum(1 for m in mask if m):
                        mask = c.mask + [0.0] * (len(ids) - len(c.ids))
                        lp = c.row_logprobs + [0.0] * (len(ids) - len(c.ids))
            elif isinstance(prompt, str):
                text = prompt
                ids = mask = lp = None
                for c in reversed(session.calls):
                    if c.prompt_text is not None and prompt.startswith(c.prompt_text + c.text):
                        delta = self.renderer.encode_delta(prompt[len(c.prompt_text + c.text):])
                        ids, mask = c.ids + delta, c.mask + [0.0] * len(delta)
                        lp = c.row_logprobs + [0.0] * len(delta)
                        break
                if ids is None:
                    ids = self.renderer.encode_prompt(prompt)
                    mask, lp = [0.0] * len(ids), [0.0] * len(ids)
            else:
                raise EndpointError(400, "`prompt` must be a string or a list of token ids", "prompt")
            c, version = await self._sample(session, ids, mask, lp)
            session.calls.append(Call(ids, mask, lp, list(c.response_ids), list(c.logprobs), version,
                                      c.finish_reason, c.text, prompt_text=text))
            logprobs = ({"tokens": self.renderer.tok.convert_ids_to_tokens(list(c.response_ids)),
                         "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": None}
                        if body.get("logprobs") is not None else None)
            choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}
            if body.get("stream"):
                return await self._stream(req, [{**choice, "text": c.text}, {**choice, "text": ""}], "text_completion")
            return self._reply("text_completion", [choice], len(ids), len(c.response_ids))
        return await self._guard(request, work)

    def _logprobs(self, c) -> dict:
        toks = self.renderer.tok.convert_ids_to_tokens(list(c.response_ids))
        return {"content": [{"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(toks, c.logprobs)]}

    def _reply(self, obj: str, choices: list, prompt_tokens: int, completion_tokens: int):
        from aiohttp import web

        return web.json_response({"id": f"flowrl-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                                  "model": self.model, "choices": choices,
                                  "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                            "total_tokens": prompt_tokens + completion_tokens}})

    async def _stream_chat(self, req, reply: dict, finish: str, c, prompt_tokens: int, logprobs):
        ids = list(c.response_ids)
        deltas: list[dict] = [{"role": "assistant", "content": ""}]
        if reply.get("content") and not reply.get("tool_calls"):
            # The text in pieces of CHUNK_TOKENS tokens: the client's concatenation is the content.
            pieces, start = [], 0
            for j in range(CHUNK_TOKENS, len(ids) + CHUNK_TOKENS, CHUNK_TOKENS):
                text = self.renderer.tok.decode(ids[:j], skip_special_tokens=True)
                piece, start = text[start:], len(text)
                pieces.append(piece)
            joined = "".join(pieces)
            if joined != reply["content"]:  # decoding in pieces differs (a split character): one piece
                pieces = [reply["content"]]
            deltas += [{"content": p} for p in pieces if p]
        elif reply.get("content"):
            deltas.append({"content": reply["content"]})
        for i, call in enumerate(reply.get("tool_calls") or ()):
            deltas.append({"tool_calls": [{"index": i, **call}]})
        chunks = [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas]
        chunks.append({"index": 0, "delta": {}, "finish_reason": finish, "logprobs": logprobs})
        return await self._stream(req, chunks, "chat.completion.chunk",
                                  {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                                   "total_tokens": prompt_tokens + len(ids)})

    async def _stream(self, req, choices: list[dict], obj: str, usage: dict | None = None):
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(req)
        rid, created = f"flowrl-{uuid.uuid4().hex}", int(time.time())
        for i, choice in enumerate(choices):
            event = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            if usage is not None and i == len(choices) - 1:
                event["usage"] = usage
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _as_completion(call: Call):
    from flowrl.engines.types import Completion

    return Completion(tuple(call.prompt_ids), tuple(call.completion_ids), tuple(call.logprobs), call.finish_reason,
                      call.text)


__all__ = ["RolloutEndpoint", "EndpointError", "Sampling", "Session", "Call", "Trajectory", "ChatRenderer",
           "message_key", "BATCH_WINDOW_S", "BATCH_MAX_WAIT_S"]
