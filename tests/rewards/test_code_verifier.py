"""flowrl.rewards.code: the `code` verifier runs completions against their rows' tests in the sandbox."""

from __future__ import annotations

import pytest

from flowrl.rewards import code as C
from flowrl.rewards.pool import RewardPool
from flowrl.rewards.verifiers import get_verifier

ADD_IO = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 -4\n", "stdout": "6"}]
ADD_ASSERTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def fenced(code: str, tag: str = "python") -> str:
    return f"Let me think.\n```{tag}\n{code}\n```\nDone."


@pytest.mark.parametrize(
    "completion, expected",
    [
        (fenced("print(1)"), "print(1)\n"),
        ("```\nprint(0)\n```\n```python\nprint(1)\n```\n```text\nout\n```", "print(1)\n"),  # python-tagged wins
        ("```py\na\n```\n```python3\nb\n```", "b\n"),  # the last python block
        ("```js\nconsole.log(1)\n```", "console.log(1)\n"),  # any block when none is python
        ("print(2)", "print(2)"),  # no fences: the whole completion
        ("```python\nprint(3)\nprint(4", "print(3)\nprint(4"),  # cut off by the token limit
    ],
)
def test_extract_code(completion, expected):
    assert C.extract_code(completion) == expected


def test_parse_tests_forms():
    io = [C.IOCase("1\n", "2\n")]
    assert C.parse_tests([{"stdin": "1\n", "stdout": "2\n"}]) == io
    assert C.parse_tests([{"input": "1\n", "output": "2\n"}]) == io
    assert C.parse_tests({"inputs": ["1\n"], "outputs": ["2\n"]}) == io
    assert C.parse_tests('{"inputs": ["1\\n"], "outputs": ["2\\n"]}') == io
    assert C.parse_tests(["assert f(1) == 2", {"stdin": "", "stdout": "x"}]) == [
        C.AssertCase("assert f(1) == 2"), C.IOCase("", "x")]
    assert C.parse_tests("assert f(1) == 2\nassert f(2) == 3") == [C.AssertCase("assert f(1) == 2\nassert f(2) == 3")]


@pytest.mark.parametrize(
    "value, pattern",
    [
        ([], r"row 0 field 'tests': no tests in \[\]; hint: give a list of"),
        ("", r"no tests in ''"),
        ([{"stdin": "1"}], r"test \{'stdin': '1'\} is neither an assert string nor a case"),
        ([3], r"test 3 is neither"),
        ({"inputs": ["1"], "outputs": []}, r"no tests in \{'inputs'"),
        ({"inputs": [[1]], "outputs": [], "fn_name": "f"}, r"call-based tests of 'f' need 'inputs' and 'outputs' lists"),
        ({"inputs": [[1]], "outputs": [2], "fn_name": "f(x)"}, r"'fn_name' 'f\(x\)' is not a Python function name"),
        (7, r"no tests in 7"),
    ],
)
def test_parse_tests_errors_show_the_value(value, pattern):
    with pytest.raises(C.TestsFormatError, match=pattern):
        C.parse_tests(value, "row 0 field 'tests'")


def test_parse_call_based_tests():
    assert C.parse_tests({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}) == [
        C.CallCase("add", (1, 2), 3), C.CallCase("add", (3, 4), 7)]
    assert C.parse_tests('{"fn_name": "neg", "inputs": [5], "outputs": [[-5]]}') == [C.CallCase("neg", (5,), [-5])]


ADD_CALLS = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [0.5, 0.25]], "outputs": [3, 7, 0.75]}


def test_call_based_tests(monkeypatch):
    """APPS / TACO ``fn_name`` tests: the function's return values compared as values, in the sandbox."""
    monkeypatch.setattr(C, "CASE_TIMEOUT_S", 2.0)
    completions = [
        fenced("def add(a, b):\n    return a + b"),  # right
        fenced("def add(a, b):\n    return a * b"),  # wrong values
        fenced("print('3\\n7\\n0.75 pass')\ndef add(a, b):\n    print('garbage', a)\n    return a + b"),  # prints: fine
        fenced("def add(a, b):\n    print(a + b)"),  # prints the answers, returns None
        fenced("def add(a, b):\n    while True:\n        pass"),  # hangs: stopped at the deadline
        fenced("class Solution:\n    def add(self, a, b):\n        return a + b"),  # LeetCode style
        fenced("def plus(a, b):\n    return a + b"),  # no such function
        fenced("import os\ndef add(a, b):\n    os._exit(0)"),  # exits before the verdict
        fenced("def add(a, b):\n    return (a + b,)"),  # the list [3] is not 3
        fenced("def add(a, b):\n    return a + b"),  # right, against APPS's outputs wrapped in lists
    ]
    rows = [{"tests": ADD_CALLS}] * (len(completions) - 1)
    rows.append({"tests": {**ADD_CALLS, "outputs": [[out] for out in ADD_CALLS["outputs"]]}})
    assert C.code_tests(completions, [""] * len(completions), rows=rows) == [1, 0, 1, 0, 0, 1, 0, 0, 0, 1]


def test_stdin_stdout_tests_in_the_apps_layout(monkeypatch):
    monkeypatch.setattr(C, "CASE_TIMEOUT_S", 2.0)
    tests = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    completions = [fenced("a, b = map(int, input().split())\nprint(a + b)"),  # passes
                   fenced("a, b = map(int, input().split())\nprint(a * b)"),  # fails
                   fenced("print('garbage')"),  # prints garbage
                   fenced("import time\ntime.sleep(60)")]  # hangs
    rows = [{"tests": tests}] * 4
    assert C.code_tests(completions, [""] * 4, rows=rows) == [1.0, 0.0, 0.0, 0.0]


def test_outputs_match_ignores_trailing_whitespace_only():
    assert C.outputs_match("3 \n4\n\n", "3\n4")
    assert C.outputs_match("a\r\nb\r\n", "a\nb\n")
    assert not C.outputs_match("3\n4\n", "3\n5\n")
    assert not C.outputs_match(" 3\n", "3\n")  # leading whitespace counts
    assert not C.outputs_match("3\n\n4\n", "3\n4\n")  # inner blank lines count


def test_io_tests():
    completions = [
        fenced("a, b = map(int, input().split())\nprint(a + b)"),  # right
        fenced("a, b = map(int, input().split())\nprint(a - b)"),  # wrong answer
        fenced("print(3)"),  # right on the first case only
        fenced("raise SystemExit(1)"),  # right output never printed, non-zero exit
        "no code at all",
    ]
    rows = [{"tests": ADD_IO} for _ in completions]
    assert get_verifier("code")(completions, [""] * 5, rows=rows) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_assert_tests():
    completions = [fenced("def add(a, b):\n    return a + b"), fenced("def add(a, b):\n    return a * b"),
                   fenced("def add(a, b):\n    return a + b\nimport sys; sys.exit(0)"),  # exits before the asserts
                   fenced("import os\nos._exit(0)"),
                   fenced("def add(a, b):\n    return a + b\nprint('noise')")]  # its own output is fine
    rows = [{"tests": ADD_ASSERTS}] * 5
    assert C.code_tests(completions, [""] * 5, rows=rows) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_hostile_programs_score_zero_and_stay_contained(monkeypatch):
    monkeypatch.setattr(C, "CASE_TIMEOUT_S", 1.0)
    completions = [fenced("while True:\n    pass"), fenced("print(open('/etc/shadow').read())"),
                   fenced("import os\nwhile True:\n    os.fork()"), fenced("x = ' ' * 10 ** 10"),
                   fenced("print(3)")]
    rows = [{"tests": [{"stdin": "", "stdout": "3"}]}] * 5
    assert C.code_tests(completions, [""] * 5, rows=rows) == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_row_problems_are_per_sample_errors_in_the_reward_pool():
    good = fenced("print(int(input()) * 2)")
    rows = [{"tests": [{"stdin": "2\n", "stdout": "4\n"}]}, {"prompt": "no tests"}, {"tests": "[]"}]
    with RewardPool("code", workers=0, error_reward=-1.0) as pool:
        res = pool.score([good, good, good], ["", "", ""], prompts=["p0", "p1", "p2"], rows=rows)
    assert res.rewards == [1.0, -1.0, -1.0]
    assert [e.index for e in res.errors] == [1, 2]
    assert "the dataset row has no 'tests' field (it has ['prompt'])" in res.errors[0].message
    assert "verifier 'code': field 'tests': no tests in []" in res.errors[1].message


def test_code_verifier_in_a_process_worker():
    rows = [{"tests": ADD_ASSERTS}, {"tests": ADD_IO}]
    completions = [fenced("def add(a, b):\n    return a + b"), fenced("print(sum(map(int, input().split())))")]
    with RewardPool("code", workers=1, timeout_s=60.0) as pool:
        res = pool.score(completions, ["", ""], rows=rows)
    assert res.rewards == [1.0, 1.0] and res.errors == []


def test_without_rows_the_error_says_what_is_missing():
    with pytest.raises(ValueError, match=r"verifier 'code' scores each completion against its dataset row's 'tests' "
                                         r"field, but no rows were passed"):
        get_verifier("code")(["print(1)"], [""])


def test_the_catalogue_names_the_field_the_code_verifier_reads():
    """`flowrl check` refuses datasets without it (E622) from the catalogue's record of what it reads."""
    from flowrl.catalog.ops import VERIFIER_COSTS

    assert VERIFIER_COSTS["code"].row_fields == (C.TESTS_FIELD,)
