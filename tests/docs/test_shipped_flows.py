"""Every shipped flow runs: each flows/*.flow trains one step on this machine (a fresh local Ray
instance with logical GPUs, the flow's real engines), or is refused before anything starts by the
rule that says why this machine cannot hold it; every stdlib/*.flow is run by one of them or by a
test that runs it. Nothing in between (issue 9: what `check` accepts, `run` executes).

The refusal today is the host-memory check of a local instance
(:func:`flowrl.runtime.placement.check_host_memory`): ``flows/grpo_auto.flow`` plans 64 logical
GPUs (64 vLLM replicas and two megatron engines' ranks colocated on them), more memory than a small
machine has. Which flows it refuses is
computed here from the same rule and this machine's available memory, so on a machine that can hold
a plan the flow must train its step instead.

The real runs are marked ``long`` (``make test-long``): one to fifteen minutes each on 2 cores
(the 8-GPU schedules start 8-16 engine processes). Run directories go to a fresh work directory
holding copies of `flows/`, `stdlib/` and `data/`; the warm-start cache is the user's (as
``make run`` uses it).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOWS = sorted(p.name for p in (ROOT / "flows").glob("*.flow"))
STDLIB = sorted(p.stem for p in (ROOT / "stdlib").glob("*.flow"))

RUN_BY_TESTS = {"tests/algos/test_flows_run.py": "ALGOS"}
"""Tests that run stdlib flows no shipped flow imports -> the constant naming those stdlib modules
(``import stdlib.<name>`` in the flow each writes and trains)."""

REFUSED = re.compile(r"host memory: the plan's engines need [\d.]+ [GM]B of this machine's memory on a local "
                     r"Ray instance \(.*\), but it has [\d.]+ [GM]B available; nothing was started\. hint: run it "
                     r"on a Ray cluster \(RAY_ADDRESS=ADDRESS or `flowrl run --ray ADDRESS`\), or declare a "
                     r"smaller cluster")


def imported_stdlib(text: str) -> set[str]:
    return set(re.findall(r"^import\s+stdlib\.(\w+)", text, flags=re.M))


def stdlib_run_by_tests() -> dict[str, str]:
    """stdlib module -> the test that runs it (read from the test's constant, not by importing it)."""
    found = {}
    for test, constant in RUN_BY_TESTS.items():
        tree = ast.parse((ROOT / test).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == constant for t in node.targets):
                for name in ast.literal_eval(node.value):
                    found[name] = test
    return found


def test_every_stdlib_flow_is_run_by_a_shipped_flow_or_a_test():
    by_flows = {name: f"flows/{flow}" for flow in FLOWS
                for name in imported_stdlib((ROOT / "flows" / flow).read_text())}
    by_tests = stdlib_run_by_tests()
    assert set(by_tests) <= set(STDLIB), "a test names a stdlib flow that does not exist"
    never = [s for s in STDLIB if s not in by_flows and s not in by_tests]
    assert not never, f"stdlib flows no shipped flow or test runs: {never}"
    # the test runs what it names: each module is imported into the flow it writes
    text = (ROOT / "tests/algos/test_flows_run.py").read_text()
    assert 'f"import stdlib.{m} as {m}_algo' in text and "for algo in ALGOS" in text


def run_in_process(argv: list[str]) -> tuple[int, str]:
    from flowrl.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue()[-4000:] + out.getvalue()[-1000:]


def refused_here(flow: Path) -> tuple[bool, float, float | None]:
    """Whether the host-memory rule refuses ``flow`` on this machine now: (refused, need GB, available GB)."""
    from flowrl.launch import build_plan
    from flowrl.runtime.placement import available_memory_gb, host_memory_need

    need = sum(ranks * gb for _k, ranks, gb in host_memory_need(build_plan(str(flow))))
    available = available_memory_gb()
    return available is not None and need > available, need, available


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("flow", FLOWS)
def test_shipped_flow_trains_one_step_or_is_refused_with_the_reason(flow, tmp_path, monkeypatch):
    pytest.importorskip("ray")
    work = tmp_path / "work"
    for name in ("flows", "stdlib", "data"):
        shutil.copytree(ROOT / name, work / name)
    monkeypatch.chdir(work)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # this machine: a local Ray instance of the run's own
    monkeypatch.setenv("FLOWRL_PROFILE", str(tmp_path / "profile.json"))  # the default cpu figures, never the user's
    refused, need, available = refused_here(work / "flows" / flow)
    t0 = time.monotonic()
    code, output = run_in_process(["run", f"flows/{flow}", "--steps", "1", "--out", "run"])
    wall = time.monotonic() - t0
    have = "unknown" if available is None else f"{available:.1f} GB"
    print(f"{flow}: exit {code} in {wall:.1f} s (engines need {need:.1f} GB, {have} available)")
    if refused:
        assert code == 1 and REFUSED.search(output), output
        assert wall < 60, f"refused after {wall:.0f} s: before models or engines start"  # deadline
        assert not (work / "run" / "metrics.jsonl").exists()
        return
    assert code == 0, output
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any(r.get("step") == 1 for r in rows), rows
