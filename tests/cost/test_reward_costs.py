"""What `flowrl plan` charges a score op: a verifier on the driver's reward workers, a reward model or a
judge on its model's own engine (the catalogue's `serves_model` / `serves_engine`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.catalog.ops import VERIFIER_COSTS
from flowrl.compiler.pipeline import compile_file
from flowrl.cost import model as cm

FLOW = '''
model m = tiny(task = "arith")
model rm = tiny_rm(task = "arith")
model judge_m = tiny(task = "arith", seed = 1)
dataset d = jsonl("{data}")
reward exact = verifier("exact")
reward served = reward_model(rm)
reward judge = llm_judge(judge_m, template = "{{completion}}+00=", max_tokens = {judge_tokens})
reward both = weighted_sum(exact, served, weights = [1.0, 0.5])
flow f() {{
  r = generate(m, sample(d, size = 16), n = 4, max_tokens = 8)
  update(m, r, group_advantage({reward}(r), group = 4), logprobs(m, r))
}}
'''


def _estimate(tmp_path: Path, reward: str, judge_tokens: int = 4, name: str = "t"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "d.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(40)))
    flow = folder / "t.flow"
    flow.write_text(FLOW.format(data="d.jsonl", reward=reward, judge_tokens=judge_tokens))
    graph = compile_file(str(flow)).graph
    score = next(o for o in graph.sched.estimate.ops if o.kind == "score")
    return graph, score


def test_a_reward_model_scores_on_its_own_train_engine(tmp_path):
    graph, score = _estimate(tmp_path, "served")
    st, rows = graph.sched, 16 * 4
    engine = st.engines["rm.train"]
    forward = cm.forward_s(st.facts["rm"], st.hw, world=engine.world_size, tokens=score.tokens)
    # the driver's call and dispatch to the engine, then one forward of every scored row there (the
    # simulated steps' tokens: their sampled response lengths, about the expected ones)
    assert score.where == "rm.train" and score.tokens > 0
    assert score.seconds == pytest.approx(cm.score_call_s(rows) + forward, rel=0.05)
    assert score.seconds > cm.score_call_s(rows) + st.hw.op_overhead_s


def test_a_judge_decodes_on_its_own_rollout_engine_and_longer_judgements_cost_more(tmp_path):
    _, short = _estimate(tmp_path, "judge", judge_tokens=4, name="short")
    _, long = _estimate(tmp_path, "judge", judge_tokens=16, name="long")
    assert short.where == long.where == "judge_m.rollout"
    assert long.seconds > short.seconds > cm.score_call_s(16 * 4)


def test_a_weighted_sum_pays_for_its_verifier_and_its_reward_model(tmp_path):
    _, both = _estimate(tmp_path, "both", name="both")
    _, served = _estimate(tmp_path, "served", name="served")
    verifier = 16 * 4 * VERIFIER_COSTS["exact"].seconds_per_item / 2
    assert both.where == "rm.train"
    assert both.seconds == pytest.approx(served.seconds + verifier, rel=1e-6)


def test_a_verifier_scores_on_the_driver_without_an_engine(tmp_path):
    _, score = _estimate(tmp_path, "exact")
    rows = 16 * 4
    assert score.where == "reward"
    assert score.seconds == pytest.approx(rows * VERIFIER_COSTS["exact"].seconds_per_item / 2 + cm.score_call_s(rows),
                                          rel=1e-3)


def test_every_engine_a_reward_is_served_on_has_a_cost():
    from flowrl.catalog.ops import OPS
    from flowrl.compiler.schedule.estimate import SERVED_PASS

    served_on = {spec.serves_engine for spec in OPS.values() if spec.serves_model}
    assert served_on and served_on <= set(SERVED_PASS)


def test_the_plans_op_list_names_the_engine_a_served_reward_runs_its_pass_on(tmp_path, capsys):
    """`flowrl plan` lists the score op where lowering put it (the driver's reward call) and, for a reward
    model or a judge, the engine its estimate is charged to; a verifier's line says nothing more."""
    from flowrl.cli import main

    for reward, engine in (("served", "rm.train"), ("judge", "judge_m.rollout"), ("exact", None)):
        folder = tmp_path / reward
        folder.mkdir()
        (folder / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 8)
        (folder / "t.flow").write_text(FLOW.format(data="d.jsonl", reward=reward, judge_tokens=4))
        main(["plan", str(folder / "t.flow")])
        line = next(x for x in capsys.readouterr().out.splitlines() if " score " in x)
        assert ("its pass on" in line) == (engine is not None)
        assert engine is None or f"on reward (its pass on {engine})" in line
