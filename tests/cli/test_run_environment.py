"""A run changes the process environment only while it lasts (``launch.run_environment``): a notebook,
a test or a benchmark that calls ``run_file`` keeps its own environment, and so do the processes it
starts afterwards (a Ray node started after a run used to inherit ``RAY_AUTH_MODE=token`` and, on a
cluster without authentication, registered but took no work)."""

from __future__ import annotations

import os

import pytest

from flowrl.launch import QUIET_ENV, run_environment


def test_a_local_run_sets_token_mode_and_the_quiet_settings_only_while_it_lasts(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    key = next(iter(QUIET_ENV))
    monkeypatch.delenv(key, raising=False)
    with run_environment(None):
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ[key] == QUIET_ENV[key]
    assert "RAY_AUTH_MODE" not in os.environ and key not in os.environ


def test_what_the_user_set_is_kept_and_restored_after_a_failure(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    key = next(iter(QUIET_ENV))
    monkeypatch.setenv(key, "mine")
    with pytest.raises(RuntimeError, match="engine died"):
        with run_environment("127.0.0.1:6379"):
            assert os.environ["RAY_AUTH_MODE"] == "disabled" and os.environ[key] == "mine"
            os.environ["RAY_AUTH_MODE"] = "token"  # whatever happens inside, the caller's values come back
            raise RuntimeError("engine died")
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and os.environ[key] == "mine"
