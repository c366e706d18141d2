"""One real run through `flowrl run` (Ray, vLLM, the torch trainer): trackers named by the
flow's own `log` setting, samples tables, an interruption that keeps its plots and summary,
a resume that finishes the run, and a second resume that only says it is finished."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")
pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from e2e_kit import flow_text, make_workdir, shared_ray  # noqa: E402
from tracker_readers import mlflow_run, tensorboard_scalars, tensorboard_texts, wandb_history  # noqa: E402

from flowrl.cli import main  # noqa: E402
from flowrl.launch import run_file  # noqa: E402
from flowrl.runtime.driver import Faults  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BODY = "grpo(policy, prompts, sevens, batch = b, group = 4, max_tokens = 6, lr = 3e-3, kl = 0.0, seed = 1)"


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """3 steps, trackers from the flow's `log` setting, samples every 2 steps, a checkpoint every
    step; stopped (as if killed) right after step 2. Returns (flow file, run dir, progress text)."""
    work = make_workdir(tmp_path_factory.mktemp("cli_e2e"), rows=40, train=32)
    text = flow_text(BODY, steps=3).replace(
        "flow main(steps: int = 3, eval_every: int = 0)",
        'flow main(steps: int = 3, eval_every: int = 3, log: str = "tensorboard,wandb,mlflow", log_samples: int = 2, '
        'b: int = 2)')
    flow = work / "e2e.flow"
    flow.write_text(text)
    out = work / "run"
    progress = io.StringIO()
    with pytest.raises(SystemExit):
        run_file(str(flow), out=str(out), save_every=1, faults=Faults(stop_after_step=1), stream=progress,
                 ray_address=shared_ray(), sets={"b": "4"})  # batch 4: `eval --from` must read it from plan.json
    return flow, out, progress.getvalue()


# metrics.jsonl keeps 6 significant digits (observe.py), so a value read back from a tracker
# (float32 in TensorBoard, float64 in MLflow and W&B) differs from it by up to half a unit in the
# 6th digit: 5e-6 relative when the leading digit is 1.
JSONL_REL = 5e-6 + 1e-7


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_interrupted_run_keeps_its_steps_plots_and_summary(stopped_run):
    _, out, progress = stopped_run
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2]  # 0: the evaluation before RL
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["steps"] == {"count": 2, "first": 1, "last": 2}
    assert (out / "curves.png").stat().st_size > 10_000
    assert "stopped after step 2 of 3" in progress
    for line in progress.splitlines():
        if line.startswith("step "):  # the progress lines (messages may name long paths)
            assert len(line) <= 120, line
    assert any(line.startswith("step 1/3 [###.......] reward ") for line in progress.splitlines())
    steps = {e["args"]["step"] for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert steps == {0, 1, 2}  # set-up and the evaluation before RL at 0, then steps 1 and 2


def test_samples_every_two_steps(stopped_run):
    _, out, _ = stopped_run
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rows and {r["step"] for r in rows} == {2}
    assert all(set(r) == {"step", "prompt", "completion", "reward"} for r in rows)
    assert all(r["prompt"] and isinstance(r["reward"], float) for r in rows)


@pytest.fixture(scope="module")
def resumed(stopped_run):
    flow, out, _ = stopped_run
    assert main(["run", "--resume", str(out)]) == 0
    return out


def test_resumed_run_reaches_tensorboard(resumed):
    out = resumed
    rows = metric_rows(out)
    rewards = {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}
    tb = tensorboard_scalars(out)
    assert [(s, pytest.approx(v, rel=JSONL_REL)) for s, v in tb["reward/mean"]] == list(rewards.items())
    assert [s for s, _ in tb["eval/accuracy"]] == [0, 3]
    assert [s for s, _ in tensorboard_texts(out, "samples")] == [2]


def test_resume_finishes_the_run_and_every_tracker_has_every_step(resumed):
    out = resumed
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps_done"] == 3
    rewards = {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}
    accuracy = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert sorted(accuracy) == [0, 3]  # before RL, and eval_every = 3

    client, run = mlflow_run(out)  # the resumed process continued the same MLflow run
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(v, rel=JSONL_REL)) for s, v in rewards.items()]
    assert run.info.status == "FINISHED"

    parts = sorted(out.glob("wandb/offline-run-*"))
    assert len(parts) == 2  # one offline run per process, with one id: `wandb sync` joins them
    assert len({p.name.rsplit("-", 1)[1] for p in parts}) == 1
    first, second = wandb_history(out, 0), wandb_history(out, 1)
    assert [r["_step"] for r in first] == [0, 1, 2] and [r["_step"] for r in second] == [3]
    assert [r["reward/mean"] for r in first[1:] + second] == pytest.approx(list(rewards.values()), rel=JSONL_REL)
    assert first[2]["samples"]["_type"] == "table-file"


def test_resuming_a_finished_run_only_says_so(resumed, capsys):
    assert main(["run", "--resume", str(resumed)]) == 0
    assert f"run directory {resumed} already finished its 3 steps; nothing to do" in capsys.readouterr().out


def test_everything_the_run_wrote_is_listed(resumed):
    """Every file and folder a real run (two processes, three trackers, checkpoints) left is in its list."""
    from flowrl.runtime import rundir

    assert rundir.first_foreign(resumed) is None
    rundir.check_replaceable(resumed)  # `--overwrite` would take it (nothing is deleted here)
    listed = rundir.listed(resumed)
    assert {"plan.json", "metrics.jsonl", "trace.json", "summary.json", "curves.png", "events.log", "placement.json",
            "samples.jsonl", "checkpoints/step_000003", "tensorboard", "wandb", "mlruns"} <= set(listed)


def test_the_resumed_trace_keeps_the_steps_before_and_draws(resumed, stopped_run, tmp_path, capsys):
    flow, out, _ = stopped_run
    trace = json.loads((out / "trace.json").read_text())
    steps = {e["args"]["step"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert steps == {0, 1, 2, 3}  # the stopped process's set-up and steps 1, 2, and the resumed one's step 3
    png = tmp_path / "cmp.png"
    assert main(["plan", str(flow), "--set", "b=4", "--gantt", str(png), "--measured", str(out)]) == 0, \
        capsys.readouterr().err
    assert png.stat().st_size > 0


def test_eval_from_a_run_made_with_set_uses_the_runs_plan(resumed, stopped_run, capsys):
    flow, out, _ = stopped_run
    assert main(["eval", str(flow), "--from", str(out), "--n", "0", "--json"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint"].endswith("step_000003") and result["prompts"] > 0
