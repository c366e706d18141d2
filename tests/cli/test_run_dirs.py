"""Run directories that never surprise: what `flowrl run` refuses, honours and leaves behind.

No engine starts here: the driver's `run_plan` is replaced where a test needs a run to
begin (or fail), and a finished run is recognised from its files alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.cli import main
from flowrl.launch import build_plan
from flowrl.runtime import rundir
from flowrl.runtime.checkpoints import write_checkpoint
from flowrl.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "flows" / "arith_grpo.flow")


def fake_run(tmp_path: Path, *, steps: int = 3, done: int = 3, checkpoint: int | None = None) -> Path:
    """A run directory as `flowrl run` leaves it: plan.json, summary.json, maybe a checkpoint."""
    d = tmp_path / "run"
    d.mkdir()
    rundir.start(d)
    rundir.own(d, "plan.json", "summary.json", "metrics.jsonl")
    (d / "plan.json").write_text(build_plan(DEFAULT, steps=steps).to_json())
    (d / "summary.json").write_text(json.dumps({"steps_done": done, "accuracy_before": 0.25,
                                                "accuracy_after": 0.5 if done == steps else None}))
    if checkpoint is not None:
        save(d, checkpoint)
    return d


def save(out: Path, step: int) -> Path:
    """A checkpoint (with its manifest) as the driver writes it: listed first."""
    final = out / "checkpoints" / f"step_{step:06d}"
    rundir.own(out, final, final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old"))
    return write_checkpoint(final, lambda tmp: None)


@pytest.fixture
def recorded(monkeypatch):
    """Replace the driver's run_plan: record what it is asked to run, then behave as told."""
    import flowrl.launch as launch

    calls = []

    def run_plan(plan, out, **kw):
        calls.append((plan, out, kw))
        behaviour = recorded_behaviour.get("do")
        if behaviour is not None:
            behaviour(plan, out)
        return SimpleNamespace(out=out, steps=plan.run.steps, accuracy_before=None, accuracy_after=None, rows=[])

    recorded_behaviour = {}
    monkeypatch.setattr(launch, "run_plan", run_plan)
    return calls, recorded_behaviour


# ---- --out ------------------------------------------------------------------------------------

def test_out_refuses_an_earlier_run_unless_overwrite(tmp_path, capsys, recorded):
    calls, _ = recorded
    d = fake_run(tmp_path)
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["run", DEFAULT, "--out", str(d)]) == 1
    err = capsys.readouterr().err
    assert f"--out {d}: a run directory is already there; pass --overwrite to replace it" in err
    assert (d / "metrics.jsonl").is_file() and not calls
    assert main(["run", DEFAULT, "--out", str(d), "--overwrite", "--steps", "2"]) == 0
    assert not (d / "metrics.jsonl").exists()  # the old run's files are gone
    (plan, out, kw), = calls
    assert out == d and plan.run.steps == 2 and kw["resume"] is False


def test_out_never_deletes_a_directory_that_is_not_a_run(tmp_path, capsys, recorded):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        assert main(["run", DEFAULT, "--out", str(d), *extra]) == 1
        assert "is not empty and holds no run (plan.json)" in capsys.readouterr().err
    assert (d / "todo.txt").read_text() == "keep me" and not recorded[0]


def test_default_run_directories_never_collide(tmp_path, monkeypatch):
    from flowrl.launch import default_out

    monkeypatch.chdir(tmp_path)
    first = default_out("flows/x.flow", now=0.0)
    first.mkdir(parents=True)
    second = default_out("flows/x.flow", now=0.0)
    assert second.name == first.name + "-2" and second.parent == Path("runs")


# ---- --resume ----------------------------------------------------------------------------------

def test_resume_of_a_finished_run_says_so_without_starting_anything(tmp_path):
    d = fake_run(tmp_path, steps=3, done=3)
    code = ("import sys; from flowrl.cli import main; rc = main(['run', '--resume', sys.argv[1]]); "
            "print('imported:', sorted(m for m in ('ray', 'torch', 'vllm') if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"run directory {d} already finished its 3 steps; nothing to do" in proc.stdout
    assert "held-out accuracy: 25.0% -> 50.0%" in proc.stdout
    assert "imported: []" in proc.stdout  # no Ray, no torch, no engine


def test_resume_refuses_what_would_change_the_run(tmp_path, capsys, recorded):
    d = fake_run(tmp_path, steps=3, done=1, checkpoint=1)
    other = str(ROOT / "flows" / "arith_rloo.flow")
    cases = [
        (["run", other, "--resume", str(d)], f"that run is of {DEFAULT}, not {other}"),
        (["run", "--resume", str(d), "--set", "lr=1e-3"], "--set lr=1e-3 would change it"),
        (["run", "--resume", str(d), "--out", str(tmp_path / "x")], f"--resume writes into {d} itself; drop --out"),
        (["run", "--resume", str(d), "--overwrite"], "--resume never deletes a run"),
        (["run", "--resume", str(d), "--log", "tensorboard"], "its loggers are none; drop --log"),
        (["run", "--resume", str(d), "--flow", "other"], "that run is of flow `main`, not `other`"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        assert message in capsys.readouterr().err, argv
    assert not recorded[0]
    assert ExecutionPlan.from_json((d / "plan.json").read_text()).run.steps == 3  # untouched


def test_resume_honours_steps_and_save_every(tmp_path, recorded):
    calls, _ = recorded
    d = fake_run(tmp_path, steps=3, done=3, checkpoint=3)
    assert main(["run", DEFAULT, "--resume", str(d), "--steps", "5", "--save-every", "2"]) == 0
    (plan, out, kw), = calls
    assert out == d and kw["resume"] is True and (plan.run.steps, plan.run.save_every) == (5, 2)
    saved = ExecutionPlan.from_json((d / "plan.json").read_text())
    assert (saved.run.steps, saved.run.save_every) == (5, 2)  # the run continues with them


def test_resume_without_a_checkpoint_says_how_to_restart(tmp_path, capsys, recorded):
    d = fake_run(tmp_path, steps=3, done=1)
    assert main(["run", "--resume", str(d)]) == 1
    err = capsys.readouterr().err
    assert "stopped after step 1 of 3 and left no checkpoint" in err and "--overwrite --save-every N" in err


def test_resume_needs_a_run_directory(capsys, tmp_path):
    assert main(["run", DEFAULT, "--resume", str(tmp_path)]) == 1
    assert "no plan.json there" in capsys.readouterr().err


# ---- failed and interrupted runs ---------------------------------------------------------------

def test_a_failed_start_leaves_nothing_behind(tmp_path, capsys, recorded):
    _, behaviour = recorded

    def fail(plan, out):
        rundir.own(out, "plan.json", "trace.json")  # as the driver does, before writing them
        (out / "plan.json").write_text(plan.to_json())
        (out / "trace.json").write_text("{}")
        from flowrl.runtime.errors import RuntimeFlowError

        raise RuntimeFlowError("engine failed to start")

    behaviour["do"] = fail
    d = tmp_path / "new" / "run"
    assert main(["run", DEFAULT, "--out", str(d)]) == 1
    err = capsys.readouterr().err
    assert "engine failed to start" in err and f"removed what it wrote in {d}" in err
    assert not d.exists()
    empty = tmp_path / "empty"  # a directory the user made stays, empty
    empty.mkdir()
    assert main(["run", DEFAULT, "--out", str(empty)]) == 1
    assert empty.is_dir() and not list(empty.iterdir())


def test_a_run_stopped_after_some_steps_keeps_them_and_says_how_to_resume(tmp_path, capsys, recorded):
    _, behaviour = recorded

    def interrupted(plan, out):
        rundir.own(out, "plan.json", "summary.json")
        (out / "plan.json").write_text(plan.to_json())
        (out / "summary.json").write_text(json.dumps({"steps_done": 4}))
        save(out, 4)
        raise KeyboardInterrupt

    behaviour["do"] = interrupted
    d = tmp_path / "run"
    assert main(["run", DEFAULT, "--out", str(d), "--steps", "10"]) == 130
    err = capsys.readouterr().err
    assert f"the run stopped after step 4 of 10; {d} keeps its metrics" in err
    assert f"`flowrl run --resume {d}` continues it from step 4" in err
    assert (d / "plan.json").is_file()


# ---- bad numbers -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--set", "steps=0"], "--set steps=0: steps must be >= 1"),
    (["--set", "save_every=-3"], "--set save_every=-3: save_every must be >= 0"),
    (["--log", "tensorbord"], "--log tensorbord: unknown logger `tensorbord`: the known loggers are "
                              "tensorboard, wandb, mlflow"),
    (["--set", "log=wandb,comet"], "--set log=wandb,comet: unknown logger `comet`"),
])
def test_bad_run_settings_are_one_line_errors(argv, message, capsys, recorded):
    assert main(["run", DEFAULT, *argv]) == 1
    assert message in capsys.readouterr().err
    assert not recorded[0]


# ---- flowrl eval: what it refuses before any engine starts -------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--from", "nowhere"], "--from nowhere: no plan.json there"),
    (["--n", "4", "--k", "1,8"], "--k 1,8: each k must be between 1 and --n 4"),
    (["--n", "4", "--temperature", "0"], "--temperature 0.0: sampling needs a temperature > 0"),
])
def test_eval_refuses_bad_options(argv, message, capsys):
    assert main(["eval", DEFAULT, *argv]) == 1
    assert message in capsys.readouterr().err


def test_eval_needs_a_checkpoint_and_names_the_steps_there(tmp_path, capsys):
    d = fake_run(tmp_path, steps=3, done=1)
    assert main(["eval", DEFAULT, "--from", str(d)]) == 1
    assert "the run left no checkpoint" in capsys.readouterr().err
    save(d, 2)
    assert main(["eval", DEFAULT, "--from", str(d), "--step", "3"]) == 1
    assert "no checkpoint of that step; there are: 2" in capsys.readouterr().err
    assert main(["eval", DEFAULT, "--steps", "3"]) == 2  # eval trains nothing
    assert "`flowrl eval` trains nothing: drop --steps" in capsys.readouterr().err


def test_pass_at_k_is_the_unbiased_estimator():
    from math import comb

    from flowrl.runtime.evaluate import pass_at_k

    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # 1 - P(all k drawn without replacement are wrong)
                want = 1 - (comb(n - c, k) / comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)  # pass@1 is the share correct
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


# ---- flowrl eval --from: the run's own plan ------------------------------------------------------

def test_eval_from_a_run_made_with_set_evaluates_with_the_runs_plan(tmp_path, capsys, monkeypatch):
    """`run --set batch=8` then `eval --from RUN`: eval reads RUN/plan.json (batch 8), its own --n/--k/
    --temperature/--seed apply, a --set (or another flow) is refused, and its result is listed."""
    import flowrl.runtime.evaluate as evaluate_mod
    from flowrl.runtime import rundir
    from flowrl.runtime.evaluate import EvalResult

    d = tmp_path / "run"
    d.mkdir()
    rundir.start(d)
    rundir.own(d, "plan.json")
    trained = build_plan(DEFAULT, sets={"batch": "8"}, steps=2)
    (d / "plan.json").write_text(trained.to_json())
    save(d, 2)
    seen = []

    def evaluate(plan, checkpoint, *, n, ks, temperature, seed, **kw):
        seen.append((plan, checkpoint, n, ks, temperature, seed))
        return EvalResult(4, 0.5, 0.5, n, temperature, {1: 0.5}, 0.5, checkpoint=str(checkpoint), dataset="t.jsonl")

    monkeypatch.setattr(evaluate_mod, "evaluate", evaluate)
    assert main(["eval", DEFAULT, "--from", str(d), "--n", "4", "--k", "1,2", "--temperature", "0.7",
                 "--seed", "3"]) == 0, capsys.readouterr().err
    (plan, ckpt, n, ks, temperature, seed), = seen
    assert plan == trained and plan.to_json() == trained.to_json()
    assert ckpt == d / "checkpoints" / "step_000002" and (n, ks, temperature, seed) == (4, (1, 2), 0.7, 3)
    assert "eval/step_000002.json" in rundir.listed(d) and rundir.first_foreign(d) is None
    capsys.readouterr()
    for argv, message in [(["--set", "batch=8"], "evaluates the run with the settings it was trained with"),
                          (["--flow", "other"], "that run is of flow `main`, not `other`")]:
        assert main(["eval", DEFAULT, "--from", str(d), *argv]) == 1
        assert message in capsys.readouterr().err
    other = str(ROOT / "flows" / "arith_rloo.flow")
    assert main(["eval", other, "--from", str(d)]) == 1
    assert f"that run is of {DEFAULT}, not {other}" in capsys.readouterr().err
    assert len(seen) == 1
