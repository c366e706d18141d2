"""Experiment trackers write real TensorBoard, W&B (offline) and MLflow records, read back
with each library's own reader (tests/cli/tracker_readers.py); unknown names are refused."""

from __future__ import annotations

import json

import pytest

from flowrl.catalog.loggers import LOGGERS, UnknownLoggerError, parse_loggers

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from tracker_readers import mlflow_run, tensorboard_scalars, tensorboard_texts, wandb_history  # noqa: E402

# Steps as a run numbers them: 0 before RL (held-out eval only), then 1, 2, 3.
STEPS = {
    0: {"eval/accuracy": 0.25},
    1: {"reward/mean": 0.5, "time/resync:policy": 0.01, "loss/pg": float("nan")},
    2: {"reward/mean": 0.625, "time/resync:policy": 0.02, "eval/accuracy": 0.5},
    3: {"reward/mean": 0.75, "time/resync:policy": 0.03, "time/dapo#2.update": 0.04},  # a repeated call's op id
}
SAMPLES = [{"step": 2, "prompt": "1+2=", "completion": "3", "reward": 1.0},
           {"step": 2, "prompt": "2+2=", "completion": "5 | x\nnewline", "reward": 0.0}]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, monkeypatch_module):
    """One run's records sent to all three trackers (samples at step 2), then closed."""
    from flowrl.runtime.tracking import TrackedRun, Trackers

    out = tmp_path_factory.mktemp("run")
    monkeypatch_module.setenv("WANDB_DIR", str(out))
    monkeypatch_module.setenv("WANDB_MODE", "offline")  # whatever credentials this machine has
    monkeypatch_module.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = TrackedRun("test-run", config={"flow": "main", "run": {"steps": 3}})
    trackers = Trackers(out, tuple(LOGGERS), run, samples_every=2)
    for step, metrics in STEPS.items():
        trackers.log(step, metrics, SAMPLES if trackers.wants_samples(step) and step else None)
    trackers.close()
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _finite(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if v == v}


def test_tensorboard_event_files(tracked):
    scalars = tensorboard_scalars(tracked)
    want = {}
    for step, metrics in STEPS.items():
        for key, value in _finite(metrics).items():
            want.setdefault(key, []).append((step, value))
    assert set(scalars) == set(want)  # NaN values are left out, every other value is there
    for key, points in want.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in points]
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in points], rel=1e-6)  # fp32 in the file
    texts = tensorboard_texts(tracked, "samples")
    assert [s for s, _ in texts] == [2]
    assert "| 1+2= | 3 | 1 |" in texts[0][1] and "5 \\| x⏎newline" in texts[0][1]


def test_wandb_offline_run(tracked):
    rows = wandb_history(tracked)
    by_step = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [0, 1, 2, 3]
    for step, metrics in STEPS.items():
        for key, value in _finite(metrics).items():
            assert by_step[step][key] == pytest.approx(value)
    table = by_step[2]["samples"]
    assert table["_type"] == "table-file" and table["nrows"] == 2
    saved = json.loads(next(tracked.glob("wandb/offline-run-*/files/" + table["path"])).read_text())
    assert saved["columns"] == ["step", "prompt", "completion", "reward"]
    assert saved["data"] == [[r["step"], r["prompt"], r["completion"], r["reward"]] for r in SAMPLES]


def test_mlflow_file_store(tracked):
    client, run = mlflow_run(tracked)
    assert run.info.status == "FINISHED" and run.data.params["run.steps"] == "3"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.625), (3, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [0, 2]
    # MLflow refuses `#` in a metric name: it becomes `_` there (TensorBoard and W&B keep it)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "time/dapo_2.update")] == [(3, 0.04)]
    table = client.load_table(run.info.experiment_id, "samples.json", run_ids=[run.info.run_id])
    assert table[["step", "prompt", "completion", "reward"]].values.tolist() == \
        [[r["step"], r["prompt"], r["completion"], r["reward"]] for r in SAMPLES]


def test_samples_jsonl(tracked):
    rows = [json.loads(line) for line in (tracked / "samples.jsonl").read_text().splitlines()]
    assert rows == SAMPLES


def test_a_resumed_run_drops_the_samples_of_the_steps_it_does_again(tmp_path):
    """Resuming from step 2's checkpoint: step 3's rows (and a line a crash cut) go; steps 1..2 stay."""
    from flowrl.runtime.tracking import TrackedRun, Trackers

    rows = [{"step": s, "prompt": f"{s}+1=", "completion": str(s + 1), "reward": 1.0} for s in (1, 2, 3)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "pro')
    trackers = Trackers(tmp_path, (), TrackedRun("resumed"), samples_every=1)
    trackers.resume_after(2)
    trackers.log(3, {"reward/mean": 0.5}, [{**rows[2], "completion": "again"}])
    trackers.close()
    kept = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"]) for r in kept] == [(1, "2"), (2, "3"), (3, "again")]


def test_unknown_logger_names_the_known_ones():
    assert parse_loggers("TensorBoard, wandb,tensorboard") == ("tensorboard", "wandb")
    with pytest.raises(UnknownLoggerError, match=r"unknown logger `tensorbord`: the known loggers are "
                                                 r"tensorboard, wandb, mlflow .*did you mean `tensorboard`"):
        parse_loggers("tensorbord")


def test_every_logger_record_names_a_tracker_class():
    import importlib

    for spec in LOGGERS.values():
        module, _, cls = spec.adapter.partition(":")
        klass = getattr(importlib.import_module(module), cls)
        for method in ("log_metrics", "log_samples", "close"):
            assert callable(getattr(klass, method)), (spec.name, method)


def test_the_flow_names_its_loggers_as_a_run_setting(write_flow):
    from flowrl.launch import build_plan

    path = write_flow("t.flow", 'import stdlib.grpo\nmodel policy = tiny(task = "arith")\n'
                                'dataset arith = jsonl("d.jsonl")\nreward exact = verifier("math")\n'
                                'flow main(steps: int = 3, log: str = "tensorboard, mlflow", log_samples: int = 2) {\n'
                                '  grpo(policy, arith, exact, batch = 4, group = 2, max_tokens = 4)\n}\n')
    plan = build_plan(str(path))
    assert (plan.run.log, plan.run.log_samples) == (("tensorboard", "mlflow"), 2)
    plan = build_plan(str(path), sets={"log": "wandb", "log_samples": "0"})  # --set overrides the flow
    assert (plan.run.log, plan.run.log_samples) == (("wandb",), 0)
    assert build_plan(str(path), run={"log": ()}).run.log == ()  # --log none


def test_a_bad_run_setting_in_the_flow_is_a_positioned_error(write_flow, capsys):
    from flowrl.cli import main

    path = write_flow("bad.flow", 'flow main(steps: int = 0, log: str = "wandb,comet", seed: float = 1.0) {\n}\n')
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "bad.flow:1:24: error[E510]: run setting `steps = 0` must be an integer >= 1" in err
    assert "bad.flow:1:38: error[E511]: unknown logger `comet`: the known loggers are tensorboard, wandb, mlflow" in err
    assert "error[E510]: run setting `seed` must be declared `int`, not `float`" in err
    assert "= hint: write `seed: int = 0`" in err


def test_step_samples_reads_texts_from_the_rollouts_record():
    """A completion's text is the rollouts record's (decoded text is not a field of the step value)."""
    from types import SimpleNamespace

    from flowrl.catalog.ops import OpKind
    from flowrl.runtime.step import Rollouts, StepValue
    from flowrl.runtime.tracking import step_samples

    plan = SimpleNamespace(ops=[SimpleNamespace(id="s", kind=OpKind.SCORE, inputs={"rollouts": "g"})])
    values = {"g": StepValue({"prompt_text": ["1+2=", "2+2="]}, Rollouts("m", None, ("3", "5"))),
              "s": StepValue({"rewards": [1.0, 0.0]})}
    assert step_samples(plan, values, 2) == [{"step": 2, "prompt": "1+2=", "completion": "3", "reward": 1.0},
                                             {"step": 2, "prompt": "2+2=", "completion": "5", "reward": 0.0}]
