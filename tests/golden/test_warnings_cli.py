"""Warnings reach the user: ``flowrl check`` prints them and exits 0; ``flowrl plan`` (and so
``flowrl run``, which plans the same way) prints them before its output; errors still fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.cli import main

REPO = Path(__file__).resolve().parents[2]
WARNED = "tests/golden/warnings/w001_unread_binding.flow"


@pytest.fixture(autouse=True)
def _at_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_check_prints_warnings_and_exits_zero(capsys):
    assert main(["check", WARNED, "flows/arith_grpo.flow"]) == 0
    out, err = capsys.readouterr()
    assert f"ok: {WARNED} (1 flow, 1 warning)" in out
    assert "ok: flows/arith_grpo.flow (1 flow)\n" in out
    assert err.count("warning[W001]") == 1 and "`ref_lp` is never read" in err
    assert "error" not in err


def test_check_quiet_still_prints_warnings(capsys):
    assert main(["check", "-q", WARNED]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "warning[W001]" in err


def test_errors_fail_the_check_and_count_only_errors(tmp_path, capsys):
    bad = tmp_path / "bad.flow"
    bad.write_text('model policy = tiny(task = "arith")\n'
                   f'dataset arith = jsonl("{REPO}/data/arith/train.jsonl")\n'
                   "flow main() {\n  r = generate(policy, sample(arith))\n}\n"
                   "schedule main on cluster(gpus_per_node = 2) {\n  staleness 0\n}\n")
    assert main(["check", str(bad)]) == 1
    _, err = capsys.readouterr()
    assert "warning[W001]" in err and "error[E408]" in err
    assert "flowrl: 1 error in 1 of 1 file" in err


def test_plan_prints_warnings(capsys):
    assert main(["plan", WARNED]) == 0
    out, err = capsys.readouterr()
    assert "warning[W001]" in err and "plan for flow `main`" in out
    engines = out.split("engines:")[1].split("\n\n")[0]
    assert "policy.train" in engines and "ref" not in engines  # the removed reference model has no engine
    assert "ref_lp" not in out.split("step (in order):")[1]
