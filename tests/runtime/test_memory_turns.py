"""Colocated engines take turns where the plan says they release memory, and only there.

:class:`~flowrl.runtime.fleet.MemoryTurns` issues the calls (recorded here instead of reaching Ray):
before a generation the trainers on the rollout engine's GPUs offload and the rollout engine wakes;
before a train-engine call the rollout engine sleeps and the trainer reloads; a resync wakes the
rollout engine's weights only, its KV cache coming back at the next generation. A plan that releases
nothing (the ``cpu`` platform) makes no call at all.
"""

from __future__ import annotations

from flowrl.plan import EnginePlan, ExecutionPlan, ModelPlan, RunPlan
from flowrl.runtime.fleet import MemoryTurns


def _plan(releases: bool, rollout_gpus=(0, 1)) -> ExecutionPlan:
    train = EnginePlan("fsdp", "train", dp=2, gpus=(0, 1), releases="offload" if releases else "")
    rollout = EnginePlan("vllm", "rollout", dp=2, gpus=rollout_gpus, releases="sleep" if releases else "")
    ref = EnginePlan("fsdp", "train", dp=2, gpus=(0, 1), releases="offload" if releases else "")
    models = (ModelPlan("policy", "hf", {}, "trainable", None, train, rollout, {}, "f.flow:1:1"),
              ModelPlan("ref", "frozen", {}, "frozen", "policy", ref, None, {}, "f.flow:2:1"))
    return ExecutionPlan("main", "f.flow", {"nodes": 1, "gpus_per_node": 2}, (), models, (), (), (), (), 1, RunPlan())


def _turns(plan):
    calls = []
    return MemoryTurns(plan, lambda name, method, step, *args: calls.append((name, method, *args))), calls


def test_colocated_engines_take_turns_on_gpus():
    turns, calls = _turns(_plan(releases=True))
    turns.before_generate("policy", 0)
    assert calls == [("policy.train", "offload"), ("ref.train", "offload")]  # the rollout engine starts awake
    calls.clear()
    turns.before_train("ref", 0)  # the reference's log-probs
    assert calls == [("policy.rollout", "sleep"), ("ref.train", "reload")]
    calls.clear()
    turns.before_train("policy", 0)  # the update: the rollout engine already sleeps
    assert calls == [("policy.train", "reload")]
    calls.clear()
    turns.before_resync("policy", 0)
    assert calls == [("policy.rollout", "wake_up", ["weights"])]  # the trainer still holds its memory
    calls.clear()
    turns.before_generate("policy", 1)
    assert calls == [("policy.train", "offload"), ("ref.train", "offload"), ("policy.rollout", "wake_up",
                                                                              ["kv_cache"])]
    calls.clear()
    turns.before_generate("policy", 1)  # nothing changed hands since: no call
    assert calls == []


def test_resident_engines_are_never_called():
    turns, calls = _turns(_plan(releases=False))
    for step in range(2):
        turns.before_generate("policy", step)
        turns.before_train("ref", step)
        turns.before_train("policy", step)
        turns.before_resync("policy", step)
    assert calls == []


def test_engines_on_other_gpus_do_not_take_turns():
    turns, calls = _turns(_plan(releases=True, rollout_gpus=(2, 3)))
    turns.before_generate("policy", 0)
    turns.before_train("policy", 0)
    assert calls == []
