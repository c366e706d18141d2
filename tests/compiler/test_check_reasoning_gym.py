"""`flowrl check` of reasoning_gym(...) datasets and reasoning_gym_score(): the task against the package's
registry (E670), its config against the task's config class (E671), the package missing (E672), a
config value that is a name (E207), a file dataset scored without reasoning_gym's metadata (E622),
each at the position of what is wrong; an accepted declaration lowers to the options the runtime reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from flowrl.compiler.lower import lower  # noqa: E402
from flowrl.compiler.pipeline import check_file, compile_file  # noqa: E402
from flowrl.diagnostics import FlowError  # noqa: E402

BODY = """reward r = reasoning_gym_score()

flow main() {
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 4)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}
"""


def _flow(tmp_path: Path, dataset: str, body: str = BODY) -> Path:
    path = tmp_path / "rg.flow"
    path.write_text(f'model policy = tiny(task = "rg_chain_sum")\ndataset d = {dataset}\n{body}')
    return path


def _errors(path: Path) -> list:
    with pytest.raises(FlowError) as e:
        check_file(str(path))
    return [(d.code, d.span.line, d.span.column, d.message, d.hint or "") for d in e.value.diagnostics if d.is_error]


def test_an_unknown_task_points_at_its_name_with_the_nearest_ones(tmp_path):
    (code, line, col, message, hint), = _errors(_flow(tmp_path, 'reasoning_gym("chain-sum", size = 10)'))
    assert (code, line, col) == ("E670", 2, 27)
    assert "no task 'chain-sum'" in message and "`chain_sum`" in hint


def test_config_options_are_checked_against_the_tasks_config_class(tmp_path):
    errors = _errors(_flow(tmp_path, 'reasoning_gym("chain_sum", size = 10, min_term = 2, max_terms = "two")'))
    assert [(c, line, col) for c, line, col, *_ in errors] == [("E671", 2, 51), ("E671", 2, 65)]
    assert "did you mean `min_terms`?" in errors[0][4] and "takes int values" in errors[1][3]
    # what the task's own validate() refuses, with its message
    (code, *_, message, hint), = _errors(_flow(tmp_path, 'reasoning_gym("chain_sum", min_terms = 3, max_terms = 2)'))
    assert code == "E671" and "max_terms must be >= min_terms" in message


def test_a_config_value_must_be_a_constant(tmp_path):
    (code, line, col, message, hint), = _errors(_flow(tmp_path, 'reasoning_gym("chain_sum", operators = [plus])'))
    assert code in ("E101", "E207")  # an unknown name is refused by name resolution first


def test_sizes_are_checked_as_options(tmp_path):
    (code, *_), = _errors(_flow(tmp_path, 'reasoning_gym("chain_sum", size = 0)'))
    assert code == "E208"


def test_the_package_missing_is_refused_at_check(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    errors = _errors(_flow(tmp_path, 'reasoning_gym("chain_sum", size = 10)'))
    assert {c for c, *_ in errors} == {"E672"}
    assert all("pip install" in hint for *_, hint in errors)


def test_a_file_dataset_without_metadata_is_refused_for_reasoning_gym_score(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    (code, line, _, message, _), = _errors(_flow(tmp_path, 'jsonl("d.jsonl")'))
    assert (code, line) == ("E622", 3) and "`reasoning_gym_score()` reads each row's `metadata` field" in message


def test_an_accepted_declaration_lowers_to_what_the_runtime_reads(tmp_path):
    path = _flow(tmp_path, 'reasoning_gym("chain_sum", size = 40, seed = 2, eval_size = 5, max_terms = 2, '
                           'min_digits = 1, max_digits = 2)')
    check_file(str(path))
    (d,) = lower(compile_file(str(path)).graph).datasets
    assert (d.format, d.path, d.prompt, d.answer) == ("reasoning_gym", "", "question", "answer")
    assert d.options == {"task": "chain_sum", "size": 40, "seed": 2, "eval_size": 5,
                         "config": {"max_terms": 2, "min_digits": 1, "max_digits": 2}}
    from flowrl.runtime.data import read_dataset

    ds = read_dataset(d)
    assert len(ds.rows) == 40 and len(ds.eval_rows) == 5
    assert not {r["question"] for r in ds.rows} & {r["question"] for r in ds.eval_rows}
