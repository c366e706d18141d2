"""The environment libraries' adapters (flowrl.envs.*) on the real libraries: TextArena, Gymnasium,
OpenEnv, an MCP server over stdio; the tool-call parser; the chat template's continuation; and the
compiler's checks of library environments (E640-E644)."""

from __future__ import annotations

import doctest
import json
import sys
from pathlib import Path

import pytest

import flowrl.compiler.passes.check_env_libraries as check_mod
import flowrl.data.chat_turns
import flowrl.data.tool_calls
import flowrl.envs.mcp_tools
from flowrl.catalog.env_libraries import ENV_LIBRARIES
from flowrl.catalog.ops import OPS
from flowrl.compiler.pipeline import check_file
from flowrl.data.chat_turns import continuation
from flowrl.data.tool_calls import ToolCall, parse_tool_calls, render_tool_call
from flowrl.diagnostics import FlowError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[0] / "families"))


@pytest.mark.parametrize("module", [flowrl.data.tool_calls, flowrl.data.chat_turns, flowrl.envs.mcp_tools, check_mod])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_every_library_record_is_an_env_op_served_by_library_env_with_a_check():
    for name, lib in ENV_LIBRARIES.items():
        assert OPS[name].handler == "library_env" and OPS[name].kind.value == "env"
        assert lib.check in check_mod._CHECKS


# ---- TextArena ---------------------------------------------------------------------------------


def test_textarena_game_is_played_to_its_end_with_its_own_reward():
    from flowrl.envs.textarena_games import TextArenaGame, make_rows

    rows = make_rows("GuessTheNumber-v0", 2, seed=5)
    assert rows == make_rows("GuessTheNumber-v0", 2, seed=5) and [r["seed"] for r in rows] == [5, 6]
    assert "Guess The Number" in rows[0]["prompt"]
    env = TextArenaGame({"target": "GuessTheNumber-v0"})
    env.reset(rows[0])
    lo, hi = 1, 20
    for _ in range(10):  # bisection, reading the game's own hints
        guess = (lo + hi) // 2
        r = env.step(f"I guess [{guess}]")
        if r.done:
            break
        assert r.messages == ({"role": "user", "content": r.observation.strip("\n")},)
        assert not r.observation.lstrip().startswith("[Player]")  # its echo of the move is dropped
        lo, hi = (guess + 1, hi) if "higher" in r.observation else (lo, guess - 1)
    assert (r.done, r.reward) == (True, 1.0)


def test_textarena_needs_an_opponent_for_more_players():
    from flowrl.envs.textarena_games import TextArenaGame

    with pytest.raises(ValueError, match="opponent"):
        TextArenaGame({"target": "TicTacToe-v0", "players": 2})


# ---- Gymnasium ---------------------------------------------------------------------------------


def test_gymnasium_text_env_steps_with_text_actions():
    from flowrl.envs.gymnasium_envs import GymnasiumText, make_rows

    rows = make_rows("flowrl.envs.gym_guess:GuessNumber-v0", 1, seed=3)
    assert rows == [{"prompt": "0-99=", "answer": "", "seed": 3}]
    env = GymnasiumText({"target": "flowrl.envs.gym_guess:GuessNumber-v0"})
    env.reset(rows[0])
    lo, hi = 0, 99
    while True:
        guess = (lo + hi) // 2
        r = env.step(str(guess))
        if r.done:
            break
        lo, hi = (guess + 1, hi) if r.observation.strip() == "+" else (lo, guess - 1)
    assert r.reward == 1.0
    env.reset(rows[0])
    assert env.step("higher?") == env.step("higher?") and env.step("x").done  # not a number: over, reward 0


def test_shipped_gym_guess_rows_are_the_generator_s():
    from flowrl.envs.gymnasium_envs import make_rows

    root = HERE.parents[1] / "data" / "gym_guess"
    for name, n, seed in (("train", 400, 1), ("test", 50, 100000)):
        rows = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
        assert rows == make_rows("flowrl.envs.gym_guess:GuessNumber-v0", n, seed)


# ---- OpenEnv -----------------------------------------------------------------------------------


def test_openenv_environment_in_process():
    from flowrl.envs.openenv_envs import OpenEnvInProcess

    env = OpenEnvInProcess({"target": "library_envs:EchoCount", "action": "library_envs:EchoAction"})
    env.reset({"prompt": "p", "seed": 1})
    r = env.step("hello")
    assert (r.done, r.reward, json.loads(r.observation)) == (False, 0.0, {"echoed": "hello", "length": 5})
    env.step("x")
    assert env.step("done").done and env.step  # third step ends it
    env.reset({"prompt": "p"})
    env.step("a"), env.step("b")
    last = env.step("done")
    assert (last.done, last.reward) == (True, 1.0)
    shown = OpenEnvInProcess({"target": "library_envs:EchoCount", "action": "library_envs:EchoAction",
                              "observation": "echoed"})
    shown.reset({})
    assert shown.step("hi").observation == "\nhi\n"


# ---- verifiers ---------------------------------------------------------------------------------


def test_verifiers_tasks_are_scored_by_their_own_rewards():
    from flowrl.envs.verifiers_tasks import VerifiersTasks, make_rows, taskset_class

    rows = make_rows("flowrl.envs.verifiers_sums")
    assert len(rows) == 200 and rows[0] == {"prompt": "49+97=", "answer": "", "task": 0}
    env = VerifiersTasks({"target": "flowrl.envs.verifiers_sums"})
    env.reset(rows[1])
    a, b = rows[1]["prompt"].rstrip("=").split("+")
    right = env.step(str(int(a) + int(b)))
    assert (right.done, right.reward) == (True, 1.0)
    assert env.step("3").reward == 0.0
    with pytest.raises(TypeError, match="exactly one Taskset subclass"):
        taskset_class("flowrl.envs.calculator", None)


def test_shipped_verifiers_rows_are_the_taskset_s():
    from flowrl.envs.verifiers_tasks import make_rows

    root = HERE.parents[1] / "data" / "verifiers_sums"
    rows = [json.loads(line) for name in ("train", "test") for line in (root / f"{name}.jsonl").read_text().splitlines()]
    assert rows == make_rows("flowrl.envs.verifiers_sums")


# ---- MCP ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_env():
    from flowrl.envs.mcp_tools import MCPTools

    env = MCPTools({"target": "python -m flowrl.envs.mcp_calc_server"})
    yield env
    env.client.close()


def test_mcp_tools_are_listed_with_valid_schemas(mcp_env):
    tools = mcp_env.tools()
    assert [t["function"]["name"] for t in tools] == ["add", "calculate"]
    assert tools[0]["function"]["parameters"]["required"] == ["a", "b"]


def test_mcp_calls_in_either_format_are_answered_as_tool_messages(mcp_env):
    mcp_env.reset({"prompt": "2+3?", "answer": "5"})
    r = mcp_env.step("Let me add. " + render_tool_call(ToolCall("add", {"a": 2, "b": 3}), "hermes"))
    assert (r.done, r.info) == (False, {"tool_call": True, "tool_error": False})
    assert r.messages == ({"role": "tool", "content": "5", "name": "add", "tool_call_id": "call_0"},)
    assert r.observation == "\n<tool_response>\n5\n</tool_response>\n"
    r = mcp_env.step(render_tool_call(ToolCall("calculate", {"expression": "(2+3)*7"}), "llama3"))
    assert r.messages[0]["content"] == "35"
    two = mcp_env.step(render_tool_call(ToolCall("add", {"a": 1, "b": 1})) + render_tool_call(ToolCall("add", {"a": 2, "b": 2})))
    assert [m["content"] for m in two.messages] == ["2", "4"]
    for bad in (ToolCall("nope", {}), ToolCall("add", {"a": "x"})):  # unknown tool; arguments the server refuses
        r = mcp_env.step(render_tool_call(bad))
        assert r.info["tool_error"] and not r.done and r.messages[0]["role"] == "tool"
    assert "no tool `nope`" in mcp_env.step(render_tool_call(ToolCall("nope", {}))).observation
    final = mcp_env.step("5")
    assert (final.done, final.reward) == (True, 1.0)
    mcp_env.reset({"prompt": "2+3?", "answer": "5"})
    assert mcp_env.step("6").reward == 0.0


def test_mcp_schema_problems_name_the_tool_and_the_place():
    from flowrl.envs.mcp_tools import schema_problems

    ok = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "object",
                                                                      "properties": {"x": {"type": 5}}}}}
    flat = {"type": "function", "function": {"name": "h", "parameters": {"type": "string"}}}
    problems = schema_problems([ok, bad, flat])
    assert len(problems) == 2
    assert problems[0].startswith("tool `g`: its input schema is not valid JSON Schema at 'properties/x/type'")
    assert problems[1].startswith("tool `h`: its input schema must describe an object")


# ---- tool calls and chat continuations -----------------------------------------------------------


def test_tool_call_parser_round_trips_and_keeps_what_is_not_a_call():
    for fmt in ("hermes", "llama3"):
        call = ToolCall("calc", {"expression": "1+1", "nested": {"k": [1, 2]}}, "call_0")
        assert parse_tool_calls(render_tool_call(call, fmt), fmt).calls == [call]
    broken = 'x <tool_call>{"name": "f", "arguments": {</tool_call> y'
    parsed = parse_tool_calls(broken, "hermes")
    assert (parsed.calls, parsed.content, len(parsed.errors)) == ([], broken, 1)
    assert parse_tool_calls('{"a": 1}', "llama3").calls == []  # JSON without a name: an answer, not a call
    cut = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "hermes")  # stopped before </tool_call>
    assert [c.name for c in cut.calls] == ["f"]


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_continuation_is_the_template_s_own_rendering(family):
    """Appending the continuation to [the prompt + the model's turn as sampled] gives exactly what the
    template renders for the whole conversation: nothing dropped (the newline after <|im_end|>)."""
    from family_cases import build_family_tokenizer

    tok = build_family_tokenizer(family)
    convo = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    turn = "The answer is 4."
    sampled = prompt + turn + tok.eos_token  # the engine stops at the EOS, which is in the row
    new = [{"role": "user", "content": "Are you sure?"}]
    whole = tok.apply_chat_template(convo + [{"role": "assistant", "content": turn}] + new, tokenize=False,
                                    add_generation_prompt=True)
    assert sampled + continuation(tok, new, ended_with=tok.eos_token) == whole
    assert prompt + turn + continuation(tok, new, ended_with=None) == whole  # a cut turn gets the template's end


# ---- the compiler's checks ---------------------------------------------------------------------


def _check(tmp_path, decl: str) -> str:
    (tmp_path / "rows.jsonl").write_text('{"prompt": "0-99=", "answer": "", "seed": 1}\n')
    flow = tmp_path / "f.flow"
    flow.write_text(f"""model m = tiny()
dataset d = jsonl("rows.jsonl")
{decl}
flow main() {{
  c = generate(m, sample(d, size = 2), n = 2)
  repeat 2 until done {{ o = env_step(e, c)  c = generate(m, o) }}
  update(m, c, group_advantage(c, group = 2), loss = pg())
}}
""")
    try:
        check_file(str(flow))
    except FlowError as err:
        return str(err)
    return ""


def test_check_accepts_installed_libraries_and_known_ids(tmp_path):
    assert _check(tmp_path, 'env e = textarena("GuessTheNumber-v0")') == ""
    assert _check(tmp_path, 'env e = gymnasium("flowrl.envs.gym_guess:GuessNumber-v0")') == ""
    assert _check(tmp_path, 'env e = gymnasium("CartPole-v1")') == ""
    assert _check(tmp_path, 'env e = mcp("python -m flowrl.envs.mcp_calc_server")') == ""
    assert _check(tmp_path, 'env e = verifiers("flowrl.envs.verifiers_sums")') == ""
    assert _check(tmp_path, 'env e = verifiers("textarena")') == ""  # one of verifiers' own tasksets


def test_check_refuses_unknown_ids_with_the_nearest(tmp_path):
    err = _check(tmp_path, 'env e = textarena("GuessTheNumbr-v0")')
    assert "f.flow:3:19: error[E641]: `GuessTheNumbr-v0` is not a textarena environment id" in err
    assert "did you mean `GuessTheNumber-v0`" in err
    err = _check(tmp_path, 'env e = gymnasium("flowrl.envs.gym_guess:GuessNumbr-v0")')
    assert "error[E641]: `GuessNumbr-v0` is not a gymnasium environment id" in err and "`GuessNumber-v0`" in err
    assert "error[E641]: `CartPol-v1`" in _check(tmp_path, 'env e = gymnasium("CartPol-v1")')
    err = _check(tmp_path, 'env e = verifiers("no_such_taskset")')
    assert "error[E641]: `no_such_taskset` is not a verifiers taskset" in err and "textarena" in err


def test_check_refuses_a_game_that_does_not_import_on_this_python(tmp_path):
    if sys.version_info >= (3, 12):
        pytest.skip("every TextArena game compiles on 3.12+")
    err = _check(tmp_path, 'env e = textarena("Checkers-v0")')
    assert "error[E642]: TextArena game `Checkers-v0`" in err and "does not import on this Python" in err


def test_check_refuses_a_missing_library_with_the_pip_hint(tmp_path, monkeypatch):
    from dataclasses import replace

    missing = {**ENV_LIBRARIES, "textarena": replace(ENV_LIBRARIES["textarena"], module="textarena_not_installed")}
    monkeypatch.setattr(check_mod, "ENV_LIBRARIES", missing)
    err = _check(tmp_path, 'env e = textarena("GuessTheNumber-v0")')
    assert "f.flow:3:9: error[E640]: `textarena(...)` needs the `textarena_not_installed` package" in err
    assert "pip install 'textarena==0.7.4'" in err


def test_check_refuses_missing_servers_and_action_classes(tmp_path):
    assert "error[E644]: cannot find the MCP server's module `no_server`" in _check(
        tmp_path, 'env e = mcp("python -m no_server")')
    assert "error[E644]: cannot find the MCP server's program `no-such-program`" in _check(
        tmp_path, 'env e = mcp("no-such-program --stdio")')
    (tmp_path / "my_env.py").write_text("class MyEnv:\n    pass\nclass MyAction:\n    pass\n")
    assert _check(tmp_path, 'env e = openenv("my_env:MyEnv", action = "my_env:MyAction")') == ""
    err = _check(tmp_path, 'env e = openenv("my_env:MyEnv", action = "my_env:Act")')
    assert "error[E644]: module `my_env` defines no `Act` (the action class)" in err


def test_library_environments_are_planned_as_environment_pools():
    from flowrl.compiler.pipeline import compile_file

    root = HERE.parents[1] / "flows"
    sized = compile_file(str(root / "verifiers_sums.flow"), until="size_env_pools").graph.sched.envs["tasks"]
    assert (sized.workers, sized.why) == (2, "sized by the schedule: 128 episodes in flight (128 per step x 1 step), "
                                             "64 calls per worker")
    sized = compile_file(str(root / "gymnasium_guess.flow"), until="size_env_pools").graph.sched.envs["game"]
    assert sized.workers == 1
