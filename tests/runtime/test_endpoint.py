"""The rollout endpoint with the real ``openai`` client, a real tokenizer and chat template, and a
scripted sampler in place of the engine (so that what was "sampled" is known token by token).

What is checked: token fidelity (an episode's row is the ids the engine saw and sampled, turn after
turn, even where the sampled ids are not how the tokenizer would encode their text, so that decoding
and re-encoding gives other ids; only new messages are tokenized, with the end of the turn the engine
did not sample), tool calls parsed from the template's format and rendered back, streaming, text
completions (string and token-id prompts), the flow's sampling parameters enforced (a conflict is a
400 naming the parameter and the flow's value), unknown and closed keys, max_turns, and a model
without a chat template laid out as the native env_step loop lays it out.
"""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from agent_kit import TOOLS, qwen_tokenizer
from flowrl.engines.types import Completion
from flowrl.runtime.endpoint import RolloutEndpoint, Sampling

SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, stop=(), seed=0)


class Scripted:
    """The engine: each call answers with the next scripted id list (EOS appended unless ``length``)."""

    def __init__(self, tok, script: list[list[int]], eos: bool = True):
        self.tok, self.script, self.eos = tok, list(script), eos
        self.seen: list[tuple[list[int], list[int]]] = []
        self.batches: list[int] = []

    def __call__(self, prompts):
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            ids = self.script.pop(0) + ([self.tok.eos_token_id] if self.eos else [])
            self.seen.append((list(p), ids))
            text = self.tok.decode(ids, skip_special_tokens=True)
            out.append(Completion(tuple(p), tuple(ids), tuple(-0.1 * (j + 1) for j in range(len(ids))),
                                  "stop" if self.eos else "length", text))
        return out, 5


def serve(ep: RolloutEndpoint, engine, programs: list):
    """Run each ``program(client)`` (async) in a thread of its own against ``ep`` while the test's thread
    batches their requests into ``engine``; their results, in order."""
    results = [None] * len(programs)

    def one(i, program):
        async def go():
            key = ep.open_episode(f"e{i}", 4) if not isinstance(program, tuple) else program[0]
            fn = program if not isinstance(program, tuple) else program[1]
            async with openai.AsyncOpenAI(base_url=ep.url, api_key=key, max_retries=0) as client:
                return await fn(client)
        try:
            results[i] = asyncio.run(go())
        except Exception as e:  # noqa: BLE001 - handed back to the test
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(programs)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        ep.pump(engine, live=sum(t.is_alive() for t in threads), wait=0.02)
    return results


@pytest.fixture
def qwen():
    tok = qwen_tokenizer()
    ep = RolloutEndpoint(tok, "policy")
    ep.begin(SAMPLING, 512)
    yield tok, ep
    ep.close()


def _pieces(tok, text: str) -> list[int]:
    """``text`` as one token per character: a tokenization the sampler may produce, not the tokenizer's."""
    return [tok.convert_tokens_to_ids(t) for ch in text for t in tok.tokenize(ch)]


def test_an_episode_is_exactly_the_ids_the_engine_saw_and_sampled_even_where_re_tokenizing_differs(qwen):
    tok, ep = qwen
    turns = ["The answer", "The answer is 42."]
    engine = Scripted(tok, [_pieces(tok, turns[0]), _pieces(tok, turns[1])])

    async def program(client):
        messages = [{"role": "user", "content": "Hello there"}]
        for _ in range(2):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            messages += [r.choices[0].message.model_dump(), {"role": "tool", "content": "12"}]
        return messages

    [messages] = serve(ep, engine, [program])
    row = ep.close_episode("e0").trajectory([])
    (p1, s1), (p2, s2) = engine.seen
    assert row.ids == p2 + s2 and p2[:len(p1) + len(s1)] == p1 + s1  # each call continues the row it sampled
    assert [i for i, m in enumerate(row.mask) if m] == list(range(len(p1), len(p1) + len(s1))) + \
        list(range(len(p2), len(p2) + len(s2)))  # 1 exactly on the sampled tokens
    assert [row.logprobs[i] for i in range(len(p2), len(row.ids))] == pytest.approx([-0.1 * (j + 1) for j in range(len(s2))])
    # the first prompt is the template's rendering; between the turns, only the tool result's rendering
    # and the "\n" after <|im_end|> that the engine did not sample are new tokens
    rendered = tok.apply_chat_template(messages[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert p1 == tok(rendered, add_special_tokens=False).input_ids
    delta = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert p2[len(p1) + len(s1):] == tok(delta, add_special_tokens=False).input_ids
    # re-tokenizing the conversation's text would give other ids: the trainer would score tokens never sampled
    naive = tok(tok.apply_chat_template(messages[:-1], tools=TOOLS, tokenize=False), add_special_tokens=False).input_ids
    assert naive[:len(p2)] != p2 and s1 != tok(turns[0], add_special_tokens=False).input_ids


def test_a_turn_cut_at_max_tokens_gets_the_whole_end_of_turn_as_new_tokens(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [_pieces(tok, "The"), _pieces(tok, "ok")], eos=False)

    async def program(client):
        messages = [{"role": "user", "content": "Hello"}]
        r = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
        return (await client.chat.completions.create(model="policy", messages=messages)).choices[0].finish_reason

    assert serve(ep, engine, [program]) == ["length"]
    (p1, s1), (p2, _) = engine.seen
    assert p2[:len(p1) + len(s1)] == p1 + s1
    assert p2[len(p1) + len(s1):] == tok("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n",
                                         add_special_tokens=False).input_ids


def test_tool_calls_in_the_templates_format_become_openai_tool_calls_and_go_back_through_the_template(qwen):
    tok, ep = qwen
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    engine = Scripted(tok, [tok("Let me see." + call, add_special_tokens=False).input_ids,
                            tok("5", add_special_tokens=False).input_ids])

    async def program(client):
        messages = [{"role": "user", "content": "2+3?"}]
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me see."
        [c] = msg.tool_calls
        assert (c.function.name, json.loads(c.function.arguments)) == ("calculator", {"expression": "2+3"})
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": c.id, "content": "5"}]
        return (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0].message.content

    assert serve(ep, engine, [program]) == ["5"]
    (p1, s1), (p2, _) = engine.seen
    assert p2[:len(p1) + len(s1)] == p1 + s1  # the assistant message with tool_calls matched what was sampled
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(p2[len(p1) + len(s1):])
    assert ep.close_episode("e0").trajectory([]).off_row == 0


def test_streaming_gives_the_same_message_as_a_plain_call(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [_pieces(tok, "The answer is 42.")])

    async def program(client):
        stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        parts, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    assert serve(ep, engine, [program]) == [("The answer is 42.", "stop")]


def test_text_completions_reuse_sampled_ids_for_a_prompt_that_extends_the_last(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [_pieces(tok, "The"), _pieces(tok, "42"), [5]])

    async def program(client):
        first = await client.completions.create(model="policy", prompt="Hello", logprobs=1)
        assert first.choices[0].logprobs.token_logprobs[0] == pytest.approx(-0.1)
        second = await client.completions.create(model="policy", prompt="Hello" + first.choices[0].text + " is")
        ids = list(engine.seen[1][0]) + list(engine.seen[1][1])
        await client.completions.create(model="policy", prompt=ids)  # token ids in: used as they are
        return second.choices[0].text

    assert serve(ep, engine, [program]) == ["42"]
    (p1, s1), (p2, s2), (p3, _) = engine.seen
    assert p2 == p1 + s1 + tok(" is", add_special_tokens=False).input_ids and p3 == p2 + s2
    row = ep.close_episode("e0").trajectory([])
    assert sum(row.mask) == len(s1) + len(s2) + 2  # the token-id call sampled [5] and its EOS


def test_requests_of_concurrent_episodes_are_batched_into_one_engine_call(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [[40]] * 6)
    gate = threading.Barrier(6)

    def program(i):
        async def run(client):
            await asyncio.get_running_loop().run_in_executor(None, gate.wait)
            return (await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": str(i)}])).id
        return (ep.open_episode(f"b{i}", 4), run)

    serve(ep, engine, [program(i) for i in range(6)])
    assert sum(engine.batches) == 6 and max(engine.batches) > 1


def test_sampling_parameters_come_from_the_flow(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [[40], [40]])

    async def program(client):
        msgs = [{"role": "user", "content": "hi"}]
        ok = await client.chat.completions.create(model="policy", messages=msgs, temperature=1.0, max_tokens=16, n=1)
        errors = []
        for kwargs in ({"temperature": 0.7}, {"max_tokens": 99}, {"n": 4}, {"top_p": 0.5}, {"stop": ["x"]}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="policy", messages=msgs, **kwargs)
            errors.append((e.value.body["param"], e.value.body["message"]))
        return ok.choices[0].message.content, errors

    [(content, errors)] = serve(ep, engine, [program])
    assert [p for p, _ in errors] == ["temperature", "max_tokens", "n", "top_p", "stop"]
    assert "`temperature = 0.7` conflicts with the flow: it samples with temperature = 1.0" in errors[0][1]
    assert "max_tokens = 16" in errors[1][1]


def test_unknown_and_closed_keys_and_max_turns_are_refused_with_what_happened(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [[40]] * 3)
    key = ep.open_episode("m", 2)

    async def program(client):
        msgs = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            await client.chat.completions.create(model="policy", messages=msgs)
        with pytest.raises(openai.BadRequestError, match="reached max_turns = 2"):
            await client.chat.completions.create(model="policy", messages=msgs)
        async with openai.AsyncOpenAI(base_url=ep.url, api_key="made-up", max_retries=0) as other:
            with pytest.raises(openai.AuthenticationError, match="unknown API key"):
                await other.chat.completions.create(model="policy", messages=msgs)
        return [m.id for m in (await client.models.list()).data]

    assert serve(ep, engine, [(key, program)]) == [["policy"]]
    assert ep.close_episode("m").refused == ["400 this episode reached max_turns = 2 model calls; return the answer"]

    async def late(client):
        with pytest.raises(openai.NotFoundError, match="episode is closed"):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return True

    assert serve(ep, engine, [(key, late)]) == [True]


def test_the_key_may_ride_in_the_base_url(qwen):
    tok, ep = qwen
    engine = Scripted(tok, [[40]])
    key = ep.open_episode("u", 2)
    out = {}

    def run():
        async def go():
            async with openai.AsyncOpenAI(base_url=ep.base_url(key), api_key="ignored", max_retries=0) as c:
                return (await c.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}])).usage
        out["usage"] = asyncio.run(go())

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive():
        ep.pump(engine, 1, 0.02)
    assert out["usage"].completion_tokens == 2 and len(ep.close_episode("u").calls) == 1


def test_a_model_without_a_chat_template_reads_the_messages_as_the_env_step_loop_appends_them():
    from flowrl.models.tiny import build_tokenizer
    from flowrl.tasks.arith import CHARS

    tok = build_tokenizer(CHARS)
    ep = RolloutEndpoint(tok, "policy")
    ep.begin(SAMPLING, 128)
    engine = Scripted(tok, [tok("12+30", add_special_tokens=False).input_ids, tok("42", add_special_tokens=False).input_ids])

    async def program(client):
        msgs = [{"role": "user", "content": "12+30="}]
        r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert not r.choices[0].message.tool_calls  # no template: no tool-call format to parse
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "tool", "content": "42="}]
        return (await client.chat.completions.create(model="policy", messages=msgs)).choices[0].message.content

    try:
        assert serve(ep, engine, [program]) == ["42"]
        row = ep.close_episode("e0").trajectory([])
    finally:
        ep.close()
    # prompt (with BOS), the sampled turn and its EOS, the tool's text without special tokens, the next turn
    expected = tok("12+30=").input_ids + engine.seen[0][1] + tok("42=", add_special_tokens=False).input_ids + engine.seen[1][1]
    assert row.ids == expected
