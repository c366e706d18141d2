"""check_platform reads every record with platforms: ops and resources, losses, schedule statements
and ``repeat`` loops (E444 where each is written, quoting the record's ``why``).

Every shipped loss and statement runs on every platform, so these tests give one record a platform
it does not run on, as a record could say, and check that ``check`` refuses it there and only there.
"""

from __future__ import annotations

import typing
from dataclasses import replace

import pytest

from flowrl.catalog.losses import LOSSES
from flowrl.catalog.platforms import PLATFORMS
from flowrl.catalog.schedule import SCHED_CALLS, STATEMENTS
from flowrl.catalog.spec import unsupported
from flowrl.compiler.passes.check_platform import STATEMENT_OF
from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError
from flowrl.syntax import ast

FLOW = """model m = tiny()
dataset d = jsonl("data/arith/train.jsonl")
reward r = verifier("exact")
flow main() {
  x = generate(m, sample(d), n = 4, max_tokens = 8)
  update(m, x, group_advantage(r(x), group = 4), logprobs(m, x), loss = ppo_clip(0.2))
}
schedule main on cluster(gpus_per_node = 2) {
  staleness 2
  partial_rollout(over_provision = 1.5)
}
"""

LOOP = """model m = tiny()
dataset d = jsonl("data/arith/train.jsonl")
reward r = verifier("exact")
flow main() {
  x = generate(m, sample(d), n = 4, max_tokens = 8)
  repeat 2 {
    x = generate(m, x, n = 4, max_tokens = 8)
  }
  update(m, x, group_advantage(r(x), group = 4), logprobs(m, x))
}
"""


def _only_on_gpus(record):
    return replace(record, platforms={**dict.fromkeys(PLATFORMS, None),
                                      "cpu": unsupported("a reason the record gives, and what to use instead"),
                                      "cuda": record.support("cuda"), "rocm": record.support("rocm")})


def _e444(text: str) -> list:
    with pytest.raises(FlowError) as info:
        compile_text(text, "doc.flow", until="check_platform")
    return [d for d in info.value.diagnostics if d.code == "E444"]


def test_every_shipped_loss_and_statement_runs_everywhere():
    for record in [*LOSSES.values(), *STATEMENTS.values()]:
        assert all(record.support(p).ok for p in PLATFORMS), record.name


def test_a_loss_that_does_not_run_on_the_platform_is_refused_at_the_loss(monkeypatch):
    monkeypatch.setitem(LOSSES, "ppo_clip", _only_on_gpus(LOSSES["ppo_clip"]))
    (d,) = _e444(FLOW)
    assert d.message.startswith("loss `ppo_clip(...)` of `update")
    assert "does not run on cpu" in d.message and "`ppo_clip` runs on cuda, rocm only" in d.message
    column = FLOW.splitlines()[5].index("ppo_clip(") + 1
    assert (d.span.line, d.span.column) == (6, column) and d.hint.startswith("a reason the record gives")


@pytest.mark.parametrize("name, line", [("staleness", 9), ("partial_rollout", 10)])
def test_a_statement_that_does_not_run_on_the_platform_is_refused_at_the_statement(monkeypatch, name, line):
    monkeypatch.setitem(STATEMENTS, name, _only_on_gpus(STATEMENTS[name]))
    (d,) = _e444(FLOW)
    assert d.message.startswith(f"schedule statement `{name}` does not run on cpu") and d.span.line == line


def test_a_repeat_loop_that_does_not_run_on_the_platform_is_refused_at_the_loop(monkeypatch):
    compile_text(LOOP, "doc.flow", until="check_platform")  # accepted as shipped
    monkeypatch.setitem(STATEMENTS, "repeat", _only_on_gpus(STATEMENTS["repeat"]))
    (d,) = _e444(LOOP)
    assert d.message.startswith("a `repeat` loop does not run on cpu") and d.span.line == 6


def test_on_a_platform_the_record_runs_on_nothing_is_refused(monkeypatch):
    monkeypatch.setitem(LOSSES, "ppo_clip", _only_on_gpus(LOSSES["ppo_clip"]))
    compile_text(FLOW.replace("gpus_per_node = 2)", 'gpus_per_node = 2, gpu = "H100")'), "doc.flow",
                 until="check_platform")


def test_every_schedule_statement_has_a_record():
    """Each statement type of the AST names a record (a layout is its engine's record; a call
    statement the record of the name it calls), and every record is a statement someone can write."""
    statement_types = set(typing.get_args(ast.SchedStmt)) - {ast.Layout, ast.SchedCall}
    assert set(STATEMENT_OF) == statement_types
    named = set(STATEMENT_OF.values()) | set(SCHED_CALLS) | {"repeat"}
    assert named == set(STATEMENTS)
