"""Engine faults and ``flowrl run --restarts N`` without Ray: the one-line message of an engine that died,
and the restart loop of :func:`flowrl.launch.run_built` (each attempt stood in by a function here). The
end-to-end case (``kill -9`` of the vLLM actor mid-step, restarted, the undisturbed run's metrics) is
``test_e2e.py::test_a_rollout_engine_killed_mid_step_is_restarted_from_the_checkpoint``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from flowrl import launch
from flowrl.plan import OpPlan
from flowrl.runtime.checkpoints import MANIFEST
from flowrl.runtime.errors import EngineFault, user_error
from flowrl.runtime.watchdog import EngineDied, EngineHung, SyncBroken, died_cause

OP = OpPlan("grpo.rollouts", "generate", "generate", {}, {}, "policy", "rollout", ("samples",), "f.flow:12:3")

RAY_KILLED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutWorker\n"
              "\tactor_id: 5c1d\n\tpid: 4242\n\tip: 127.0.0.1\nThe actor is dead because its worker process has "
              "died. Worker exit type: UNEXPECTED_SYSTEM_EXIT Worker exit detail: Worker unexpectedly exits")
RAY_NODE_LOST = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainWorker\n"
                 "The actor died because its node has died. Node Id: 3f2a1c0d99")


def test_ray_s_reason_is_kept_in_one_line_without_its_attribute_lines():
    assert died_cause(RuntimeError(RAY_KILLED)).startswith("The actor is dead because its worker process has died.")
    assert died_cause(RuntimeError(RAY_NODE_LOST)) == "The actor died because its node has died. Node Id: 3f2a1c0d99"
    assert died_cause(RuntimeError("")) == "RuntimeError"
    assert len(died_cause(RuntimeError("x" * 1000))) == 300


def test_a_dead_engine_is_named_with_its_node_op_step_and_what_to_do():
    died = EngineDied("policy.rollout", "replica 1", "generate", 4, died_cause(RuntimeError(RAY_NODE_LOST)),
                      "`flowrl run --resume /r` continues from its checkpoint of step 4",
                      node="plan node 1 (Ray node 3f2a1c0d, also running ref.train rank 0)")
    with_op = died.during(OP)
    message = user_error(with_op)
    assert message == str(with_op) and "\n" not in message
    assert message.startswith("engine `policy.rollout` (replica 1) on plan node 1 (Ray node 3f2a1c0d, also running "
                              "ref.train rank 0) died during `generate` of op `grpo.rollouts` (f.flow:12:3) at "
                              "step 5: The actor died because its node has died."), message
    assert "`flowrl run --resume /r` continues from its checkpoint of step 4" in message
    assert message.endswith("`flowrl run --restarts N` restarts the engines from the last checkpoint by itself")
    assert with_op.during(OP) is with_op and isinstance(with_op, EngineFault)


def test_a_broken_sync_group_is_an_engine_fault_naming_what_each_end_said():
    broken = SyncBroken("policy", "broadcast", 3, "the sender: broadcast: transport failed on rank 0: Connection "
                        "closed by peer; replica 0: broadcast: the group is unusable on rank 1 (closed)",
                        "`flowrl run --resume /r` continues from its checkpoint of step 2")
    resync = OpPlan("resync.policy", "resync", "resync", {}, {}, "policy", None, (), "f.flow:30:3")
    message = user_error(broken.during(resync))
    assert message.startswith("the `broadcast` weight sync of `policy` of op `resync.policy` (f.flow:30:3) broke at "
                              "step 4, every end alive: the sender: broadcast: transport failed on rank 0"), message
    assert "; replica 0: broadcast: the group is unusable on rank 1 (closed); the run stopped" in message
    assert message.endswith("`flowrl run --restarts N` restarts the engines from the last checkpoint by itself")
    assert isinstance(broken, EngineFault) and "\n" not in message


def _plan():
    """A real plan (the arithmetic GRPO flow, compiled): the loop only hands it on."""
    return launch.build_plan(str(Path(__file__).resolve().parents[2] / "flows" / "arith_grpo.flow"), steps=4)


def _attempts(tmp_path, monkeypatch, outcomes: list):
    """Stand-in attempts: each takes the next outcome (an exception to raise, or a result), writing a
    checkpoint of step 2 on its way when the outcome says so; returns the calls' keyword arguments."""
    calls = []

    def attempt(plan, out_dir, **kw):
        calls.append(kw)
        outcome = outcomes.pop(0)
        if isinstance(outcome, tuple):  # (checkpoint step, exception)
            step, outcome = outcome
            ckpt = out_dir / "checkpoints" / f"step_{step:06d}"
            ckpt.mkdir(parents=True)
            (ckpt / MANIFEST).write_text(json.dumps({"files": {}}))  # complete, as far as the loop asks
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(launch, "_run_attempt", attempt)
    return calls


def _hung() -> EngineHung:
    return EngineHung("policy.train", "train actor", "train", 2, 61.0, "rule", "measured", "resume")


def test_restarts_resume_from_the_last_checkpoint_and_faults_go_to_the_first_attempt_only(tmp_path, monkeypatch):
    calls = _attempts(tmp_path, monkeypatch, [(2, _hung()), "done"])
    said = io.StringIO()
    assert launch.run_built(_plan(), tmp_path, faults="injected", stream=said, restarts=2) == "done"
    assert [(c["resume"], c["faults"]) for c in calls] == [(False, "injected"), (True, None)]
    line = said.getvalue().strip()
    assert line.startswith("flowrl: restart 1 of 2: watchdog: engine `policy.train` (train actor) did not finish")
    assert line.endswith("the engines start again from its checkpoint of step 2"), line


def test_without_a_checkpoint_the_engines_start_again_from_the_beginning(tmp_path, monkeypatch):
    died = EngineDied("policy.rollout", "replica 0", "generate", 0, "killed", "no checkpoint")
    calls = _attempts(tmp_path, monkeypatch, [died, "done"])
    said = io.StringIO()
    assert launch.run_built(_plan(), tmp_path, stream=said, restarts=1) == "done"
    assert [(c["resume"], c["overwrite"]) for c in calls] == [(False, False), (False, True)]
    assert said.getvalue().strip().endswith("start again from the beginning (no checkpoint yet)")


def test_the_last_fault_past_the_restarts_stops_the_run_and_other_errors_are_never_retried(tmp_path, monkeypatch):
    calls = _attempts(tmp_path, monkeypatch, [_hung(), _hung()])
    with pytest.raises(EngineHung):
        launch.run_built(_plan(), tmp_path, stream=io.StringIO(), restarts=1)
    assert len(calls) == 2
    calls = _attempts(tmp_path, monkeypatch, [ValueError("a bug"), "never"])
    with pytest.raises(ValueError):
        launch.run_built(_plan(), tmp_path, stream=io.StringIO(), restarts=3)
    assert len(calls) == 1  # only engine faults are restarted: a bug or a flow error would fail again
    with pytest.raises(launch.RunError, match=r"--restarts -1: give how many times"):
        launch.run_built(_plan(), tmp_path, restarts=-1)
