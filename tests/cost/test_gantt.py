"""Gantt charts: simulated and measured steps on the same rows, PNG, Chrome trace, `flowrl plan --gantt`."""

from __future__ import annotations

import json

import pytest
from cost_cases import STEP_OPS

from flowrl import gantt
from flowrl.cli import main
from flowrl.compiler import calibrate
from flowrl.cost import validate
from flowrl.cost.sim import simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def compiled(test_flow):
    _, spec, costs = calibrate.compile_spec(test_flow)
    return spec, gantt.rows_for(spec, costs)


def test_rows_are_engines_on_their_pool_then_cpu_work(compiled):
    spec, rows = compiled
    assert set(rows.order[:3]) == {"all · policy.rollout", "all · policy.train", "all · grpo.ref.train"}
    assert rows.order[3:] == ("driver", "reward")
    assert rows.gpu_rows == rows.order[:3]
    assert rows.row_of["grpo.update"] == rows.row_of["resync.policy"] == "all · policy.train"
    assert rows.row_of["grpo.ref_lp"] == "all · grpo.ref.train"
    assert rows.label_of["grpo.ref_lp"] == "logprobs" and rows.label_of["grpo.rollouts"] == "generate"


def test_sim_bars_cover_the_window_from_zero(compiled):
    spec, rows = compiled
    res = simulate(spec, steps=8, seed=0)
    bars = gantt.bars_from_sim(res, rows, count=3)
    assert sorted({b.step for b in bars}) == [res.warmup, res.warmup + 1, res.warmup + 2]
    assert len(bars) == 3 * len(spec.phases)
    assert min(b.start for b in bars) == pytest.approx(0.0)
    # staleness 1, one shared lane: the GPU rows never overlap themselves
    gpu = sorted((b.start, b.end) for b in bars if b.row in rows.gpu_rows)
    assert all(e0 <= s1 + 1e-9 for (_, e0), (s1, _) in zip(gpu, gpu[1:]))
    # driver ops are drawn just before their step's first GPU op, never at time 0 of a later step
    for step in {b.step for b in bars}:
        first_gpu = min(b.start for b in bars if b.step == step and b.row in rows.gpu_rows)
        assert all(b.end <= first_gpu + 1e-9 for b in bars if b.step == step and b.name == "grpo.prompt_batch")


def test_trace_bars_use_op_spans_only_and_the_same_rows(compiled, synthetic_run):
    _, rows = compiled
    _, _, events = validate.read_run(synthetic_run(steps=4))
    bars = gantt.bars_from_trace(events, rows, first=1, count=2)
    assert {b.step for b in bars} == {1, 2}
    # every op of the plan, nothing else (engine spans such as `train:policy`, the set-up `eval`)
    assert {b.name for b in bars} == {op for op, *_ in STEP_OPS if op in rows.row_of}
    assert {"grpo.rollouts", "grpo.update", "resync.policy"} <= {b.name for b in bars}
    upd = next(b for b in bars if b.name == "grpo.update" and b.step == 1)
    assert upd.row == "all · policy.train" and upd.end - upd.start == pytest.approx(0.2)
    assert min(b.start for b in bars) == pytest.approx(0.0)


def test_empty_window_says_which_steps_exist(compiled, synthetic_run):
    _, rows = compiled
    _, _, events = validate.read_run(synthetic_run(steps=3))
    with pytest.raises(gantt.GanttError, match=r"no bars for steps 5\.\.6; the source has steps 1\.\.3"):
        gantt.bars_from_trace(events, rows, first=5, count=2)


def test_busy_fraction_merges_overlaps():
    bars = [gantt.Bar("a", "x", 0, 0.0, 2.0), gantt.Bar("a", "x", 0, 1.0, 3.0), gantt.Bar("b", "y", 0, 3.0, 4.0)]
    assert gantt.busy_fraction(bars, "a") == pytest.approx(0.75)
    assert gantt.busy_fraction(bars, "b") == pytest.approx(0.25)


def test_plot_and_chrome_trace(compiled, tmp_path):
    spec, rows = compiled
    bars = gantt.bars_from_sim(simulate(spec, steps=6), rows, count=2)
    png = gantt.plot_gantt([("simulated", bars), ("again", bars)], tmp_path / "g.png", order=rows.order, title="t")
    assert png.read_bytes()[:8] == PNG_MAGIC
    doc = gantt.chrome_trace(bars)
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"]
    assert set(names) == {b.row for b in bars}
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(bars)
    assert sum(e["dur"] for e in xs) == pytest.approx(sum(b.end - b.start for b in bars) * 1e6, rel=1e-6)


def test_plan_cli_writes_simulated_gantt_and_trace(tmp_path, capsys, test_flow):
    png, trace = tmp_path / "sim.png", tmp_path / "sim.json"
    assert main(["plan", test_flow, "--gantt", str(png), "--gantt-trace", str(trace)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"grpo.rollouts", "grpo.update"}
    assert "gantt: " in capsys.readouterr().err


def test_plan_cli_gantt_over_a_measured_run(tmp_path, capsys, synthetic_run, test_flow):
    png = tmp_path / "cmp.png"
    assert main(["plan", test_flow, "--gantt", str(png), "--measured", str(synthetic_run(steps=4))]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    err = capsys.readouterr().err
    assert "measured 0.718 s/step" in err


def test_plan_cli_gantt_options_need_gantt(capsys, test_flow):
    assert main(["plan", test_flow, "--measured", "runs/x"]) == 2
    assert "--measured and --gantt-trace go with --gantt OUT.png" in capsys.readouterr().err


def test_plan_cli_gantt_of_a_missing_run_is_one_line(tmp_path, capsys, test_flow):
    assert main(["plan", test_flow, "--gantt", str(tmp_path / "x.png"), "--measured", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read run directory" in err


def test_profile_calibrate_from_a_run(tmp_path, capsys, synthetic_run, _cost_cpu_profile):
    assert main(["profile", "--calibrate", str(synthetic_run(steps=4))]) == 0
    out = capsys.readouterr().out
    assert "dispatch 10.0 ms/op" in out and "wrote " in out
    from flowrl.cost.profiles import load_profile

    assert load_profile(_cost_cpu_profile).op_overhead_s == pytest.approx(0.010)


def test_run_ops_missing_from_the_current_plan_get_their_engine_row(compiled):
    _, rows = compiled
    plan = {"ops": [{"id": "old.lp", "kind": "logprobs", "model": "policy", "engine": "train"},
                    {"id": "grpo.update", "kind": "update", "model": "policy", "engine": "train"},
                    {"id": "mystery", "kind": "advantage", "model": None, "engine": None}]}
    more = gantt.with_run_ops(rows, plan)
    assert more.row_of["old.lp"] == "all · policy.train" and more.label_of["old.lp"] == "logprobs"
    assert more.row_of["mystery"] == "driver"
    assert more.row_of["grpo.update"] == rows.row_of["grpo.update"]
