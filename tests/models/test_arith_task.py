"""flowrl.tasks.arith and the task registry: deterministic, disjoint, verifiable splits."""

import json
import re

import pytest

from flowrl.rewards.verifiers import get_verifier
from flowrl.tasks import DATA_ROOT, UnknownTaskError, get_task
from flowrl.tasks.arith import ArithSpec, ArithTaskError, format_problem, make_split, make_splits


def test_format_problem():
    assert format_problem(12, "+", 35) == {"prompt": "12+35=", "answer": "47"}
    assert format_problem(3, "-", 40, width=2) == {"prompt": "03-40=", "answer": "-37"}


def test_make_split_is_deterministic_distinct_and_correct():
    spec = ArithSpec(max_operand=20, ops="+-", zero_pad=False)
    rows = make_split(300, 5, spec=spec)
    assert rows == make_split(300, 5, spec=spec)
    assert rows != make_split(300, 6, spec=spec)
    assert len({r["prompt"] for r in rows}) == 300
    for r in rows:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", r["prompt"]).groups()
        assert 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert {op for r in rows for op in "+-" if op in r["prompt"]} == {"+", "-"}


def test_zero_padding_gives_fixed_width_prompts():
    rows = make_split(200, 0, spec=ArithSpec(max_operand=99, ops="+-", zero_pad=True))
    assert {len(r["prompt"]) for r in rows} == {6}


def test_splits_are_disjoint_and_exclude_is_honoured():
    train, test = make_splits(300, 100, 1, spec=ArithSpec(max_operand=30))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    with pytest.raises(ArithTaskError, match=r"only 4 distinct problems exist"):
        make_split(5, 0, spec=ArithSpec(max_operand=1, ops="+"))


@pytest.mark.parametrize("kwargs, pattern", [({"ops": "*"}, r"unknown operators \['\*'\]"), ({"max_operand": 0}, "max_operand=0")])
def test_bad_spec(kwargs, pattern):
    with pytest.raises(ArithTaskError, match=pattern):
        ArithSpec(**kwargs)


def test_shipped_files_equal_the_generator():
    task = get_task("arith")
    train, test = make_splits()
    for name, rows in (("train", train), ("test", test)):
        path = DATA_ROOT / "arith" / f"{name}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == rows
        assert task.rows(name) == rows
    assert task.verifier == "exact"
    # Every answer fits the generation budget (answer + EOS), and the verifier accepts it.
    assert max(len(r["answer"]) for r in train + test) + 1 <= task.max_new_tokens
    assert get_verifier(task.verifier)([r["answer"] for r in test], [r["answer"] for r in test]) == [1.0] * len(test)
    assert set("".join(r["prompt"] + r["answer"] for r in train)) <= set(task.chars)


def test_unknown_task():
    with pytest.raises(UnknownTaskError, match=r"unknown task 'algebra'; registered tasks: \['arith', 'arith_code', 'arith_tool', 'longtail', 'rg_basic_arithmetic', 'rg_chain_sum', 'rg_spell_backward'\]"):
        get_task("algebra")
    with pytest.raises(ValueError, match="has no split 'dev'"):
        get_task("arith").rows("dev")


def test_arith_code_rows_are_programs_the_code_verifier_runs():
    from flowrl.tasks import arith_code

    task = get_task("arith_code")
    train, test = arith_code.make_splits()
    arith_train, arith_test = make_splits()
    for name, rows, plain in (("train", train, arith_train), ("test", test, arith_test)):
        path = DATA_ROOT / "arith_code" / f"{name}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == rows
        assert task.rows(name) == rows
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]  # the same problems
    assert task.verifier == "code"
    assert max(len(r["answer"]) for r in train + test) + 1 <= task.max_new_tokens
    assert set("".join(r["prompt"] + r["answer"] for r in train)) <= set(task.chars)
    # In the sandbox: the reference program passes, so does any program printing the number; others fail.
    rows = test[:4]
    a, b = rows[0]["prompt"].rstrip("=").split("+")
    completions = [r["answer"] for r in rows] + [f"print({int(a)}+{int(b)})", "print(0)", "print(", "47"]
    scored = get_verifier("code")(completions, [""] * len(completions), rows=rows + [rows[0]] * 4)
    assert scored == [1.0] * 4 + [1.0, 0.0, 0.0, 0.0]


def test_arith_tool_rows_are_five_digit_sums_and_the_warm_start_shows_both_ways_to_answer():
    from flowrl.envs.calculator import Calculator
    from flowrl.tasks import arith_tool

    task = get_task("arith_tool")
    train, test = arith_tool.make_splits()
    for name, rows in (("train", train), ("test", test)):
        path = DATA_ROOT / "arith_tool" / f"{name}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == rows
        assert task.rows(name) == rows
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {len(r["prompt"]) for r in train + test} == {10} and {len(r["answer"]) for r in train + test} == {5}
    assert set("".join(r["prompt"] + r["answer"] for r in train)) <= set(task.chars)
    # The warm start's tool transcripts are what the calculator answers, and every turn fits a generate.
    shown = [r for r in train if arith_tool.calls_tool(r)]
    assert abs(len(shown) / len(train) - arith_tool.TOOL_FRAC) < 0.03
    for row in shown[:50]:
        call, observation, answer = task.sft_turns(row)
        env = Calculator()
        env.reset(row)
        first = env.step(call)
        assert (first.observation, first.done) == (observation, False)
        assert env.step(answer).reward == 1.0
        assert len(call) + 1 <= task.max_new_tokens
    direct = next(r for r in train if not arith_tool.calls_tool(r))
    assert task.sft_turns(direct) == [direct["answer"]]
