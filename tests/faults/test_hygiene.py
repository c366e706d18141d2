"""Run directories and what runs write (issue 14, "also"): created with the user's umask but never
world-writable; no secret from the environment (tokens, keys) in events, traces or progress lines."""

from __future__ import annotations

import io
import json
import os
import stat
from types import SimpleNamespace

import pytest

from flowrl.runtime.secrets import is_secret_name, redact, secrets

TOKEN = "hf_hygieneTestToken987654321"


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN", "AWS_SECRET_ACCESS_KEY",
                                  "OPENAI_API_KEY", "GITHUB_TOKEN", "DB_PASSWORD", "GOOGLE_APPLICATION_CREDENTIALS"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "KEYBOARD", "FLOWRL_THREADS", "RAY_AUTH_MODE", "PATH",
                                  "HF_HUB_DISABLE_PROGRESS_BARS"])
def test_ordinary_names(name):
    assert not is_secret_name(name)


def test_redact_replaces_long_values_only_and_names_the_variable():
    env = {"HF_TOKEN": TOKEN, "MY_KEY": "short", "PATH": "/usr/bin:/bin"}
    assert secrets(env) == {TOKEN: "HF_TOKEN"}
    assert redact(f"x {TOKEN} y short /usr/bin", env) == "x ***HF_TOKEN*** y short /usr/bin"


def test_events_trace_and_progress_hold_no_secret(tmp_path, monkeypatch):
    from flowrl.runtime.driver import EventFile
    from flowrl.runtime.observe import Progress, Timeline

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    lines: list[str] = []
    events = EventFile(tmp_path / "events.log", lines.append)
    op = SimpleNamespace(id="score", origin="main.flow:4:1")
    from flowrl.rewards.pool import RewardError

    error = RewardError(0, "1+1=", "2", f"401 for token {TOKEN}")
    events.reward_errors(op, 1, [error])
    events.env_errors(op, 1, [(0, f"auth {TOKEN}")])
    events.close()
    text = (tmp_path / "events.log").read_text()
    assert TOKEN not in text and "***HF_TOKEN***" in text
    assert all(json.loads(x) for x in text.splitlines())  # still one JSON object per line

    timeline = Timeline("main")
    timeline.add("generate", "policy.rollout", 0, 0.0, 1.0, prompt=f"key={TOKEN}")
    timeline.write(tmp_path / "trace.json")
    assert TOKEN not in (tmp_path / "trace.json").read_text()
    json.loads((tmp_path / "trace.json").read_text())

    stream = io.StringIO()
    Progress(3, stream=stream).message(f"could not log in with {TOKEN}")
    assert TOKEN not in stream.getvalue() and "***HF_TOKEN***" in stream.getvalue()


def test_actors_get_no_secret_from_the_environment():
    from flowrl.runtime.fleet import ACTOR_ENV

    assert not [name for name in ACTOR_ENV if is_secret_name(name)]


@pytest.mark.parametrize("umask,mode", [(0o000, 0o755), (0o002, 0o755), (0o022, 0o755), (0o027, 0o750),
                                        (0o077, 0o700)])
def test_run_directory_follows_the_umask_and_is_never_world_writable(tmp_path, umask, mode):
    from flowrl.launch import claim_out_dir, no_world_write

    outer = os.umask(umask)
    try:
        previous = no_world_write()
        try:
            out = tmp_path / "runs" / "a"
            assert claim_out_dir(out, overwrite=False)
            (out / "checkpoints").mkdir()
            (out / "metrics.jsonl").write_text("")
        finally:
            os.umask(previous)
        assert previous == umask and os.umask(umask) == umask  # restored
    finally:
        os.umask(outer)
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert stat.S_IMODE((out / "checkpoints").stat().st_mode) == mode
    assert stat.S_IMODE((out / "metrics.jsonl").stat().st_mode) == mode & 0o666
