"""MLflow to a tracking server: a real `mlflow server` process (sqlite backend and served artifacts in a
temporary folder, a free port), read back with MlflowClient against it: metrics, params (the flow's
parameters), run name, experiment, tags, the flow source and plan.json as artifacts, a resumed run
continuing the same MLflow run; a URI with a password refused before anything runs; one short real
`flowrl run --log mlflow --log-uri URL`."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# Whether the server is installed, without importing it: `mlflow.server` imports Flask, whose context proxies
# (`flask.current_app`) then sit in sys.modules, and vLLM's in-process start-up scans every module's values
# with `hasattr`, which a proxy outside an app context answers with a RuntimeError: every later in-process
# vLLM test of the suite failed so. The server runs in its own process here.
if importlib.util.find_spec("flask") is None:
    pytest.skip("`mlflow server` needs the full mlflow package (make installs it)", allow_module_level=True)

from flowrl.runtime.errors import RuntimeFlowError  # noqa: E402
from flowrl.runtime.tracking import TrackedRun, Trackers  # noqa: E402

FLOW = "flow main(steps: int = 3, lr: float = 0.001) {\n}\n"
SAMPLE = {"step": 1, "prompt": "1+2=", "completion": "3 apples", "reward": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on a free port (its own session: ended by its process group's id), up when
    ``/health`` answers; its URL."""
    where = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    log = open(where / "server.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{where / 'mlflow.db'}",
                             "--artifacts-destination", str(where / "artifacts")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # its imports take ~10 s idle, minutes on a loaded 2-core machine
        while True:
            assert proc.poll() is None, (where / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker: the group it leads
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=server)


def _run(name: str, uri: str = "", resumed: bool = False) -> TrackedRun:
    files = () if resumed else (("flowrl/t.flow", FLOW), ("flowrl/plan.json", json.dumps({"flow": "main"})))
    return TrackedRun(name, name="baseline", project="team-exp", group="sweep-1", tags=("grpo", "seed=3"), uri=uri,
                      config={"lr": 0.001, "flowrl": {"source": "/w/t.flow", "run": {"steps": 3}}},
                      files=files, resumed=resumed)


def _record(out: Path) -> dict:
    return json.loads((out / "mlruns" / "flowrl_run.json").read_text())


def test_a_run_reaches_the_server_and_a_resumed_run_continues_it(server, client, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    trackers = Trackers(out, ("mlflow",), _run(out.name, uri=server), samples_every=1)
    trackers.log(1, {"reward/mean": 0.5, "time/dapo#2.update": 0.01}, [SAMPLE])
    trackers.log(2, {"reward/mean": 0.625})
    trackers.close()
    record = _record(out)
    assert record["tracking_uri"] == server and not list((out / "mlruns").glob("*/meta.yaml"))  # no local store
    run = client.get_run(record["run_id"])
    assert (run.info.run_name, run.info.status) == ("baseline", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "team-exp"
    assert run.data.params == {"lr": "0.001", "flowrl.source": "/w/t.flow", "flowrl.run.steps": "3"}
    tags = run.data.tags
    assert (tags["grpo"], tags["seed"], tags["group"], tags["mlflow.source.name"]) == ("", "3", "sweep-1", "/w/t.flow")
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "flowrl")) == ["flowrl/plan.json", "flowrl/t.flow"]
    where = client.download_artifacts(run.info.run_id, "flowrl", str(tmp_path / "got"))
    assert Path(where, "t.flow").read_text() == FLOW
    table = client.load_table(run.info.experiment_id, "samples.json", run_ids=[run.info.run_id])
    assert table[["step", "prompt", "completion", "reward"]].values.tolist() == [list(SAMPLE.values())]

    # `flowrl run --resume`: the same MLflow run, found by the id the run directory keeps (not by its name)
    trackers = Trackers(out, ("mlflow",), _run(out.name, uri=server, resumed=True))
    trackers.log(3, {"reward/mean": 0.75})
    trackers.close()
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.625), (3, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "time/dapo_2.update")] == [(1, 0.01)]
    assert len(client.search_runs([run.info.experiment_id], "attributes.run_name = 'baseline'")) == 1
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


def test_the_uri_comes_from_mlflow_tracking_uri_and_a_resume_elsewhere_is_refused(server, client, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    out = tmp_path / "run"
    out.mkdir()
    trackers = Trackers(out, ("mlflow",), _run(out.name))
    trackers.log(1, {"reward/mean": 0.5})
    trackers.close()
    assert client.get_run(_record(out)["run_id"]).data.metrics == {"reward/mean": 0.5}
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # resumed in a shell without it: not a new run in RUN_DIR/mlruns
    with pytest.raises(RuntimeFlowError, match=rf"this run logs to the MLflow run \w+ at {server}, not its own store .*/mlruns; "
                                               rf"hint: resume with MLFLOW_TRACKING_URI={server}"):
        Trackers(out, ("mlflow",), _run(out.name, resumed=True))


def test_without_a_uri_the_run_directorys_own_store_is_used_and_resumed_after_a_move(tmp_path, monkeypatch):
    import shutil

    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, moved = tmp_path / "first", tmp_path / "moved"
    first.mkdir()
    trackers = Trackers(first, ("mlflow",), _run("r"))
    trackers.log(1, {"reward/mean": 0.5})
    trackers.close()
    assert _record(first)["tracking_uri"] == "mlruns"  # relative: the run directory's own store, wherever it is
    shutil.move(first, moved)
    trackers = Trackers(moved, ("mlflow",), _run("r", resumed=True))
    trackers.log(2, {"reward/mean": 0.625})
    trackers.close()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what reading a file store back needs (docs/cli.md)
    client = MlflowClient((moved / "mlruns").as_uri())
    history = client.get_metric_history(_record(moved)["run_id"], "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.625)]


def test_an_unreachable_server_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    url = f"http://me:hunter2@127.0.0.1:{_free_port()}"
    with pytest.raises(RuntimeFlowError) as e:
        Trackers(tmp_path, ("mlflow",), TrackedRun("r", uri=url))
    assert str(e.value).startswith(f"MLflow at http://127.0.0.1:{url.rsplit(':', 1)[1]} cannot be used (")
    assert "hunter2" not in str(e.value) and "check that the server runs" in str(e.value)


def test_a_tracking_uri_with_a_password_is_refused_before_anything_runs(tmp_path, capsys):
    from flowrl.cli import main

    path = tmp_path / "u.flow"
    path.write_text('flow main(log: str = "mlflow", log_uri: str = "http://me:hunter2@mlflow:5000") {\n}\n')
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "u.flow:1:47: error[E513]: the tracking URI `http://me:***@mlflow:5000` holds a password" in err
    assert "MLFLOW_TRACKING_PASSWORD" in err  # (the quoted source line is the user's own flow)
    path.write_text('flow main(log: str = "mlflow") {\n}\n')
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--log-uri", "http://me:hunter2@mlflow:5000"]) == 1
    err = capsys.readouterr().err
    assert "error: --log-uri: the tracking URI `http://me:***@mlflow:5000` holds a password" in err
    assert "hunter2" not in err and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flowrl_run_logs_to_the_server(server, client, tmp_path, monkeypatch):
    """One short real run (Ray, vLLM, the torch trainer) through the command line: `--log mlflow --log-uri URL`."""
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from e2e_kit import flow_text, make_workdir, shared_ray

    from flowrl.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = make_workdir(tmp_path / "work", rows=24, train=16)
    flow = work / "team.flow"
    flow.write_text(flow_text("grpo(policy, prompts, sevens, batch = 2, group = 2, max_tokens = 4, lr = 3e-3, kl = 0.0, "
                              "seed = 1)", steps=2))
    out = work / "run"
    assert main(["run", str(flow), "--out", str(out), "--log", "mlflow", "--log-uri", server, "--log-name", "ci-e2e",
                 "--log-project", "flowrl-ci", "--log-tags", "ci,seed=1", "--ray", shared_ray()]) == 0
    run = client.get_run(_record(out)["run_id"])
    assert (run.info.run_name, run.info.status) == ("ci-e2e", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "flowrl-ci"
    assert (run.data.tags["ci"], run.data.tags["seed"], run.data.tags["mlflow.source.name"]) == ("", "1", str(flow))
    assert (run.data.params["steps"], run.data.params["flowrl.run.log_name"]) == ("2", "ci-e2e")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 2]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)  # metrics.jsonl keeps 6 digits
    where = Path(client.download_artifacts(run.info.run_id, "flowrl", str(tmp_path / "got")))
    assert (where / "team.flow").read_text() == flow.read_text()
    assert json.loads((where / "plan.json").read_text()) == json.loads((out / "plan.json").read_text())
