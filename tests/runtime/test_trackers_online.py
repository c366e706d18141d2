"""Trackers for teams: W&B online against a local stand-in server (tests/runtime/wandb_standin.py: the
GraphQL, file-stream and upload calls wandb 0.31's core makes), offline without credentials, and the
key never in W&B's service environment or the run directory. MLflow against a real `mlflow server`:
tests/runtime/test_trackers_mlflow_server.py."""

from __future__ import annotations

import json
import os

import pytest

wandb = pytest.importorskip("wandb")

from wandb_standin import WandbStandin  # noqa: E402

from flowrl.runtime.errors import RuntimeFlowError  # noqa: E402
from flowrl.runtime.tracking import TrackedRun, Trackers, wandb_access  # noqa: E402

KEY = "flowrl0test0key0" + "k" * 32  # the form W&B accepts (40+ letters, digits, underscores)
FLOW = "flow main(steps: int = 3, lr: float = 0.001) {\n}\n"
STEPS = {1: {"reward/mean": 0.5}, 2: {"reward/mean": 0.625}, 3: {"reward/mean": 0.75}}


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A stand-in W&B server as WANDB_BASE_URL, and a W&B environment of the test's own: no key, no netrc
    (HOME is a temporary folder), W&B's settings and caches in it; W&B's service of earlier tests ended."""
    # W&B keeps one service process per process, with the settings it started with, and names it in
    # WANDB_SERVICE: ended first (which drops the variable), so the variable is not restored after the test
    wandb.teardown()
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NETRC", raising=False)
    for name, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(name, str(home / sub))
    with WandbStandin() as server:
        monkeypatch.setenv("WANDB_BASE_URL", server.url)
        yield server
    wandb.teardown()


def _run(name: str, resumed: bool = False) -> TrackedRun:
    files = () if resumed else (("flowrl/t.flow", FLOW), ("flowrl/plan.json", json.dumps({"flow": "main"})))
    return TrackedRun(name, name="baseline", project="team-proj", entity="team", group="sweep-1", tags=("grpo", "arith"),
                      config={"lr": 0.001, "flowrl": {"run": {"steps": 3}}}, files=files, resumed=resumed)


def _log(out, run: TrackedRun, steps) -> None:
    trackers = Trackers(out, ("wandb",), run)
    for step in steps:
        trackers.log(step, STEPS[step])
    trackers.close()


def test_with_a_key_the_run_goes_online_and_a_resumed_run_continues_it(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    out = tmp_path / "run"
    out.mkdir()
    _log(out, _run(out.name), [1, 2])
    run_id = (out / "wandb" / "flowrl_run_id").read_text()
    run = standin.runs[("team", "team-proj", run_id)]
    assert (run.display_name, run.group, run.tags) == ("baseline", "sweep-1", ["grpo", "arith"])
    assert run.config["lr"]["value"] == 0.001 and run.config["flowrl"]["value"] == {"run": {"steps": 3}}
    assert [(r["_step"], r["reward/mean"]) for r in run.history] == [(1, 0.5), (2, 0.625)]
    assert run.files["flowrl/t.flow"] == FLOW.encode() and json.loads(run.files["flowrl/plan.json"]) == {"flow": "main"}
    assert {key for _, _, key in standin.requests if key} == {KEY}  # the key went to the server, in its header

    _log(out, _run(out.name, resumed=True), [3])  # `flowrl run --resume`: the same W&B run on the server
    assert "RunResumeStatus" in standin.operations
    assert [k for k in standin.runs if k[2] == run_id] == [("team", "team-proj", run_id)]
    assert [r["_step"] for r in run.history] == [1, 2, 3]
    # the key is in no file of the run directory (W&B's run files, logs and transaction log included)
    leaked = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink() and KEY.encode() in p.read_bytes()]
    assert not leaked
    assert not list(out.glob("wandb/offline-run-*"))


def test_the_service_process_gets_no_key_online(standin, tmp_path, monkeypatch):
    from test_environment_policy import _children

    from flowrl.runtime.tracking import WandbLogger

    monkeypatch.setenv("WANDB_API_KEY", KEY)
    before = _children()
    logger = WandbLogger(tmp_path, _run(tmp_path.name))
    try:
        started = _children() - before
        assert started, "W&B started no process"
        for pid in started:
            assert KEY.encode() not in open(f"/proc/{pid}/environ", "rb").read(), pid
        assert logger.mode == "online"
    finally:
        logger.close()
    assert standin.runs  # and yet the run reached the server


def test_without_credentials_the_run_stays_offline_and_sends_nothing(standin, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _log(out, _run(out.name), [1, 2])
    assert standin.requests == []
    offline = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(offline) == 1
    assert (offline[0].parent / "files" / "flowrl" / "t.flow").read_text() == FLOW  # `wandb sync` uploads it


def test_wandb_mode_decides_and_a_netrc_entry_is_a_credential(standin, tmp_path, monkeypatch):
    host = standin.url.split("//")[1].split(":")[0]
    assert wandb_access().mode == "offline"  # no credential
    (tmp_path / "home" / ".netrc").write_text(f"machine {host}\n  login user\n  password {KEY}\n")
    access = wandb_access()  # `wandb login --host URL` writes such an entry
    assert (access.mode, access.found_in, access.api_key) == ("online", "netrc (`wandb login`)", KEY)
    assert KEY not in repr(access)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_access().mode == "offline"  # the user's word wins over a credential
    (tmp_path / "home" / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(RuntimeFlowError, match=r"WANDB_MODE=online, but there is no W&B credential for "
                                               r"http://127\.0\.0\.1:\d+; hint: set WANDB_API_KEY or run `wandb login`"):
        wandb_access()
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(RuntimeFlowError, match="WANDB_MODE=sometimes is not a W&B mode"):
        wandb_access()
