"""The estimate's workload read from the flow's datasets: prompt and reference completion lengths, verifiers'
fast paths."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flowrl.catalog.models import tiny_prompt_tokens
from flowrl.catalog.ops import OPS, VERIFIER_COSTS
from flowrl.compiler.explain import describe_plan
from flowrl.compiler.pipeline import compile_file, compile_text
from flowrl.compiler.data_workload import ROWS
from flowrl.compiler.workload import prompt_tokens
from flowrl.compiler.lower import lower

ROOT = Path(__file__).resolve().parents[2]

FLOW = '''
model m = tiny({model})
dataset d = jsonl("{data}"{options})
reward v = verifier("{verifier}")
flow f() {{
  r = generate(m, sample(d, size = 16), n = 4, max_tokens = 8)
  update(m, r, group_advantage(v(r), group = 4), logprobs(m, r))
}}
'''


def _write(tmp_path: Path, rows: list[dict], verifier: str = "math", name: str = "t", options: str = "",
           model: str = 'task = "arith"') -> Path:
    tmp_path = tmp_path / name
    tmp_path.mkdir(exist_ok=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flow = tmp_path / "t.flow"
    flow.write_text(FLOW.format(data="d.jsonl", verifier=verifier, options=options, model=model))
    return flow


def _estimate(flow: Path):
    return compile_file(str(flow)).graph.sched.estimate


def test_the_prompt_length_is_the_mean_of_the_first_rows_counted_by_the_tokenizer(tmp_path):
    rows = [{"prompt": "1+" * (i % 7) + "1=", "answer": str(i % 7 + 1)} for i in range(ROWS + 40)]
    good = rows[:3] + rows[4:]
    rows[3] = {"prompt": "", "answer": "1"}  # a bad row: not counted (check_resources reports such a file)
    est = _estimate(_write(tmp_path, rows))
    counted = [tiny_prompt_tokens(r["prompt"]) for r in good[:ROWS]]
    assert est.assumptions["prompt_tokens"] == {"r": round(statistics.fmean(counted), 2)}
    assert est.assumptions["prompt_source"] == {"r": f"mean of the first {ROWS} rows of `d.jsonl`"}
    longer = [{"prompt": r["prompt"] * 3, "answer": r["answer"]} for r in good]
    assert _estimate(_write(tmp_path, longer, name="longer")).assumptions["prompt_tokens"]["r"] > 2 * statistics.fmean(counted)


def test_without_readable_rows_the_prompt_length_is_assumed():
    g = compile_text(FLOW.format(data="nowhere.jsonl", verifier="math", options="", model='task = "arith"'), "mem.flow",
                     allow_missing=True)
    a = g.sched.estimate.assumptions
    assert a["prompt_tokens"] == {"r": prompt_tokens(g.sched.facts["m"])}
    assert a["prompt_source"] == {"r": "assumed: a quarter of the model's context"}


def test_the_plan_says_where_the_prompt_length_came_from():
    text = describe_plan(lower(compile_file(str(ROOT / "flows" / "arith_grpo.flow")).graph), explain=True)
    line = next(x for x in text.splitlines() if x.strip().startswith("workload:"))
    assert f"(mean of the first {ROWS} rows of `../data/arith/train.jsonl`)" in line


def _score_s(flow: Path) -> float:
    return next(o.seconds for o in _estimate(flow).ops if o.kind == "score")


@pytest.mark.parametrize("answers, integer", [(["12", "-7", 3], True), (["1/2", "12", "3"], False),
                                              (["1.5", "2", "3"], False), ([True, 1, 2], False)])
def test_math_verifier_is_costed_by_its_fast_path_on_integer_answers(tmp_path, answers, integer):
    rows = [{"prompt": f"{i}+1=", "answer": answers[i % 3]} for i in range(30)]
    flow = _write(tmp_path, rows)
    assert compile_file(str(flow)).graph.sched.data["r"].integer_answers is integer
    slow, fast = VERIFIER_COSTS["math"].seconds_per_item, VERIFIER_COSTS["math"].integer_seconds_per_item
    overhead = _score_s(_write(tmp_path, rows, "exact", "exact")) - 64 * VERIFIER_COSTS["exact"].seconds_per_item / 2
    assert _score_s(flow) == pytest.approx(overhead + 64 * (fast if integer else slow) / 2, rel=1e-6)


def test_every_builtin_verifier_has_a_cost_record():
    assert OPS["verifier"].costs_by_name is VERIFIER_COSTS
    assert all(c.seconds_per_item > 0 for c in VERIFIER_COSTS.values())
    # the sandboxed one runs a process per completion: the slowest by far
    assert max(VERIFIER_COSTS, key=lambda n: VERIFIER_COSTS[n].seconds_per_item) == "code"


def _solved(i: int) -> dict:
    """A row whose reference completion is ``i % 9 + 1`` characters (tiny tokenizer: one token each)."""
    return {"prompt": f"{i}+0=", "answer": str(i), "solution": "1" * (i % 9 + 1)}


def test_a_reference_completion_sets_the_responses_mean_length(tmp_path):
    rows = [_solved(i) for i in range(ROWS + 10)]
    est = _estimate(_write(tmp_path, rows, options=', completion = "solution"'))
    # each written out, then <eos>; max_tokens is 8
    expected = statistics.fmean(min(len(r["solution"]) + 1, 8) for r in rows[:ROWS])
    assert est.assumptions["response_lengths"]["r"]["mean"] == pytest.approx(expected, rel=0.02)
    assert est.assumptions["response_source"] == {"r": f"mean of the first {ROWS} rows' `solution` in `d.jsonl`"}
    # without the option, a policy that writes no answer alone (random weights) leaves the length to the
    # assumption (a median of max_tokens / 4)
    plain = _estimate(_write(tmp_path, rows, name="plain", model='task = "arith", warm_start = 0'))
    assert plain.assumptions["response_lengths"]["r"]["median"] == 2
    assert plain.assumptions["response_source"]["r"].startswith("assumed")
    # and longer responses cost more
    assert est.step_s > plain.step_s


@pytest.mark.parametrize("answers", [["7", "-12", "198"], [7, -12, 198], ["1/2", "x", "0.25"]])
def test_a_policy_warm_started_on_answers_is_expected_to_write_them_alone(tmp_path, answers):
    # tiny(task = "arith") is warm-started to write a row's answer, then <eos>: its responses are the answers
    rows = [{"prompt": f"{i}+0=", "result": answers[i % 3]} for i in range(ROWS + 10)]
    g = compile_file(str(_write(tmp_path, rows, options=', answer = "result"'))).graph
    expected = statistics.fmean(min(len(str(r["result"])) + 1, 8) for r in rows[:ROWS])
    assert g.sched.data["r"].response_tokens == pytest.approx(expected, abs=0.01)
    assert g.sched.estimate.assumptions["response_source"] == {
        "r": f"mean of the first {ROWS} rows' `result` in `d.jsonl`: "
             "the policy, warm-started on answers, writes them alone"}
    # a reference completion, where the dataset names one, is what the policy writes instead
    solved = [{**r, "solution": "1" * 7} for r in rows]
    options = ', answer = "result", completion = "solution"'
    g = compile_file(str(_write(tmp_path, solved, name="solved", options=options))).graph
    assert g.sched.data["r"].response_tokens == 8


@pytest.mark.parametrize("model", ['task = "arith", warm_start = 0',  # random weights write anything
                                   'task = "arith_tool"'])  # warm-started on transcripts, not on answers alone
def test_a_policy_not_warm_started_on_answers_alone_keeps_the_assumed_length(tmp_path, model):
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(20)]
    g = compile_file(str(_write(tmp_path, rows, model=model))).graph
    assert g.sched.data["r"].response_tokens is None
    assert g.sched.estimate.assumptions["response_source"]["r"].startswith("assumed")


def test_which_tiny_policies_write_answers_alone():
    from flowrl.catalog.models import tiny_writes_answers
    from flowrl.tasks import TASKS

    assert tiny_writes_answers({"task": "arith"}) and tiny_writes_answers({"task": "arith_code", "warm_start": 50})
    assert not tiny_writes_answers({"task": "arith", "warm_start": 0})
    assert [t for t in TASKS if not tiny_writes_answers({"task": t})] == [t for t in TASKS if TASKS[t].sft_turns]


def test_reference_completions_longer_than_max_tokens_count_as_capped(tmp_path):
    rows = [{**_solved(i), "solution": "1" * 40} for i in range(20)]  # 41 tokens with <eos>; max_tokens is 8
    g = compile_file(str(_write(tmp_path, rows, options=', completion = "solution"'))).graph
    assert g.sched.data["r"].response_tokens == 8
    assert g.sched.estimate.assumptions["response_lengths"]["r"]["mean"] == 8


def test_the_longtail_plan_expects_responses_as_long_as_its_solutions():
    rows = [json.loads(line) for line in (ROOT / "data" / "longtail" / "train.jsonl").read_text().splitlines()[:ROWS]]
    g = compile_file(str(ROOT / "flows" / "longtail_grpo.flow")).graph
    op = next(iter(g.sched.data))
    expected = statistics.fmean(len(r["solution"]) + 1 for r in rows)  # the task's tokenizer: one per character
    assert g.sched.data[op].response_tokens == pytest.approx(expected, abs=0.01)
    line = next(x for x in describe_plan(lower(g), explain=True).splitlines() if x.strip().startswith("workload:"))
    assert f"(mean of the first {ROWS} rows' `solution` in `../data/longtail/train.jsonl`)" in line


def test_the_runtime_refuses_a_row_without_the_named_completion(tmp_path):
    from flowrl.data.datasets import DatasetError
    from flowrl.plan import DatasetPlan
    from flowrl.runtime.data import jsonl

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_solved(1)) + "\n" + json.dumps({"prompt": "2+0=", "answer": "2"}) + "\n")
    plan = DatasetPlan("d", "jsonl", str(data), "prompt", "answer", "", "t.flow:2:1", completion="solution")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: missing field 'solution'"):
        jsonl(plan)
    assert len(jsonl(DatasetPlan("d", "jsonl", str(data), "prompt", "answer", "", "t.flow:2:1")).rows) == 2


def test_a_chat_completion_counts_its_messages_text(tmp_path):
    # TRL's conversational prompt-completion rows: the completion a list of assistant messages
    rows = [{"prompt": f"{i}+0=", "answer": str(i), "solution": [{"role": "assistant", "content": "1" * (i % 5 + 1)}]}
            for i in range(20)]
    g = compile_file(str(_write(tmp_path, rows, options=', completion = "solution"'))).graph
    assert g.sched.data["r"].response_tokens == pytest.approx(statistics.fmean(i % 5 + 2 for i in range(20)))


def test_a_verifier_costs_the_driver_its_reward_pool_not_an_engine_dispatch(tmp_path):
    # a verifier's worker processes are not engines: its score op pays the pool's round trip and the
    # driver's handling of each completion, not the profile's per-op engine dispatch
    from flowrl.cost.model import SCORE_CALL_S, SCORE_S_PER_SAMPLE, score_call_s

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
    samples = 16 * 4
    expected = samples * VERIFIER_COSTS["exact"].seconds_per_item / 2 + SCORE_CALL_S + SCORE_S_PER_SAMPLE * samples
    assert _score_s(_write(tmp_path, rows, "exact")) == pytest.approx(expected, rel=1e-3)
    assert score_call_s(samples, 0.02) == pytest.approx(SCORE_CALL_S + SCORE_S_PER_SAMPLE * samples + 0.02)

