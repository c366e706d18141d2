"""`flowrl plan` shows which engine runs on which GPUs and how; `--explain`, `--json`; `flowrl profile`."""

from __future__ import annotations

import json

import pytest
from schedule_flows import REPO

from flowrl.cli import main
from flowrl.plan import ExecutionPlan


@pytest.fixture(autouse=True)
def _root(monkeypatch):
    monkeypatch.chdir(REPO)


def plan_text(capsys, *args) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_plan_shows_engines_gpus_grid_sync_staleness_and_estimate(capsys):
    out = plan_text(capsys, "flows/grpo_disaggregated.flow")
    assert "engines:\n  engine " in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  policy.")}
    assert rows["policy.rollout"][1:5] == ["vllm(tp=1,", "dp=4)", "gen", "0-3"]
    assert rows["policy.train"][1:4] == ["fsdp(dp=4)", "train", "4-7"]
    assert "GPU grid (A = policy.train, B = policy.rollout, C = grpo.ref.train):" in out
    assert "  node 0   [B ] [B ] [B ] [B ] [AC] [AC] [AC] [AC]" in out
    assert "  gen    4 (0-3)  0      STRICT_PACK   policy.rollout" in out
    assert "policy: nccl after `grpo.update` every 1 step(s), buckets of 512.0 MB, checksummed" in out
    assert "route: intra-node over gloo; packing and sending overlap the next generation" in out
    assert "staleness: 2 step(s) in flight" in out
    assert "estimated step (cpu:" in out and "bubble" in out and "memory per GPU, pool gen" in out
    assert "  bounds: busiest pool" in out


def test_plan_of_the_default_flow_keeps_its_summary_lines(capsys):
    out = plan_text(capsys, "flows/arith_grpo.flow")
    assert "staleness 1 (synchronous)" in out and "inplace after `grpo.update` every 1 step(s)" in out
    assert "  node 0   [AB]" in out  # kl = 0: no reference engine (the elide_logprobs pass)


def test_explain_shows_the_search(capsys):
    out = plan_text(capsys, "flows/grpo_auto.flow", "--explain")
    assert "chosen by `schedule auto`" in out
    assert "schedule auto: " in out and "candidate(s) considered" in out
    assert "  winner: " in out and "    as a schedule:\n      schedule main on cluster(nodes = 8" in out
    assert "  runners-up:\n    2. " in out
    assert "  rejected:" in out and "e.g. " in out


def test_explain_of_a_hand_written_schedule_says_so(capsys):
    assert "search: none: the schedule was written by hand" in plan_text(capsys, "flows/arith_grpo.flow",
                                                                         "--explain")


def test_json_holds_everything_and_round_trips(capsys):
    text = plan_text(capsys, "flows/grpo_auto.flow", "--json")
    plan = ExecutionPlan.from_json(text)
    data = json.loads(text)
    assert data["auto"] is True and data["search"]["winner"]["rank"] == 1
    assert {"step_s", "breakdown", "memory", "bounds"} <= set(data["estimate"])
    assert plan.pipeline.in_flight == plan.staleness
    assert json.loads(plan.to_json()) == data


def test_json_and_explain_do_not_mix(capsys):
    assert main(["plan", "flows/grpo_auto.flow", "--json", "--explain"]) == 2
    assert "--json already holds the search report" in capsys.readouterr().err


def test_profile_writes_a_profile_that_plan_uses(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    out = tmp_path / "profile.json"
    assert main(["profile", "-o", str(out), "--size", "128", "--copy-mb", "8", "--repeat", "1",
                 "--no-allreduce"]) == 0
    said = capsys.readouterr().out
    assert "GFLOP/s" in said and str(out) in said
    prof = json.loads(out.read_text())
    assert prof["kind"] == "cpu" and prof["tflops"] > 0 and prof["hbm_gbs"] > 0 and prof["memory_total_gb"] > 0
    monkeypatch.setenv("FLOWRL_PROFILE", str(out))
    assert "measured by `flowrl profile`" in plan_text(capsys, "flows/arith_grpo.flow")


def test_profile_measures_a_gloo_allreduce(capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "profile.json"
    assert main(["profile", "-o", str(out), "--size", "64", "--copy-mb", "4", "--allreduce-mb", "2",
                 "--repeat", "1"]) == 0
    prof = json.loads(out.read_text())
    assert prof["nvlink_gbs"] > 0 and prof["nvlink_gbs"] == prof["ib_gbs"]


def test_profile_rejects_bad_sizes(capsys):
    assert main(["profile", "--size", "0"]) == 2
    assert "argument --size: 0 is less than 1; give an integer >= 1" in capsys.readouterr().err
