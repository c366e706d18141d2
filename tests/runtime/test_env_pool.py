"""The environment pool on a real (local) Ray: calls run concurrently, and an environment that raises,
returns garbage, hangs past its timeout or kills its worker ends its own episode (with the error
recorded) while the pool keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.plan import EnvPlan
from flowrl.runtime.env_pool import EnvPool

ENVS = Path(__file__).resolve().parents[1] / "envs"
ORIGIN = f"{ENVS / 'x.flow'}:1:1"  # the flow file's folder is where `loop_envs` is found


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():  # the tests' shared instance (e2e_kit.shared_ray): these pools run on one CPU
        ray.shutdown()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _pool(cls: str, timeout: float = 10.0, workers: int = 1) -> EnvPool:
    return EnvPool(EnvPlan("tool", "python_env", {"target": f"loop_envs:{cls}", "timeout": timeout,
                                                  "workers": workers}, ORIGIN))


def test_user_errors_end_their_episode_only(ray_local):
    pool = _pool("Crashy")
    out = pool.step([("a", {"prompt": "RAISE"}, "t"), ("b", {"prompt": "BAD"}, "t"), ("c", {"prompt": "ok"}, "hi")])
    assert out[0].error == "RuntimeError: boom" and out[0].done
    assert "EnvProtocolError" in out[1].error and "got dict" in out[1].error
    assert (out[2].error, out[2].observation, out[2].done) == (None, "seen hi", False)
    again = pool.step([("c", {"prompt": "ok"}, "more")])  # same episode: its environment, not a fresh reset
    assert again[0].observation == "seen more" and pool.restarts == 0
    pool.close()


def test_what_an_environment_prints_comes_back_with_its_call(ray_local):
    """Each call's own output (its thread's writes), for the runtime to log redacted, never the terminal."""
    pool = _pool("Chatty")
    out = pool.step([("a", {"prompt": "x"}, "t1"), ("b", {"prompt": "RAISE"}, "t2")])
    assert out[0].output == "env x got t1\nto stderr\n" and out[0].error is None
    assert out[1].output == "env RAISE got t2\nto stderr\n" and out[1].error == "RuntimeError: boom"
    pool.close()


def test_a_worker_killed_under_its_episodes_replays_them_and_loses_nothing(ray_local, tmp_path):
    """SIGKILL of the worker mid-call (from outside, as an operator or the OOM killer would): a fresh
    worker replays every episode it hosted (reset, then the earlier turns) and the calls are made
    again; the outcomes say so (issue 14)."""
    marker = tmp_path / "killed"
    pool = _pool("Counter")
    first = pool.step([("a", {"prompt": "count"}, "x"), ("b", {"prompt": "count"}, "y")])
    assert [o.observation for o in first] == ["1 x", "1 y"]
    out = pool.step([("a", None, f"KILL:{marker}"), ("b", None, "z")])  # the call of `a` kills the worker
    assert marker.exists() and pool.restarts == 1
    assert [(o.error, o.observation) for o in out] == [(None, f"2 KILL:{marker}"), (None, "2 z")]
    assert "replayed on a fresh worker (1 earlier turn(s))" in out[0].recovered
    later = pool.step([("a", None, "w"), ("b", None, "w")])  # their environments live on the fresh worker
    assert [o.observation for o in later] == ["3 w", "3 w"] and all(o.recovered is None for o in later)
    pool.close()


def test_an_episode_that_kills_its_worker_twice_ends_and_the_pool_goes_on(ray_local):
    pool = _pool("Crashy")
    assert pool.step([("ok", {"prompt": "ok"}, "x")])[0].error is None
    out = pool.step([("exit", {"prompt": "EXIT"}, "x")])  # replayed once, killed the fresh worker too
    assert "worker died" in out[0].error and pool.restarts == 2
    kept = pool.step([("ok", None, "y")])[0]  # the other episode was replayed both times
    assert (kept.error, kept.observation) == (None, "seen y")
    assert pool.step([("new", {"prompt": "ok"}, "z")])[0].observation == "seen z"  # the pool goes on
    pool.close()


def test_a_call_past_its_timeout_ends_its_episode(ray_local):
    pool = _pool("TwoToolCalls", timeout=2.0)
    out = pool.step([("hang", {"prompt": "HANG"}, "x"), ("fine", {"prompt": "1+1="}, "x")])
    assert "longer than its timeout of 2s" in out[0].error
    assert out[1].error is None and out[1].observation == "+="  # finished before the deadline
    assert pool.restarts == 1
    assert "restarted" in pool.step([("fine", None, "x")])[0].error  # it lived on the replaced worker
    assert pool.step([("next", {"prompt": "2+2="}, "x")])[0].observation == "+="
    pool.close()


def test_calls_of_one_worker_run_concurrently(ray_local):
    pool = _pool("Rendezvous")  # each step waits until 4 steps run at once: serialized calls would fail
    out = pool.step([(f"e{i}", {"prompt": "p"}, "x") for i in range(4)])
    assert [o.error for o in out] == [None] * 4 and all(o.done for o in out)
    pool.close()


def test_an_environment_that_cannot_start_is_a_clear_error(ray_local):
    from flowrl.runtime.errors import RuntimeFlowError

    with pytest.raises(RuntimeFlowError, match=r"environment `tool` \(`loop_envs:Nope`\) could not start"):
        _pool("Nope")
