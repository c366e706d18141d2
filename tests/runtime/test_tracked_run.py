"""What the trackers are told about a run (flowrl.runtime.tracking.tracked_run): the tracker settings of
the flow, `--set` and the `--log-*` options, the flow's parameters as the configuration, the flow's
source and plan.json as files; a resume keeps the tracker settings it started with."""

from __future__ import annotations

import json

import pytest

from flowrl.launch import RunError, build_plan, run_file
from flowrl.runtime.tracking import tracked_run

FLOW = ('import stdlib.grpo\nmodel policy = tiny(task = "arith")\ndataset arith = jsonl("d.jsonl")\n'
        'reward exact = verifier("math")\n'
        'flow main(steps: int = 3, log: str = "mlflow", log_tags: str = "grpo, arith", log_name: str = "nm", '
        'lr: float = 0.01) {\n  grpo(policy, arith, exact, batch = 4, group = 2, max_tokens = 4, lr = lr)\n}\n')


@pytest.fixture
def flow(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "t.flow"
    path.write_text(FLOW)
    return path


def test_the_flow_and_set_name_the_run_and_its_parameters_are_the_config(flow, tmp_path):
    plan = build_plan(str(flow), sets={"lr": "0.5", "log_project": "team-proj"},
                      run={"log_group": "sweep-1"})  # `--log-group sweep-1`
    run = tracked_run(plan, tmp_path / "run-dir")
    assert (run.default_name, run.name, run.project, run.group, run.tags, run.uri) == \
        ("run-dir", "nm", "team-proj", "sweep-1", ("grpo", "arith"), "")
    assert {k: run.config[k] for k in ("steps", "lr", "log_name")} == {"steps": 3, "lr": 0.5, "log_name": "nm"}
    assert run.config["flowrl"]["run"]["log_group"] == "sweep-1" and run.config["flowrl"]["source"] == plan.source
    files = dict(run.files)
    assert files["flowrl/t.flow"] == FLOW and json.loads(files["flowrl/plan.json"])["params"]["lr"] == 0.5
    assert tracked_run(plan, tmp_path / "run-dir", resume=True).files == ()  # the tracker's run has them


def test_a_resume_refuses_other_tracker_settings_and_a_uri_with_a_password(flow, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "plan.json").write_text(build_plan(str(flow)).to_json())
    with pytest.raises(RunError, match=r"--resume continues the run with the settings it started with: its log_name "
                                       r"is 'nm'; drop --log-name"):
        run_file(None, resume=str(out), tracking={"log_name": "other"})
    with pytest.raises(RunError, match=r"^--log-uri: the tracking URI `http://u:\*\*\*@h:5000` holds a password"):
        run_file(str(flow), out=str(tmp_path / "new"), tracking={"log_uri": "http://u:pw@h:5000"})
    with pytest.raises(RunError, match=r"^--set log_uri: the tracking URI"):
        build_plan(str(flow), sets={"log_uri": "http://u:pw@h:5000"})
