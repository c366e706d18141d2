"""`llm_judge(m, template = ..., max_tokens = ..., on_error = ...)`: a frozen model's judgement as the reward.

The scorer is tested here above a stand-in engine service (it records what it was asked and
writes back a chosen judgement); the compiler side (the judge's rollout engine planned and placed)
with the real compiler; a run on real engines in tests/runtime/test_e2e.py.
"""

from __future__ import annotations

import pytest

from flowrl.catalog.engines import ENGINES
from flowrl.launch import build_plan
from flowrl.models.tiny import build_tiny_model
from flowrl.runtime.judge import LLMJudge, fill, parse_score
from flowrl.runtime.rewards import ScoreJob, build_rewards, score_rollouts


@pytest.mark.parametrize("text, score", [("7", 7.0), ("score: 8/10", 8.0), ("-2.5!", -2.5), (" +3e1 ", 30.0),
                                         (".5", 0.5), ("no", None), ("", None), ("--", None)])
def test_parse_score_takes_the_first_number(text, score):
    assert parse_score(text) == score


def test_fill_replaces_the_three_fields_and_nothing_else():
    assert fill("{prompt}|{completion}|{answer}|{other}", "p {completion}", "c", "a") == "p {completion}|c|a|{other}"


class Engines:
    """Writes back, for each judge input, the judgement ``answer(input text)``; records every call."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer, self.calls = tokenizer, answer, []

    def generate(self, model, prompts, spec, step):
        self.calls.append((model, prompts, spec, step))
        texts = [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        return [[type("C", (), {"text": self.answer(t)})()] for t in texts], 0


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("judge") / "m", seed=0)


def _judge(judge_dir, answer, template="{prompt}{completion}", max_tokens=4):
    judge = LLMJudge("j", template, max_tokens, -1.0, "f.flow:3:1")
    judge.bind(None, None, {"j": judge_dir})
    engines = Engines(judge.tokenizer, answer)
    judge.engines = engines
    return judge, engines


def test_the_judgement_is_the_reward_greedy_on_the_judges_engine(judge_dir):
    judge, engines = _judge(judge_dir, lambda t: {"1+1=2": "9", "1+1=3": "0"}.get(t, "x"), max_tokens=3)
    job = ScoreJob(["2", "3", "4"], ["2", "2", "2"], ["1+1=", "1+1=", "1+1="], None, None, 5)
    res = score_rollouts(judge, job)
    assert res.rewards == [9.0, 0.0, -1.0]  # "x" holds no number: on_error
    assert [e.index for e in res.errors] == [2] and "holds no number" in res.errors[0].message
    (model, prompts, spec, step), = engines.calls  # one batched call, at the run's step
    assert (model, step, spec.n, spec.temperature, spec.max_tokens) == ("j", 5, 1, 0.0, 3)
    assert prompts[0] == list(judge.tokenizer("1+1=2").input_ids)  # the judge's own tokenizer


def test_an_input_too_long_for_the_judge_is_an_error_and_is_not_sent(judge_dir):
    judge, engines = _judge(judge_dir, lambda t: "1", max_tokens=4)
    assert judge.context == 128
    long = "1" * 200
    res = judge.score(["2", long], ["2", "2"], ["1+1=", "1+1="])
    assert res.rewards == [1.0, -1.0]
    assert "exceeds `j`'s context of 128 tokens" in res.errors[0].message and res.errors[0].index == 1
    assert len(engines.calls[0][1]) == 1  # only the input that fits went to the engine


def _flow(tmp_path, judge_layout: bool = True) -> str:
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "j.flow"
    layout = "  grader.rollout = vllm(tp = 1)\n" if judge_layout else ""
    path.write_text(f"""import stdlib.grpo
model policy = tiny(task = "arith")
model grader = tiny(task = "arith", seed = 1)
dataset d = jsonl("d.jsonl")
reward judge = llm_judge(grader, template = "{{completion}}+00=", max_tokens = 4, on_error = -1.0)
flow main(steps: int = 1) {{
  grpo(policy, d, judge, batch = 2, group = 2, max_tokens = 4, kl = 0.0)
}}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  colocate policy.train, policy.rollout, grader on all
{layout}  staleness 1
}}
""")
    return str(path)


def test_the_compiler_plans_the_judges_rollout_engine_and_the_runtime_builds_the_judge(tmp_path):
    plan = build_plan(_flow(tmp_path))
    grader = {m.id: m for m in plan.models}["grader"]
    assert grader.rollout_engine is not None and ENGINES[grader.rollout_engine.kind].serves == "rollout"
    assert grader.train_engine is None  # a frozen judge: no trainer, no resync
    assert [r.model for r in plan.resyncs] == ["policy"]
    (judge,) = [r for r in plan.rewards if r.id == "judge"]
    assert judge.options == {"target": "grader", "template": "{completion}+00=", "max_tokens": 4, "on_error": -1.0}
    built = build_rewards(plan)
    assert isinstance(built["judge"], LLMJudge) and built["judge"].model == "grader"
