"""What a run says about its rewards (issue 32): every reward error in events.log with its
traceback, what a reward function prints in events.log (secrets redacted, never the terminal),
"waiting on rewards (n/N)" on the progress line while samples are pending, and the `timeout`
option a flow gives a reward reaching its pool."""

from __future__ import annotations

import io
import json
import sys

import pytest

from flowrl.plan import OpPlan, RewardPlan
from flowrl.rewards.pool import RewardError
from flowrl.runtime.driver import EventFile
from flowrl.runtime.observe import Progress
from flowrl.runtime.rewards import build_reward

SECRET = "hf_s3cretvalue1234"
OP = OpPlan("grpo.scores", "score", "score", {}, {}, None, "driver", (), "f.flow:9:3")


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_reward_error_is_logged_with_its_traceback_and_output_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    said = []
    events = EventFile(tmp_path / "events.log", said.append)
    errors = [RewardError.of(i, f"p{i}", f"c{i}", f"ValueError: bad {i}",
                             f"Traceback (most recent call last):\n  File \"r.py\", line {i}\nValueError: bad {SECRET}",
                             f"token is {SECRET}\n") for i in range(5)]
    events.reward_errors(OP, 3, errors)
    events.reward_output(OP, 3, [(7, f"debug {SECRET}\n"), (8, "more\n")])
    events.reward_output(OP, 4, [(0, "again\n")])
    events.close()
    text = (tmp_path / "events.log").read_text()
    assert SECRET not in text and "***HF_TOKEN***" in text
    rows = _events(tmp_path / "events.log")
    logged = [r["reward_error"] for r in rows if "reward_error" in r]
    assert [e["index"] for e in logged] == [0, 1, 2, 3, 4]  # every one, not the first three
    assert all(e["traceback"].startswith("Traceback (most recent call last):") for e in logged)
    assert logged[2]["output"] == "token is ***HF_TOKEN***\n"
    assert [(r["step"], r["reward_output"]) for r in rows if "reward_output" in r] == [
        (3, {"index": 7, "output": "debug ***HF_TOKEN***\n"}), (3, {"index": 8, "output": "more\n"}),
        (4, {"index": 0, "output": "again\n"})]
    # The terminal gets one warning per step of errors and one note that the reward prints, no output.
    assert len(said) == 2 and "5 reward error(s)" in said[0] and "its output is in events.log" in said[1]
    assert not any("debug" in s or SECRET in s for s in said)


def test_waiting_on_rewards_off_a_terminal_is_a_line_at_most_every_ten_seconds():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, stream=out, clock=clock)
    p.update(1, {"reward/mean": 0.5})
    p.status("waiting on rewards (3/64)")
    clock.t += 1.0
    p.status("waiting on rewards (4/64)")  # too soon: not printed
    clock.t += 10.0
    p.status("waiting on rewards (9/64)")
    assert out.getvalue().splitlines()[1:] == ["step 2/10: waiting on rewards (3/64)", "step 2/10: waiting on rewards (9/64)"]


def test_waiting_on_rewards_on_a_terminal_follows_the_last_line_until_the_next_update(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, stream=out, clock=clock, live=True, width=120)
    p.update(1, {"reward/mean": 0.5})
    p.status(f"waiting on rewards (3/64) {SECRET}")
    assert out.getvalue().endswith("\r\x1b[Kstep  1/10 [#.........] reward 0.500 eta 0s | step 2: waiting on rewards "
                                   "(3/64) ***HF_TOKEN***")
    p.update(2, {"reward/mean": 0.6})
    assert out.getvalue().rsplit("\r\x1b[K", 1)[1].startswith("step  2/10 [##........] reward 0.600")
    assert "waiting" not in out.getvalue().rsplit("\r\x1b[K", 1)[1]


def test_the_flows_timeout_reaches_the_pool_and_names_itself(monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "rewards"))
    plan = RewardPlan("r", "python_reward", {"target": "flowrl_user_rewards:sleeps_on_sleep", "workers": 1,
                                             "on_error": -1.0, "timeout": 0.5}, "f.flow:2:12")
    pool = build_reward(plan, None)
    try:
        assert pool.timeout_s == 0.5
        res = pool.score(["a", "sleep"], ["", ""])
    finally:
        pool.close()
    assert res.rewards == [1.0, -1.0]
    assert "did not finish within its timeout of 0.5 s (the flow's `timeout` option" in res.errors[0].message


def test_the_code_verifiers_timeout_is_each_programs_deadline():
    plan = RewardPlan("r", "verifier", {"target": "code", "correct": 1.0, "wrong": 0.0, "timeout": 0.5}, "f.flow:2:12")
    scorer = build_reward(plan, None)
    try:
        rows = [{"tests": [{"stdin": "", "stdout": "1\n"}]}] * 2
        res = scorer.score(["```python\nimport time\ntime.sleep(0.2)\nprint(1)\n```",
                            "```python\nimport time\ntime.sleep(3)\nprint(1)\n```"], ["", ""], rows=rows)
    finally:
        scorer.close()
    assert res.rewards == [1.0, 0.0]


def test_what_an_environment_prints_goes_to_events_log_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    said = []
    events = EventFile(tmp_path / "events.log", said.append)
    events.env_output(OP, 2, [(1, f"tool sees {SECRET}\n")])
    events.env_output(OP, 3, [(0, "again\n")])
    events.close()
    rows = _events(tmp_path / "events.log")
    assert [r["env_output"] for r in rows] == [{"index": 1, "output": "tool sees ***HF_TOKEN***\n"},
                                               {"index": 0, "output": "again\n"}]
    assert len(said) == 1 and "the environment of `grpo.scores`" in said[0] and SECRET not in said[0]
