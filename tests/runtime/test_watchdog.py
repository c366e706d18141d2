"""The watchdog's rule (:mod:`flowrl.runtime.watchdog`): deadlines from measured call times, its
setting, and the one-line message a hung engine stops the run with. No Ray: the end-to-end case
(a generate that never returns) is ``test_watchdog_e2e.py``."""

import pytest

from flowrl.plan import OpPlan
from flowrl.runtime.errors import RuntimeFlowError, user_error
from flowrl.runtime.watchdog import ENV_VAR, Deadlines, EngineHung, Watchdog, WatchdogSettings


def test_first_call_gets_the_warm_up_deadline_then_factor_times_the_slowest_above_the_floor():
    d = Deadlines(WatchdogSettings(first_s=900, floor_s=60, factor=10))
    assert d.deadline("policy.rollout", "generate") == 900  # nothing measured: warm-up, compilation
    d.record("policy.rollout", "generate", 2.0)
    assert d.deadline("policy.rollout", "generate") == 60  # 10 x 2 s is under the floor
    d.record("policy.rollout", "generate", 30.0)
    d.record("policy.rollout", "generate", 7.0)  # a faster call does not lower it: the slowest counts
    assert d.deadline("policy.rollout", "generate") == 300
    assert d.measured("policy.rollout", "generate") == "3 earlier call(s), the slowest 30.0 s"


def test_each_engine_and_call_is_measured_on_its_own():
    d = Deadlines(WatchdogSettings(first_s=900, floor_s=1, factor=2))
    d.record("policy.rollout", "generate", 50.0)
    d.record("policy.train", "train", 5.0)
    assert d.deadline("policy.train", "train") == 10
    assert d.deadline("policy.train", "forward") == 900  # train's times say nothing about forward's
    assert d.deadline("critic.rollout", "generate") == 900


def test_the_defaults_are_the_documented_numbers():
    s = WatchdogSettings()
    assert (s.first_s, s.floor_s, s.factor, s.enabled) == (1800.0, 600.0, 10.0, True)


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "first=120, factor=4")
    assert WatchdogSettings.from_env() == WatchdogSettings(first_s=120, floor_s=600, factor=4)
    monkeypatch.setenv(ENV_VAR, "off")
    assert Deadlines(WatchdogSettings.from_env()).deadline("policy.train", "train") is None
    monkeypatch.delenv(ENV_VAR)
    assert WatchdogSettings.from_env() == WatchdogSettings()


@pytest.mark.parametrize("text", ["floor=0", "factor=-1", "first", "first=abc", "timeout=10"])
def test_a_bad_setting_is_refused_naming_it(text):
    with pytest.raises(RuntimeFlowError, match=rf"{ENV_VAR}=.*cannot read .*hint: write `first=1800,floor=600"):
        WatchdogSettings.parse(text)


def test_the_message_names_engine_call_op_step_times_and_resume():
    hung = EngineHung("policy.rollout", "replica 1", "generate", 4, 31.57, "the deadline max(...)",
                      "2 earlier call(s), the slowest 3.1 s", "`flowrl run --resume /r` continues from its "
                      "checkpoint of step 4")
    op = OpPlan("grpo.rollouts", "generate", "generate", {}, {}, "policy", "rollout", ("samples",), "f.flow:12:3")
    with_op = hung.during(op)
    message = user_error(with_op)
    assert message == str(with_op) and "\n" not in message  # one line
    assert message.startswith("watchdog: engine `policy.rollout` (replica 1) did not finish `generate` of op "
                              "`grpo.rollouts` (f.flow:12:3) at step 5 within 31.6 s"), message
    assert "2 earlier call(s), the slowest 3.1 s" in message
    assert "`flowrl run --resume /r` continues from its checkpoint of step 4" in message
    assert with_op.during(OpPlan("x", "update", "update", {}, {}, "policy", "train", (), "g:1:1")) is with_op


def test_waiting_without_a_deadline_never_raises(monkeypatch):
    """``off`` hands the refs to ray.get unchanged (here a stand-in module: no Ray started)."""
    import sys
    import types

    fake = types.SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:]),
                                 get=lambda refs: [f"got {r}" for r in refs] if isinstance(refs, list) else None)
    monkeypatch.setitem(sys.modules, "ray", fake)
    dog = Watchdog(WatchdogSettings(enabled=False))
    assert dog.wait(["a", "b"], "policy.train", "train", 0, ["x", "y"], "") == ["got a", "got b"]


def test_a_call_past_its_deadline_raises_naming_the_pending_actors(monkeypatch):
    import sys
    import types

    # replica 0 answers, replica 1 never does: Ray's wait times out with it pending
    fake = types.SimpleNamespace(wait=lambda refs, num_returns, timeout: (
        ([r for r in refs if r == "r0"][:1], [r for r in refs if r != "r0"]) if "r0" in refs else ([], refs)),
        get=lambda refs: None)
    monkeypatch.setitem(sys.modules, "ray", fake)
    dog = Watchdog(WatchdogSettings(first_s=5, floor_s=1, factor=3))
    dog.deadlines.record("policy.rollout", "generate", 2.0)
    with pytest.raises(EngineHung) as info:
        dog.wait(["r0", "r1"], "policy.rollout", "generate", 1, ["replica 0", "replica 1"], "no checkpoint")
    message = str(info.value)
    assert "engine `policy.rollout` (replica 1) did not finish `generate` at step 2" in message
    assert "factor=3 x the slowest earlier call" in message and "the slowest 2.0 s" in message
    assert dog.deadlines.count[("policy.rollout", "generate")] == 1  # the hung call is not a measurement


def test_an_actor_that_died_is_named_and_a_failed_constructor_keeps_its_own_error(monkeypatch):
    """Ray's actor errors (a stand-in module: no Ray started): a death becomes EngineDied naming the replica
    and Ray's reason; an actor whose constructor raised is the user's error and passes unchanged."""
    import sys
    import types

    from flowrl.runtime.watchdog import EngineDied

    class RayActorError(Exception):
        def __init__(self, text, init_failed=False):
            super().__init__(text)
            self.actor_init_failed = init_failed

    errors = {"r1": RayActorError("The actor died unexpectedly before finishing this task.\n\tpid: 9\n"
                                  "The actor is dead because its worker process has died.")}

    def get(refs, timeout=None):
        for r in refs if isinstance(refs, list) else [refs]:
            if r in errors:
                raise errors[r]
        return [f"got {r}" for r in refs] if isinstance(refs, list) else None

    class OutOfMemoryError(Exception):  # Ray's: not a RayActorError
        pass

    class RayTaskError(Exception):  # Ray's: a task's own exception, as ``cause``
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    fake = types.SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:]), get=get,
                                 exceptions=types.SimpleNamespace(RayActorError=RayActorError, RayTaskError=RayTaskError,
                                                                  OutOfMemoryError=OutOfMemoryError))
    monkeypatch.setitem(sys.modules, "ray", fake)
    dog = Watchdog(WatchdogSettings(first_s=5, floor_s=1, factor=3))
    with pytest.raises(EngineDied) as info:
        dog.wait(["r0", "r1"], "policy.rollout", "generate", 3, ["replica 0", "replica 1"], "no checkpoint")
    assert str(info.value).startswith("engine `policy.rollout` (replica 1) died during `generate` at step 4: "
                                      "The actor is dead because its worker process has died; "), str(info.value)
    # killed by Ray's memory monitor (measured: grpo_megatron_8gpu.flow on a 23 GB machine shared with other runs)
    errors["r1"] = OutOfMemoryError("2 worker(s) were killed due to the node running low on memory. Memory on the "
                                    "node (IP: 10.0.0.2, ID: f94b) was 22.42GB used / 23.54GB limit (0.952223)\n"
                                    "OOM kill reason: Memory usage exceeded threshold")
    with pytest.raises(EngineDied) as info:
        dog.wait(["r0", "r1"], "policy.train", "update", 0, ["rank 0", "rank 1"], "no checkpoint")
    assert str(info.value).startswith("engine `policy.train` (rank 1) died during `update` at step 1: 2 worker(s) "
                                      "were killed due to the node running low on memory"), str(info.value)
    assert "Ray's memory monitor killed it" in str(info.value)
    errors["r1"] = RayActorError("The actor died because of an error raised in its creation task", init_failed=True)
    with pytest.raises(RayActorError):
        dog.wait(["r0", "r1"], "policy.rollout", "start", 0, ["replica 0", "replica 1"], "no checkpoint")


def test_a_dead_rank_process_is_the_engine_s_death_and_other_task_errors_pass(monkeypatch):
    """A train engine with several ranks raises RankProcessError naming the dead rank processes (killed,
    out of memory): that is EngineDied (which --restarts restarts); any other error of a task passes."""
    import pickle
    import sys
    import types

    from flowrl.engines.fsdp import FsdpRankError
    from flowrl.runtime.watchdog import EngineDied

    dead = pickle.loads(pickle.dumps(FsdpRankError("fsdp rank process died during train (fsdp-rank1 exit code -9); "
                                                   "the engine was stopped", "", ("fsdp-rank1",))))
    assert dead.dead_ranks == ("fsdp-rank1",)  # what crosses Ray's pickling

    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    raised = {}

    def get(refs, timeout=None):
        raise raised["error"]

    class Never(Exception):
        pass

    fake = types.SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs, []), get=get,
                                 exceptions=types.SimpleNamespace(RayActorError=Never, RayTaskError=RayTaskError,
                                                                  OutOfMemoryError=Never))
    monkeypatch.setitem(sys.modules, "ray", fake)
    dog = Watchdog(WatchdogSettings(first_s=5, floor_s=1, factor=3))
    raised["error"] = RayTaskError(dead)
    with pytest.raises(EngineDied) as info:
        dog.wait(["r0"], "policy.train", "train", 2, ["train actor"], "no checkpoint")
    assert str(info.value).startswith("engine `policy.train` (train actor: fsdp-rank1) died during `train` at step 3: "
                                      "fsdp rank process died during train (fsdp-rank1 exit code -9)"), str(info.value)
    raised["error"] = RayTaskError(FsdpRankError("fsdp rank 0 failed in train: ValueError: bad batch"))
    with pytest.raises(RayTaskError):  # a rank that raised: not a death
        dog.wait(["r0"], "policy.train", "train", 2, ["train actor"], "no checkpoint")
