"""Golden set of infeasible schedules: each ``infeasible/NAME.flow`` fails with exactly the
diagnostics in ``NAME.expected`` (rendered as ``flowrl check`` prints them).

Every schedule-feasibility code (E422-E437, E439-E441, E443) has at least one program here, each message
gives its numbers and points at a schedule line. Regenerate with
``FLOWRL_REGEN=1 pytest tests/schedule`` and read the diff as a user would.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file
from flowrl.diagnostics import FlowError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES = sorted((HERE / "infeasible").glob("*.flow"))
REGEN = os.environ.get("FLOWRL_REGEN") == "1"
FEASIBILITY_CODES = {f"E{n}" for n in (*range(422, 438), 439, 440, 441, 443)}
"""E438 (a sampling option the rollout engine refuses) points at the `generate` in the flow: tests/golden/invalid.
E442 (a train engine's ranks forked on one node) is gone: its ranks are Ray actors on their own nodes."""
NO_PROGRAM = {"E441": "no engine of the catalogue limits a layout on a platform today (tensor parallelism "
                      "on CPU was the last: vLLM's and SGLang's run); tests/schedule/test_catalog_engines.py "
                      "checks it with a record that does"}
"""Feasibility codes no shipped record can trigger, and why."""


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def _diagnostics(path: Path) -> FlowError:
    with pytest.raises(FlowError) as info:
        check_file(path.relative_to(REPO).as_posix())
    return info.value


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_infeasible_schedule_fails_with_its_exact_message(path: Path):
    rendered = _diagnostics(path).render()
    expected = path.with_suffix(".expected")
    if REGEN:
        expected.write_text(rendered, encoding="utf-8")
        return
    assert expected.exists(), f"missing {expected.name}: run with FLOWRL_REGEN=1"
    assert rendered == expected.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_infeasible_schedule_points_at_a_schedule_line(path: Path):
    """Each diagnostic sits inside the schedule block, names its code's range, and gives a hint."""
    text = path.read_text().splitlines()
    start = next(i for i, line in enumerate(text, 1) if line.startswith("schedule "))
    for d in _diagnostics(path).diagnostics:
        assert d.code in FEASIBILITY_CODES, d
        assert d.span.line >= start, d
        assert d.hint, d


def test_the_set_covers_every_feasibility_code():
    codes = set()
    for exp in (HERE / "infeasible").glob("*.expected"):
        codes |= set(re.findall(r"error\[(E\d{3})\]", exp.read_text()))
    assert FEASIBILITY_CODES - set(NO_PROGRAM) <= codes, sorted(FEASIBILITY_CODES - set(NO_PROGRAM) - codes)
    assert len(CASES) >= 20


def test_file_name_is_its_first_code():
    for path in CASES:
        m = re.match(r"e(\d{3})_", path.stem)
        if m:
            codes = [d.code for d in _diagnostics(path).diagnostics]
            assert f"E{m.group(1)}" in codes, (path.name, codes)


def test_messages_carry_numbers():
    """Feasibility errors say how much: every message has a digit."""
    for path in CASES:
        for d in _diagnostics(path).diagnostics:
            assert re.search(r"\d", d.message), d.message
