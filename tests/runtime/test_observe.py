"""Observability: Perfetto trace, metrics.jsonl with resume, the progress line, the run plot, the summary."""

import io
import json
import math
import struct
import time

import numpy as np
import pytest

from flowrl.runtime.observe import (
    MetricsLog,
    ObserveError,
    Progress,
    Timeline,
    plot_run,
    summarize,
)

# --------------------------------------------------------------------------- Timeline


def load_trace(path):
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    lanes = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    return doc, meta, events, lanes


def test_trace_is_valid_json_with_one_pid_and_named_lanes(tmp_path):
    tl = Timeline(process_name="arith_grpo")
    t0 = 1_700_000_000.0
    tl.add("generate", "rollout", 0, t0 + 0.0, t0 + 0.8, prompts=64)
    tl.add("update", "trainer", 0, t0 + 0.8, t0 + 1.3)
    tl.add("generate", "rollout", 1, t0 + 1.3, t0 + 2.0)
    tl.write(tmp_path / "out" / "trace.json")

    doc, meta, events, lanes = load_trace(tmp_path / "out" / "trace.json")
    assert {e["pid"] for e in doc["traceEvents"]} == {1}
    assert lanes == {1: "rollout", 2: "trainer"}
    proc = [e for e in meta if e["name"] == "process_name"]
    assert proc[0]["args"]["name"] == "arith_grpo"
    # Recorded with the loop index, written as the step users see (index + 1).
    assert [(e["name"], e["tid"], e["args"]["step"]) for e in events] == [
        ("generate", 1, 1), ("update", 2, 1), ("generate", 1, 2)]
    # ts/dur in microseconds, relative to the earliest event.
    assert events[0]["ts"] == 0.0
    assert events[0]["dur"] == pytest.approx(800_000, abs=0.1)
    assert events[1]["ts"] == pytest.approx(800_000, abs=0.1)
    assert events[0]["args"] == {"step": 1, "prompts": 64}
    assert not (tmp_path / "out" / "trace.json.tmp").exists()


def test_spans_nest_within_their_lane(tmp_path):
    tl = Timeline()
    with tl.span("step", "driver", 3):
        with tl.span("generate", "driver", 3, n=4):
            sum(range(1000))
        with tl.span("update", "driver", 3):
            sum(range(1000))
    with tl.span("resync", "weights", 3):
        pass
    tl.write(tmp_path / "trace.json")
    _, _, events, lanes = load_trace(tmp_path / "trace.json")

    by_name = {e["name"]: e for e in events}
    parent = by_name["step"]
    assert events[0]["name"] == "step"  # parents are written before their children
    for child in ("generate", "update"):
        c = by_name[child]
        assert c["tid"] == parent["tid"]
        assert parent["ts"] <= c["ts"]
        assert c["ts"] + c["dur"] <= parent["ts"] + parent["dur"] + 0.2
    assert by_name["generate"]["ts"] + by_name["generate"]["dur"] <= by_name["update"]["ts"] + 0.2
    assert lanes[by_name["resync"]["tid"]] == "weights"
    assert by_name["generate"]["args"] == {"step": 4, "n": 4}  # loop index 3 = step 4


def test_phase_seconds_sums_per_name_and_step():
    tl = Timeline()
    t0 = 100.0
    tl.add("generate", "rollout/0", 2, t0, t0 + 0.5)
    tl.add("generate", "rollout/1", 2, t0, t0 + 0.25)  # two workers: both count
    tl.add("update", "trainer", 2, t0 + 0.5, t0 + 1.5)
    tl.add("generate", "rollout/0", 3, t0 + 2, t0 + 9)  # other step: excluded
    got = tl.phase_seconds(2)
    assert list(got) == ["generate", "update"]
    assert got["generate"] == pytest.approx(0.75)
    assert got["update"] == pytest.approx(1.0)
    assert tl.phase_seconds(3) == {"generate": pytest.approx(7.0)}
    assert tl.phase_seconds(4) == {}
    tl.add("eval", "driver", -1, t0 - 3, t0 - 1)  # before step 0 (baseline evaluation)
    assert tl.phase_seconds(-1) == {"eval": pytest.approx(2.0)}


def test_span_records_failure_and_reraises(tmp_path):
    tl = Timeline()
    with pytest.raises(KeyError):
        with tl.span("reward", "scorer", 0, batch=object()):
            raise KeyError("x")
    tl.write(tmp_path / "t.json")
    _, _, events, _ = load_trace(tmp_path / "t.json")
    assert events[0]["args"]["error"] == "KeyError"
    assert events[0]["args"]["batch"].startswith("<object object")  # non-JSON args stringified
    assert events[0]["dur"] >= 0


def test_span_checks_its_arguments_before_running_the_block():
    ran = []
    with pytest.raises(ObserveError, match="lane=None"):
        with Timeline().span("generate", None, 0):
            ran.append(1)
    assert ran == []


def test_events_before_construction_keep_nonnegative_ts(tmp_path):
    tl = Timeline()
    now = time.time()
    tl.add("load", "init", 0, now - 5.0, now - 4.0)
    with tl.span("generate", "rollout", 0):
        pass
    tl.write(tmp_path / "t.json")
    _, _, events, _ = load_trace(tmp_path / "t.json")
    assert events[0]["name"] == "load" and events[0]["ts"] == 0.0
    assert events[1]["ts"] >= 4.0e6


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(name="g", lane="r", step=0, start_s=2.0, end_s=1.0), "start_s=2.0, end_s=1.0"),
        (dict(name="g", lane="", step=0, start_s=1.0, end_s=2.0), "lane=''"),
        (dict(name="g", lane="r", step=-2, start_s=1.0, end_s=2.0), "step=-2"),
        (dict(name="g", lane="r", step=0, start_s=float("nan"), end_s=2.0), "start_s=nan"),
    ],
)
def test_timeline_rejects_bad_events_with_the_value(kwargs, fragment):
    with pytest.raises(ObserveError, match="hint") as info:
        Timeline().add(**kwargs)
    assert fragment in str(info.value)


# --------------------------------------------------------------------------- MetricsLog


def read_lines(path):
    return path.read_text().splitlines()


def test_metrics_log_writes_sorted_rounded_lines(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.log(0, {"reward/mean": 1 / 3, "kl/ref": 3.14159265e-7, "sync/bytes": 123456789,
                "policy/version": np.int64(4), "loss/pg": np.float32(0.5), "eval/accuracy": None})
    (line,) = read_lines(tmp_path / "metrics.jsonl")
    assert line == ('{"kl/ref": 3.14159e-07, "loss/pg": 0.5, "policy/version": 4, '
                    '"reward/mean": 0.333333, "step": 0, "sync/bytes": 123456789}')
    assert log.rows() == [json.loads(line)]


def test_metrics_log_accepts_torch_scalars(tmp_path):
    torch = pytest.importorskip("torch")
    log = MetricsLog(tmp_path / "m.jsonl")
    log.log(0, {"loss/total": torch.tensor(2.5), "n": torch.tensor([7])})
    assert log.rows() == [{"step": 0, "loss/total": 2.5, "n": 7}]


def test_metrics_log_nonfinite_values_are_strict_json_and_round_trip(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.log(0, {"loss/pg": float("nan"), "a": float("inf"), "b": -float("inf")})
    line = read_lines(tmp_path / "m.jsonl")[0]
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    row = MetricsLog(tmp_path / "m.jsonl", resume_after_step=1).rows()[0]
    assert math.isnan(row["loss/pg"]) and row["a"] == math.inf and row["b"] == -math.inf


def test_resume_keeps_exactly_the_earlier_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(10):
        log.log(step, {"reward/mean": step / 10})
    resumed = MetricsLog(path, resume_after_step=5)  # a checkpoint after step 5: steps 6.. run again
    assert [r["step"] for r in resumed.rows()] == [0, 1, 2, 3, 4, 5]
    assert [json.loads(x)["step"] for x in read_lines(path)] == [0, 1, 2, 3, 4, 5]
    assert resumed.rows()[5] == {"step": 5, "reward/mean": 0.5}
    resumed.log(6, {"reward/mean": 0.99})
    assert [json.loads(x)["step"] for x in read_lines(path)] == [0, 1, 2, 3, 4, 5, 6]
    assert MetricsLog(path, resume_after_step=100).rows() == resumed.rows()
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_drops_a_torn_last_line_but_rejects_a_corrupt_middle_one(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x": 2}\n{"step": 2, "x"')
    assert [r["step"] for r in MetricsLog(path, resume_after_step=5).rows()] == [0, 1]
    assert [r["step"] for r in MetricsLog(path, resume_after_step=0).rows()] == [0]

    path.write_text('{"step": 0, "x": 1}\ngarbage\n{"step": 2, "x": 3}\n')
    with pytest.raises(ObserveError, match=r"m\.jsonl:2: not a metrics record: 'garbage'"):
        MetricsLog(path, resume_after_step=5)


def test_fresh_log_replaces_an_old_file_and_resume_without_file_is_empty(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "x": 1}\n')
    assert MetricsLog(path).rows() == []
    assert path.read_text() == ""
    assert MetricsLog(tmp_path / "none" / "m.jsonl", resume_after_step=3).rows() == []


def test_metrics_log_rejects_repeated_steps_and_bad_values(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.log(3, {"x": 1})
    with pytest.raises(ObserveError, match="step 3 after step 3"):
        log.log(3, {"y": 2})
    with pytest.raises(ObserveError, match=r"metric 'hist' at step 4: value \[1, 2\] of type list"):
        log.log(4, {"hist": [1, 2]})
    with pytest.raises(ObserveError, match="metric key 'step'"):
        log.log(4, {"step": 1})
    with pytest.raises(ObserveError, match="step=True"):
        log.log(True, {})
    assert [r["step"] for r in log.rows()] == [3]


# --------------------------------------------------------------------------- Progress


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


METRICS = {
    "reward/mean": 0.4123,
    "eval/accuracy": 0.35,
    "perf/tokens_per_s": 1234.0,
    "loss/pg": 0.1,
    "time/generate": 0.8,
    "time/update": 0.523,
    "time/resync": 0.02,
}


def test_progress_line_content_and_eta():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(60, stream=out, clock=clock)
    assert not p.live  # a StringIO is not a terminal: plain lines
    clock.t += 30.0  # first step: includes start-up
    p.update(1, METRICS)
    clock.t += 5.0
    p.update(2, {"reward/mean": 0.5})
    clock.t += 5.0
    p.update(12, METRICS)  # steps 3..11 not shown: eta uses 10 s / 11 steps since the first update
    lines = out.getvalue().splitlines()
    assert lines[0] == ("step  1/60 [..........] reward 0.412 acc 35.0% gen_tok/s 1.2k"
                        " | generate 0.80s update 0.52s resync 0.02s eta 29m30s")
    assert lines[1] == "step  2/60 [..........] reward 0.500 eta 4m50s"
    assert lines[2] == ("step 12/60 [##........] reward 0.412 acc 35.0% gen_tok/s 1.2k"
                        " | generate 0.80s update 0.52s resync 0.02s eta 44s")


def test_progress_last_step_message_close_and_resume():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(4, stream=out, start_step=2, clock=clock)  # steps 1 and 2 were done before
    clock.t += 70.0
    p.update(3, {"kl/ref": 0.0123, "time/generate": 75.0})
    p.message("checkpoint saved to runs/x/checkpoints/step_000003")
    clock.t += 70.0
    p.update(4, {"reward/mean": float("nan")})
    p.close()
    p.close()  # idempotent
    assert out.getvalue().splitlines() == [
        "step 3/4 [#######...] kl 0.0123 | generate 1m15s eta 1m10s",
        "checkpoint saved to runs/x/checkpoints/step_000003",
        "step 4/4 [##########] reward nan done in 2m20s",
        "finished 4/4 steps (2 in this process) in 2m20s",
    ]


def test_progress_after_a_failure_says_where_it_stopped():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, stream=out, clock=clock)
    clock.t += 12.0
    p.update(1, {})
    p.stopped()
    assert out.getvalue().splitlines()[-1] == "stopped after step 1 of 10 (1 in this process, 12s)"


def test_progress_shows_at_most_six_phases_keeping_the_slowest_in_order():
    out = io.StringIO()
    p = Progress(10, stream=out, clock=FakeClock())
    p.update(1, {f"time/op{i}": float(i) for i in range(8)})
    line = out.getvalue().strip()
    assert line.split("| ")[1] == "op2 2.00s op3 3.00s op4 4.00s op5 5.00s op6 6.00s op7 7.00s eta 0s"


def test_progress_lines_fit_in_120_columns_dropping_the_fastest_phases_first():
    out = io.StringIO()
    p = Progress(200, stream=out, clock=FakeClock())
    metrics = {**METRICS, "kl/ref": 0.0123, **{f"time/grpo.part_{i}": 0.1 * i for i in range(1, 7)}}
    p.update(1, metrics)
    p.update(2, metrics)
    for line in out.getvalue().splitlines():
        assert len(line) <= 120, line
    last = out.getvalue().splitlines()[-1]
    # the headline stays whole; of the phases, the slowest that fit, in the order the step ran them
    assert last == ("step   2/200 [..........] reward 0.412 acc 35.0% kl 0.0123 gen_tok/s 1.2k"
                    " | generate 0.80s grpo.part_6 0.60s eta 0s")


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_in_place_on_a_terminal():
    out = FakeTerminal()
    p = Progress(3, stream=out, clock=FakeClock(), width=80)
    assert p.live and p.width == 80
    p.update(1, {"reward/mean": 0.1})
    p.message("checkpoint saved")
    p.update(2, {"reward/mean": 0.2})
    p.close()
    text = out.getvalue()
    # one line redrawn with carriage returns (erased to its end); messages scroll above it
    assert text.startswith("\r\x1b[Kstep 1/3 [###.......] reward 0.100")
    assert "\r\x1b[Kcheckpoint saved\nstep 1/3" in text
    assert "\r\x1b[Kstep 2/3 [######....] reward 0.200" in text
    assert text.endswith("\nfinished 2/3 steps (2 in this process) in 0s\n")
    assert text.count("\n") == 3  # the message, the kept progress line, the final line


@pytest.mark.parametrize("args, fragment", [((0,), "total_steps=0"), ((5, io.StringIO(), 6), "start_step=6")])
def test_progress_rejects_bad_arguments(args, fragment):
    with pytest.raises(ObserveError, match=fragment):
        Progress(*args)


# --------------------------------------------------------------------------- plot_run and summarize


def synthetic_rows(n=40):
    """A learning run: reward up, KL up then flat, mismatch at fp32 noise level."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(n):
        mean = 0.1 + 0.8 * step / (n - 1) + 0.03 * rng.standard_normal()
        row = {"step": step, "reward/mean": mean, "reward/min": mean - 0.4, "reward/max": min(1.0, mean + 0.4),
               "kl/ref": 0.02 * (1 - math.exp(-step / 10)), "mismatch/kl": 1e-6 * (1 + rng.random()),
               "mismatch/abs_mean": 2e-5 * (1 + rng.random()), "mismatch/abs_max": 3e-4 * (1 + rng.random()),
               "loss/pg": 1.0 - step / n, "time/generate": 0.8, "time/update": 0.5, "perf/step_s": 1.3}
        if step % 10 == 0 or step == n - 1:
            row["eval/accuracy"] = 0.05 + 0.6 * step / (n - 1)
        rows.append(row)
    return rows


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)


def test_plot_run_writes_a_png(tmp_path):
    path = tmp_path / "run_arith" / "plots" / "run.png"
    plot_run(synthetic_rows(), path, title="arith_grpo")
    (width, height), nbytes = png_size(path)
    assert (width, height) == (1500, 1000)
    assert nbytes > 10_000


def test_plot_run_with_missing_series_and_from_metrics_log(tmp_path):
    log = MetricsLog(tmp_path / "run_b" / "metrics.jsonl")
    for step in range(5):
        log.log(step, {"reward/mean": step * 0.1, "loss/pg": float("nan") if step == 2 else 1.0})
    plot_run(log.rows(), tmp_path / "run_b" / "run.png")
    (width, height), nbytes = png_size(tmp_path / "run_b" / "run.png")
    assert (width, height) == (1500, 1000) and nbytes > 10_000
    plot_run([], tmp_path / "empty.png")
    assert png_size(tmp_path / "empty.png")[0] == (1500, 1000)


def test_summarize_reports_first_last_best():
    rows = [
        {"step": 0, "reward/mean": 0.1, "loss/pg": 2.0, "time/generate": 1.0, "eval/accuracy": 0.2},
        {"step": 1, "reward/mean": 0.7, "loss/pg": 1.0, "time/generate": 2.0},
        {"step": 2, "reward/mean": 0.7, "loss/pg": float("nan"), "time/generate": 0.5, "eval/accuracy": 0.5},
        {"step": 3, "reward/mean": 0.4, "loss/pg": 1.5, "kl/ref": 0.01},
    ]
    s = summarize(list(reversed(rows)))  # order of the input does not matter
    assert s["steps"] == {"count": 3, "first": 1, "last": 3}  # RL steps; step 0 is before RL
    assert s["reward/mean"] == {"first": 0.1, "first_step": 0, "last": 0.4, "last_step": 3, "count": 4,
                                "best": 0.7, "best_step": 1, "mean": pytest.approx(0.475)}
    assert s["eval/accuracy"]["best"] == 0.5 and s["eval/accuracy"]["count"] == 2
    assert s["loss/pg"]["best"] == 1.0 and s["loss/pg"]["best_step"] == 1
    assert s["loss/pg"]["mean"] == pytest.approx(1.5)
    assert s["kl/ref"]["first"] == s["kl/ref"]["last"] == 0.01
    assert "mismatch/kl" not in s
    assert s["time_total_s"] == {"generate": pytest.approx(3.5)}
    assert summarize([]) == {"steps": {"count": 0, "first": None, "last": None}, "time_total_s": {}}


def test_accuracy_before_rl_is_the_row_of_step_0(tmp_path):
    """The pre-RL evaluation is metrics row 0, so the plot starts where RL started from."""
    from matplotlib.figure import Figure

    from flowrl.runtime.observe import _draw_accuracy

    rows = [{"step": 0, "eval/accuracy": 0.27}, {"step": 10, "eval/accuracy": 0.5}, {"step": 20, "eval/accuracy": 0.7}]
    ax = Figure().subplots()
    assert _draw_accuracy(ax, rows)
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 10, 20]
    assert list(line.get_ydata()) == pytest.approx([27.0, 50.0, 70.0])
    assert any("before RL: 27.0%" in t.get_text() for t in ax.texts)
    plot_run(rows, tmp_path / "curves.png")
    assert png_size(tmp_path / "curves.png")[0] == (1500, 1000)


def test_reward_band_is_the_std_and_absent_for_two_valued_rewards():
    from flowrl.runtime.observe import reward_band

    def row(step, rewards):
        r = np.array(rewards, dtype=float)
        return {"step": step, "reward/mean": r.mean(), "reward/std": r.std(), "reward/min": r.min(), "reward/max": r.max()}

    # 0/1 rewards: a min..max band would cover 0..1 at every step; the std only restates the mean
    binary = [row(k, [1.0] * k + [0.0] * (8 - k)) for k in range(1, 8)]
    assert reward_band(binary) is None
    # graded rewards: mean +/- std, clipped to [min, max]
    graded = [row(1, [0.0, 0.5, 0.5, 1.0]), row(2, [0.9, 1.0, 1.0, 1.0])]
    steps, low, high = reward_band(graded)
    assert steps == [1, 2]
    assert low == pytest.approx([0.5 - np.sqrt(0.125), 0.975 - np.sqrt(0.001875)])
    assert high == pytest.approx([0.5 + np.sqrt(0.125), 1.0])  # clipped at the max
    assert reward_band([{"step": 1, "reward/mean": 0.5}]) is None  # no std logged: no band


def test_startup_report_says_what_start_up_was_made_of():
    """The driver's ``start:*`` spans in order, each engine actor's process and engine build, the slowest named."""
    from flowrl.runtime.observe import SETUP_STEP, startup_report

    tl = Timeline("f")
    t = 1000.0
    for part, sec in (("check", 0.01), ("models", 0.2), ("data", 1.0), ("ray", 5.0), ("engines", 20.0)):
        tl.add(f"start:{part}", "driver", SETUP_STEP, t, t + sec)
        t += sec
    tl.add("start:process", "policy.rollout0", SETUP_STEP, 1006.2, 1008.0)
    tl.add("start:engine", "policy.rollout0", SETUP_STEP, 1008.0, 1026.0)
    tl.add("start:process", "policy.train", SETUP_STEP, 1006.2, 1007.0)
    tl.add("start:engine", "policy.train", SETUP_STEP, 1007.0, 1012.0)
    tl.add("generate[0]", "policy.rollout0", 0, 1027.0, 1028.0)  # a step's event: not start-up
    report = startup_report(tl, 1000.0, 1026.5)
    assert report["seconds"] == 26.5
    assert list(report["driver"]) == ["check", "models", "data", "ray", "engines"]
    assert report["driver"]["ray"] == 5.0 and report["driver"]["engines"] == 20.0
    assert report["engines"] == {"policy.rollout0": {"process_s": 1.8, "engine_s": 18.0},
                                 "policy.train": {"process_s": 0.8, "engine_s": 5.0}}
    assert report["line"] == ("start-up 26.5s: models 0.2s, data 1.0s, ray 5.0s, engines 20.0s "
                              "(slowest engine policy.rollout0: process 1.8s, engine 18.0s)")
