"""Bad data rows (issue 14, item 9): an empty prompt, a missing field, bytes that are not UTF-8,
a prompt longer than the rollout engine's context. ``bad_rows = "error"`` (the default) refuses
the dataset naming the file and row; ``bad_rows = "skip"`` leaves them out and counts them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.catalog.ops import OpKind
from flowrl.data.datasets import DatasetError, check_head, load_rows
from flowrl.plan import DatasetPlan
from flowrl.runtime.data import _length_check, prompt_limit, read_dataset

GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _row(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.fixture()
def messy(tmp_path) -> Path:
    """Line 1 good; 2 empty prompt; 3 missing answer; 4 not UTF-8; 5 not JSON; 6 blank; 7 good; 8 long."""
    return _write(tmp_path / "train.jsonl", [
        _row(GOOD[0]),
        _row({"prompt": "  ", "answer": "0"}),
        _row({"prompt": "3+3="}),
        b'{"prompt": "caf\xe9", "answer": "1"}',
        b'{"prompt": "4+4=", "answer": ',
        b"",
        _row(GOOD[1]),
        _row({"prompt": "9" * 50, "answer": "9"}),
    ])


def _too_long(row: dict) -> str | None:
    return "the prompt has 50 tokens, more than 20" if len(row["prompt"]) > 20 else None


def test_skip_leaves_out_and_reports_every_bad_row_by_file_and_line(messy):
    skipped: list[str] = []
    rows = load_rows(messy, bad_rows="skip", check=_too_long, skipped=skipped)
    assert rows == GOOD
    assert [m.split(": ", 1)[0] for m in skipped] == [f"{messy}:{n}" for n in (2, 3, 4, 5, 8)]
    assert "is empty" in skipped[0] and "missing field 'answer'" in skipped[1]
    assert "not UTF-8" in skipped[2] and "invalid JSON" in skipped[3] and "50 tokens" in skipped[4]


@pytest.mark.parametrize("line,reason", [
    (_row({"prompt": "", "answer": "0"}), "field 'prompt' is empty"),
    (_row({"question": "1+1=", "answer": "2"}), "missing field 'prompt'"),
    (b'{"prompt": "\xff\xfe", "answer": "1"}', "not UTF-8 text"),
    (_row({"prompt": "9" * 50, "answer": "9"}), "the prompt has 50 tokens"),
])
def test_error_refuses_naming_file_row_and_the_skip_option(tmp_path, line, reason):
    path = _write(tmp_path / "d.jsonl", [_row(GOOD[0]), _row(GOOD[1]), line])
    with pytest.raises(DatasetError) as e:
        load_rows(path, check=_too_long)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and reason in msg and 'bad_rows = "skip"' in msg


def test_a_file_of_bad_rows_only_is_refused_even_when_skipping(tmp_path):
    path = _write(tmp_path / "d.jsonl", [_row({"prompt": "", "answer": "0"})])
    skipped: list[str] = []
    with pytest.raises(DatasetError, match="every row is bad"):
        load_rows(path, bad_rows="skip", skipped=skipped)
    assert len(skipped) == 1


def test_check_head_follows_the_policy(messy, tmp_path):
    """``flowrl check`` reads the head: a bad first line is refused, or passed over when skipping."""
    path = _write(tmp_path / "head.jsonl", [b'{"prompt": "\xe9"}', _row(GOOD[0])])
    with pytest.raises(DatasetError, match=r"head.jsonl:1: not UTF-8 .*bad_rows = \"skip\""):
        check_head(path)
    assert check_head(path, bad_rows="skip") == "1+1="


def test_parquet_rows_follow_the_policy(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", None, "", "2+2="], "answer": ["2", "0", "0", "4"]}), path)
    skipped: list[str] = []
    assert load_rows(path, bad_rows="skip", skipped=skipped) == GOOD
    assert [m.split(": ", 1)[0] for m in skipped] == [f"{path}:2", f"{path}:3"]
    with pytest.raises(DatasetError, match=r"d.parquet:2: field 'prompt' must be a string, got NoneType"):
        load_rows(path)


# ---- the runtime's data layer: prompts too long for the rollout engine ---------------------------


class _CharTokenizer:
    """One token per character plus a BOS (what :func:`flowrl.data.chat.encode` asks of a tokenizer)."""
    bos_token = "<s>"
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + [ord(c) for c in text])


def _op(kind, model, max_tokens=0):
    return SimpleNamespace(kind=kind, model=model, options={"max_tokens": max_tokens})


def test_prompt_limit_is_the_tightest_generate_context_less_its_max_tokens():
    plan = SimpleNamespace(ops=(_op(OpKind.SAMPLE, None), _op(OpKind.GENERATE, "policy", 16),
                                _op(OpKind.GENERATE, "policy", 24)))
    assert prompt_limit(plan, {"policy": 64}) == 40
    assert prompt_limit(SimpleNamespace(ops=(_op(OpKind.SAMPLE, None),)), {"policy": 64}) is None


def test_runtime_reads_a_dataset_skipping_prompts_too_long_for_the_engine(messy):
    d = DatasetPlan("prompts", "jsonl", str(messy), "prompt", "answer", "", "main.flow:2:1", bad_rows="skip")
    skipped: list[str] = []
    ds = read_dataset(d, _length_check(d, _CharTokenizer(), limit=20), skipped)
    assert ds.rows == GOOD and len(skipped) == 5
    assert skipped[-1].startswith(f"{messy}:8: the prompt has 51 tokens, more than the 20")
    strict = DatasetPlan("prompts", "jsonl", str(messy), "prompt", "answer", "", "main.flow:2:1")
    with pytest.raises(DatasetError, match=r"train.jsonl:2: field 'prompt' is empty"):
        read_dataset(strict, None, [])


FLOW = """model policy = tiny(task = "arith")
dataset arith = jsonl("train.jsonl", bad_rows = %s)
reward exact = verifier("math")

flow main() {
  b        = sample(arith, size = 2)
  rollouts = generate(policy, b, n = 2, max_tokens = 8)
  scores   = exact(rollouts)
  old_lp   = logprobs(policy, rollouts)
  adv      = group_advantage(scores, group = 2)
  update(policy, rollouts, adv, old_lp, loss = ppo_clip(0.2))
}
"""


def test_bad_rows_option_is_checked_when_compiled_and_reaches_the_plan(tmp_path):
    from flowrl.compiler.lower import lower
    from flowrl.compiler.pipeline import compile_file
    from flowrl.diagnostics import FlowError

    _write(tmp_path / "train.jsonl", [_row({"prompt": "", "answer": "0"}), _row(GOOD[0]), _row(GOOD[1])])
    path = tmp_path / "main.flow"
    path.write_text(FLOW % '"ignore"')
    with pytest.raises(FlowError) as e:
        compile_file(path)
    assert "main.flow:2:" in str(e.value) and "ignore" in str(e.value)
    path.write_text(FLOW % '"error"')  # the first row is bad: `flowrl check` refuses the file
    refused = r"main.flow:2:23: .*`train.jsonl`, line 1, .*field 'prompt' is empty(.|\n)*bad_rows = \"skip\""
    with pytest.raises(FlowError, match=refused):
        compile_file(path)
    path.write_text(FLOW % '"skip"')
    plan = lower(compile_file(path).graph)
    assert plan.datasets[0].bad_rows == "skip"
