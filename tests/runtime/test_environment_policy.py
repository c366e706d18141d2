"""The one environment policy (flowrl/runtime/environment.py), process by process, without a run: what is
kept, what the table gives, what Ray's own spawn function starts and what a reward worker sees. The
whole run (every process it starts, read from /proc) is test_signals_and_environment.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flowrl.runtime.environment import (ACTOR_ENV, GIVEN, PASS_ENV, environ_for, keeps, process_env, scrubbed,
                                        stop_processes)
from flowrl.runtime.secrets import is_secret_name

SECRETS = {"HF_TOKEN": "hf_fake0123456789", "WANDB_API_KEY": "wandb0123456789", "RAY_AUTH_TOKEN": "raytok0123456789",
           "MY_SERVICE_PASSWORD": "hunter2hunter2", "AWS_SECRET_ACCESS_KEY": "aws0123456789",
           "DATABASE_URL": "postgres://u:hunter2@db/x", "SLACK_WEBHOOK": "https://hooks.slack.com/x"}
NEEDED = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
          "FLOWRL_CACHE": "/c", "RAY_DEDUP_LOGS": "0", "HF_HOME": "/h", "CUDA_VISIBLE_DEVICES": "0",
          "OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": "/p"}


def test_a_process_keeps_what_runs_need_and_no_secret():
    env = scrubbed({**SECRETS, **NEEDED})
    assert env == NEEDED


def test_the_table_names_each_secret_a_kind_of_process_gets_and_the_user_adds_by_name():
    env = {**SECRETS, **NEEDED}
    assert process_env("ray", env) == {**NEEDED, "RAY_AUTH_TOKEN": SECRETS["RAY_AUTH_TOKEN"]}
    assert process_env("reward", env) == NEEDED
    passing = {**env, PASS_ENV: "HF_TOKEN, DATABASE_URL"}
    assert process_env("reward", passing) == {**NEEDED, PASS_ENV: "HF_TOKEN, DATABASE_URL",
                                             "HF_TOKEN": SECRETS["HF_TOKEN"], "DATABASE_URL": SECRETS["DATABASE_URL"]}
    assert set(GIVEN) == {"ray", "reward", "tracker", "tool"} and not any(GIVEN[k] for k in ("reward", "tool"))
    # a tracker's service gets the proxy settings it needs to reach a server, no credential
    assert set(GIVEN["tracker"]) == {"HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "no_proxy"}
    assert process_env("tracker", env) == NEEDED
    assert not [n for n in ACTOR_ENV if is_secret_name(n) or not keeps(n)]  # what goes through runtime_env


def test_ray_starts_its_processes_scrubbed_and_in_a_session_of_their_own(monkeypatch):
    pytest.importorskip("ray")
    from ray._private import services

    from flowrl.runtime.environment import local_ray_processes

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)  # the suite sets it for its own Ray instances
    before = services.ConsolePopen
    with local_ray_processes():  # through Ray's own function, as ray.init starts gcs_server and raylet
        info = services.start_ray_process([sys.executable, "-c", "import os, sys; sys.stdout.write("
                                           "repr((os.getsid(0), dict(os.environ))))"],
                                          "flowrl_test", fate_share=False, stdout_file=subprocess.PIPE,
                                          env_updates={"RAY_SOMETHING": "1"})
    assert services.ConsolePopen is before
    out, _ = info.process.communicate(timeout=120)
    sid, env = eval(out)  # noqa: S307 - our own child's repr
    assert sid != os.getsid(0) and sid == info.process.pid
    assert env["RAY_SOMETHING"] == "1" and env["RAY_AUTH_TOKEN"] == SECRETS["RAY_AUTH_TOKEN"]
    assert not {k for k in SECRETS if k != "RAY_AUTH_TOKEN"} & set(env)
    # Ray's workers at normal priority (Ray's default nice 15 starved them beside other work), and the
    # setting gone from this process again
    assert env["RAY_worker_niceness"] == "0" and "RAY_worker_niceness" not in os.environ


def test_a_process_started_without_an_env_argument_gets_the_scrubbed_one_and_ours_returns(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    with environ_for("reward"):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.environ))"], capture_output=True,
                               text=True, check=True)
    assert dict(os.environ) == before
    assert not set(SECRETS) & set(eval(child.stdout))  # noqa: S307 - our own child's output


def test_a_reward_worker_sees_no_secret_and_is_out_of_flowrls_process_group(tmp_path, monkeypatch):
    from flowrl.rewards.pool import RewardPool

    (tmp_path / "peek_env.py").write_text(
        "import os\n"
        "def peek(completions, answers, prompts=None):\n"
        "    seen = open('/proc/self/environ', 'rb').read()\n"
        f"    secrets = {[v.encode() for v in SECRETS.values()]!r}\n"
        "    return [float(sum(s in seen for s in secrets)) + (10.0 if os.getsid(0) == os.getpid() else 0.0)"
        " for _ in completions]\n")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    with RewardPool("peek_env:peek", workers=1, folder=str(tmp_path)) as pool:
        result = pool.score(["a"], ["b"])
    assert result.rewards == [10.0], result  # no secret in its environment, its own session


def test_stop_processes_ends_by_process_id(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print(flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    proc.stdout.readline()  # it ignores SIGTERM now: SIGKILL after the grace
    stop_processes([proc.pid], grace_s=0.2)
    assert proc.wait(timeout=30) == -9


def test_the_wandb_trackers_service_process_gets_no_secret(tmp_path, monkeypatch):
    """Offline here (the online service, with a key that reaches the server: tests/runtime/test_trackers_online.py)."""
    wandb = pytest.importorskip("wandb")
    from flowrl.runtime.tracking import TrackedRun, WandbLogger

    wandb.teardown()  # W&B keeps one service process per process: an earlier test's would be reused

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_PROJECT", "flowrl-env-test")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the fake key is not one W&B accepts
    before = _children()
    logger = WandbLogger(tmp_path, TrackedRun("env-test"))
    try:
        started = _children() - before
        assert started, "W&B started no process"
        for pid in started:
            environ = open(f"/proc/{pid}/environ", "rb").read()
            assert not [n for n, v in SECRETS.items() if v.encode() in environ], pid
            assert b"WANDB_PROJECT=flowrl-env-test" in environ  # its settings still reach it
    finally:
        logger.close()


def _children() -> set[int]:
    me = str(os.getpid()).encode()
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and open(f"/proc/{entry}/stat", "rb").read().rsplit(b")", 1)[1].split()[1] == me:
                found.add(int(entry))
        except OSError:
            pass
    return found
