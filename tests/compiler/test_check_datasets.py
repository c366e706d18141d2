"""`flowrl check` on hf_dataset, templates, system prompts, mixtures and large files (check_datasets):
each mistake is reported with its code at the position the flow wrote it, reading the data's head only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowrl.compiler.explain import describe_plan
from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import check_file, compile_file
from flowrl.diagnostics import FlowError

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

BODY = """
reward r = verifier("exact")
flow main() {
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 4)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}
"""


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def flow(tmp: Path, decls: str) -> Path:
    path = tmp / "f.flow"
    path.write_text('model policy = tiny(task = "arith")\n' + decls.strip() + "\n" + BODY)
    return path


def diagnostics(path: Path) -> list:
    old = os.getcwd()
    os.chdir("/")  # relative paths resolve against the flow file's folder, not the current directory
    try:
        check_file(str(path))
    except FlowError as e:
        return e.diagnostics
    finally:
        os.chdir(old)
    return []


def where(d) -> tuple[str, int, int]:
    return d.code, d.span.line, d.span.column


QA = [{"question": f"{i}+1?", "solution": str(i + 1)} for i in range(5)]


def test_a_template_over_the_rows_fields_checks_and_lowers(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", QA)
    f = flow(tmp_path, 'dataset d = jsonl("qa.jsonl", template = "Question: {question}\\nAnswer:", answer = "solution", '
                       'system = "Answer with a number.")')
    assert diagnostics(f) == []
    plan = lower(compile_file(str(f)).graph)
    (plan_d,) = plan.datasets
    assert (plan_d.template, plan_d.system, plan_d.chat_auto, plan_d.chat) == \
        ("Question: {question}\nAnswer:", "Answer with a number.", True, False)
    shown = describe_plan(plan, explain=True)
    assert "mean of the first 5 rows of `qa.jsonl`" in shown  # the prompts as the template writes them
    assert "d: jsonl qa.jsonl: prompts written by the template after a system prompt as rendered with the chat " \
           "template of `policy`'s tokenizer where it has one, else raw text" in shown


def test_an_unknown_slot_is_reported_at_the_slot(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", QA)
    f = flow(tmp_path, 'dataset d = jsonl("qa.jsonl", answer = "solution", template = "Q: {question} ({topic})")')
    [(code, message, span)] = [(d.code, d.message, d.span) for d in diagnostics(f)]
    line = f.read_text().splitlines()[1]
    assert (code, span.line, span.column) == ("E662", 2, line.index("{topic}") + 1)
    assert "reads field `topic`, which row 1 of" in message and "its fields: question, solution" in message
    # a field missing in a later one of the first rows: the same code, naming that row
    write_jsonl(tmp_path / "qa.jsonl", QA[:2] + [{"solution": "3"}] + QA[3:])
    f = flow(tmp_path, 'dataset d = jsonl("qa.jsonl", answer = "solution", template = "Q: {question}")')
    [d] = diagnostics(f)
    assert d.code == "E662" and "row 3 of `" in d.message and "qa.jsonl` lacks (its fields: solution)" in d.message


def test_a_malformed_template_is_e661(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", QA)
    f = flow(tmp_path, 'dataset d = jsonl("qa.jsonl", answer = "solution", template = "Q: {question")')
    [d] = diagnostics(f)
    assert d.code == "E661" and d.span.line == 2 and "expected '}'" in d.message


def test_a_parquet_template_is_checked_against_its_columns(tmp_path):
    pq.write_table(pa.table({"question": ["1+1?"], "solution": ["2"]}), tmp_path / "qa.parquet")
    ok = flow(tmp_path, 'dataset d = parquet("qa.parquet", answer = "solution", template = "Q: {question}")')
    assert diagnostics(ok) == []
    bad = flow(tmp_path, 'dataset d = parquet("qa.parquet", answer = "solution", template = "Q: {questoin}")')
    [d] = diagnostics(bad)
    assert d.code == "E662" and "(its columns: question, solution)" in d.message


def test_hf_dataset_splits_paths_and_fields(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"question": ["1+1?"], "solution": ["2"]}),
                          "test": datasets.Dataset.from_dict({"question": ["2+2?"], "solution": ["4"]})}
                         ).save_to_disk(str(tmp_path / "hf"))
    ok = flow(tmp_path, 'dataset d = hf_dataset("hf", split = "train", eval = "test", answer = "solution", '
                        'template = "Q: {question}")')
    assert diagnostics(ok) == []
    (plan_d,) = lower(compile_file(str(ok)).graph).datasets
    assert plan_d.path == str(tmp_path / "hf") and plan_d.options["eval"] == "test" and plan_d.eval_path == ""
    bad = flow(tmp_path, 'dataset d = hf_dataset("hf", split = "training", eval = "valid", answer = "solution", '
                         'prompt = "question")')
    found = sorted(where(d) for d in diagnostics(bad))
    line = bad.read_text().splitlines()[1]
    assert found == [("E663", 2, line.index('"training"') + 1), ("E663", 2, line.index('"valid"') + 1)]
    assert "its splits: train, test" in diagnostics(bad)[0].message
    missing = flow(tmp_path, 'dataset d = hf_dataset("nothere", answer = "solution", prompt = "question")')
    assert [where(d) for d in diagnostics(missing)] == [("E601", 2, 24)]
    field = flow(tmp_path, 'dataset d = hf_dataset("hf", answer = "answer", prompt = "question")')
    [d] = diagnostics(field)
    assert d.code == "E602" and "missing field 'answer'" in d.message


def test_mixtures_are_checked(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", QA)
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    head = ('dataset a = jsonl("a.jsonl", prompt = "question", answer = "solution")\n'
            'dataset b = jsonl("b.jsonl")\n')
    assert diagnostics(flow(tmp_path, head + "dataset d = mix(a, b, weights = [3, 1])")) == []
    neg = flow(tmp_path, head + "dataset d = mix(a, b, weights = [1, -0.5])")
    assert [where(d) for d in diagnostics(neg)] == [("E660", 4, 37)]
    zero = flow(tmp_path, head + "dataset d = mix(a, b, weights = [0, 0])")
    assert [d.code for d in diagnostics(zero)] == ["E660"]
    count = flow(tmp_path, head + "dataset d = mix(a, b, weights = [1])")
    assert [d.code for d in diagnostics(count)] == ["E220"]
    unknown = flow(tmp_path, head + "dataset d = mix(a, c)")
    assert [where(d) for d in diagnostics(unknown)] == [("E101", 4, 20)]
    # a mixture's parts are checked as any dataset: a chat part needs a model with a chat template
    chat = flow(tmp_path, head.replace('jsonl("b.jsonl")', 'jsonl("b.jsonl", chat = true)') + "dataset d = mix(a, b)")
    assert [d.code for d in diagnostics(chat)] == ["E610"]
    plan = lower(compile_file(str(flow(tmp_path, head + "dataset d = mix(a, b, weights = [3, 1])"))).graph)
    mixture = next(x for x in plan.datasets if x.id == "d")
    assert (mixture.format, mixture.parts, mixture.weights) == ("mix", ("a", "b"), (3.0, 1.0))


def test_check_reads_the_head_of_a_large_file_only(tmp_path):
    # good rows, then 32 MiB no JSON parser would accept: a check that read past its head would say so
    path = write_jsonl(tmp_path / "big.jsonl", QA * 20)
    with open(path, "ab") as out:
        out.write((b"\xff" * 1023 + b"\n") * (32 << 10))
    f = flow(tmp_path, 'dataset d = jsonl("big.jsonl", answer = "solution", template = "Q: {question}")')
    assert diagnostics(f) == []
