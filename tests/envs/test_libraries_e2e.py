"""Environment libraries trained end to end with the real libraries (Ray, vLLM on CPU, the torch trainer):
a Gymnasium game (the shipped flows/gymnasium_guess.flow), a verifiers taskset (the shipped
flows/verifiers_sums.flow), a TextArena game and the tools of an MCP server over stdio, two steps each
on tiny models.

* Gymnasium: the tiny ``arith`` model plays flowrl.envs.gym_guess through the ``gymnasium`` op; the
  environment's own rewards are the advantage's (no reward function).
* TextArena: GuessTheNumber-v0 with a tiny character-level model that has a ChatML chat template;
  the dataset is chat (``chat = true``), so every hint of the game comes back as a user turn
  rendered by the template (its ``<|im_start|>user`` header is in the rows the trainer reads).
* MCP: the calculator server (flowrl.envs.mcp_calc_server) started by the environment workers; its
  tools are rendered by the chat template into every prompt (the samples show them), the model's
  turns go to the adapter (its tool calls answered over MCP: tests/envs/test_libraries.py), and the
  standard library's agentic flow scores the final answers with the math verifier.
"""

from __future__ import annotations

import json
import shutil
import string
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from e2e_kit import shared_ray  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]

CHATML_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""A ChatML template that renders tools (Qwen's layout, shortened)."""


def chat_model(folder: Path) -> Path:
    """A tiny random model over printable ASCII (and newline), 2048 positions, with :data:`CHATML_TOOLS`."""
    from transformers import AutoTokenizer

    from flowrl.models.tiny import build_tiny_model

    chars = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    build_tiny_model(folder, chars=chars, max_position=2048, hidden=64, heads=2, kv_heads=1, intermediate=128)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHATML_TOOLS
    tok.save_pretrained(folder)
    return folder


def samples(out: Path) -> list[dict]:
    path = out / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def gym_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gym")
    shutil.copytree(ROOT / "flows", work / "flows")
    shutil.copytree(ROOT / "data" / "gym_guess", work / "data" / "gym_guess")
    return run_file(str(work / "flows" / "gymnasium_guess.flow"), out=str(work / "run"), steps=2,
                    sets={"batch": "2", "group": "2", "max_turns": "3"}, ray_address=shared_ray())


def test_a_gymnasium_game_trains_on_its_own_rewards(gym_run):
    rows = [r for r in gym_run.rows if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/errors"] == 0 and row["env/calls"] >= 4  # 2 prompts x 2 episodes, at least one turn each
        assert 1 <= row["env/turns_mean"] <= 4
        assert row["mismatch/abs_max"] < 1e-4


@pytest.fixture(scope="module")
def verifiers_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("verifiers")
    shutil.copytree(ROOT / "flows", work / "flows")
    shutil.copytree(ROOT / "data" / "verifiers_sums", work / "data" / "verifiers_sums")
    return run_file(str(work / "flows" / "verifiers_sums.flow"), out=str(work / "run"), steps=2,
                    sets={"batch": "2", "group": "2"}, ray_address=shared_ray())


def test_a_verifiers_taskset_trains_on_its_tasks_rewards(verifiers_run):
    rows = [r for r in verifiers_run.rows if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2]
    for row in rows:  # one turn per episode, each scored by its task
        assert (row["env/calls"], row["env/errors"], row["env/done_frac"]) == (4, 0, 1.0)
        assert row["loop/agentic_env.repeat1/turns"] == 1


TEXTARENA_FLOW = """model policy = hf("model")
dataset games = jsonl("games.jsonl", chat = true)
env game = textarena("GuessTheNumber-v0", timeout = 60.0, workers = 1)
flow main(steps: int = 2) {
  convo = generate(policy, sample(games, size = 2), n = 2, max_tokens = 8, seed = 1)
  repeat 2 until done {
    obs = env_step(game, convo)
    convo = generate(policy, obs, max_tokens = 8, seed = 1)
  }
  old_lp = logprobs(policy, convo)
  update(policy, convo, group_advantage(convo, group = 2), old_lp, loss = ppo_clip(0.2), lr = 1e-3)
}
"""


@pytest.fixture(scope="module")
def textarena_run(tmp_path_factory):
    from flowrl.envs.textarena_games import make_rows

    work = tmp_path_factory.mktemp("textarena")
    chat_model(work / "model")
    rows = make_rows("GuessTheNumber-v0", 8, seed=1)
    (work / "games.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "ta.flow").write_text(TEXTARENA_FLOW)
    return run_file(str(work / "ta.flow"), out=str(work / "run"), log_samples=1, ray_address=shared_ray())


def test_a_textarena_game_trains_with_its_hints_as_chat_turns(textarena_run):
    rows = [r for r in textarena_run.rows if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/errors"] == 0 and row["env/calls"] >= 4
        assert row["mismatch/abs_max"] < 1e-4  # observation tokens appended between turns change nothing
    # every hint the game gave an unfinished episode came back as a user turn rendered by the template
    assert sum(r.get("env/chat_turns", 0) for r in rows) >= 1


MCP_FLOW = """import stdlib.agentic
model policy = hf("model")
dataset sums = jsonl("sums.jsonl", chat = true)
env calc = mcp("python -m flowrl.envs.mcp_calc_server", timeout = 60.0, workers = 1)
reward right = verifier("math")
flow main(steps: int = 2) {
  agentic(policy, sums, calc, right, batch = 2, group = 2, max_turns = 2, max_tokens = 8, lr = 1e-3, kl = 0.0,
          seed = 1)
}
"""


@pytest.fixture(scope="module")
def mcp_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("mcp")
    chat_model(work / "model")
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a, b in ((2, 3), (4, 5), (6, 7), (8, 9))]
    (work / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "mcp.flow").write_text(MCP_FLOW)
    return run_file(str(work / "mcp.flow"), out=str(work / "run"), log_samples=1, ray_address=shared_ray())


def test_an_mcp_server_s_tools_train_in_the_chat_template_s_rendering(mcp_run):
    rows = [r for r in mcp_run.rows if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/errors"] == 0 and row["env/calls"] >= 4
    logged = samples(mcp_run.out)
    assert logged
    for s in logged:  # the server's tools, as the template renders them, before the question
        assert s["prompt"].startswith("<|im_start|>system\n# Tools\n<tools>\n")
        assert '"name": "add"' in s["prompt"] and '"name": "calculate"' in s["prompt"]
