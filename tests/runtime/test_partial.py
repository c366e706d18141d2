"""Partial rollout: the buffer's step loop with a fake engine (no Ray), and the plan -> runtime rules.

The fake engine is deterministic: a prompt whose first token is L generates tokens until
its response has L tokens, then stops (EOS), so each test knows exactly which groups
finish in which round. An end-to-end run through Ray and vLLM is in test_placement_e2e.py.
"""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import pytest

from flowrl.engines.types import Completion
from flowrl.runtime.partial import (PartialRollout, PartialRolloutError, partial_buffers, producer_depth,
                                    recycles)

EOS = 0


class FakeEngine:
    """Prompt [L, ...]: the response is 1, 2, 3, ... and ends with EOS once it has L tokens."""

    def __init__(self):
        self.version = 0
        self.calls: list[tuple[int, int, int]] = []  # (requests, max_tokens, round)

    def __call__(self, prompts, max_tokens, index):
        self.calls.append((len(prompts), max_tokens, index))
        out = []
        for p in prompts:
            length, done = p[0], len(p) - 2  # prompts are [L, key] + tokens so far
            new = []
            while len(new) < max_tokens and done + len(new) < length:
                new.append(done + len(new) + 1)
            reason = "length"
            if done + len(new) >= length and len(new) < max_tokens:
                new.append(EOS)
                reason = "stop"
            out.append(Completion(tuple(p), tuple(new), tuple(-0.5 for _ in new), reason, "x" * len(new)))
        return out, self.version


def prompts(lengths, start=0):
    return [([length, start + i], {"answers": f"a{start + i}", "prompt_ids": [length, start + i]})
            for i, length in enumerate(lengths)]


def test_stops_at_the_target_and_recycles_the_unfinished():
    engine = FakeEngine()
    buf = PartialRollout(over_provision=1.5, max_carry=1)
    drawn = []

    def draw():
        batch = prompts([2, 30, 30, 30], start=100 + 4 * len(drawn))
        drawn.append(batch)
        return batch

    # max_tokens 16, 4 rounds -> chunks of 4 tokens; short prompts (length 2, 3) finish in round 0
    step = buf.run(0, prompts([2, 3, 30, 30]), n=2, max_tokens=16, draw=draw, generate=engine)
    assert len(step.groups) == 4 and all(g.done for g in step.groups)
    assert step.metrics["partial/over_provisioned"] == 2  # ceil(4 * 1.5) = 6 groups in flight
    assert len(drawn) == 1  # one extra sample batch; its 2 surplus prompts wait, unstarted
    # round 0 finishes 3 groups (lengths 2, 3, 2); round 1 nothing more (30 > 8 tokens); ...
    # every long one hits max_tokens (16) in round 3; equally old groups are taken in arrival order
    assert [g.fields["answers"] for g in step.groups] == ["a0", "a1", "a2", "a3"]
    assert step.metrics["partial/rounds"] == 4
    # the finished extras (a100 short, a101 long) are carried; a102, a103 wait unstarted
    assert step.metrics["partial/recycled"] == 2 and step.metrics["partial/dropped"] == 0
    assert [len(c.response_ids) for c in step.groups[-1].completions()] == [16, 16]
    assert [c.finish_reason for c in step.groups[-1].completions()] == ["length", "length"]
    assert [(g.fields["answers"], g.started) for g in buf.carried] == [
        ("a100", 0), ("a101", 0), ("a102", None), ("a103", None)]


def test_carried_groups_continue_keep_their_version_and_come_first():
    engine = FakeEngine()
    buf = PartialRollout(over_provision=2.0, max_carry=1)
    # 2 needed, 4 in flight; lengths 1 and 2 finish in round 0 (chunk 4), 12 and 14 do not
    first = buf.run(0, prompts([1, 12]), n=1, max_tokens=16, draw=lambda: prompts([2, 14], start=10),
                    generate=engine)
    assert [g.fields["answers"] for g in first.groups] == ["a0", "a10"]
    assert first.metrics["partial/recycled"] == 2
    partial_tokens = {g.fields["answers"]: list(g.tokens[0]) for g in buf.carried}
    assert partial_tokens == {"a1": [1, 2, 3, 4], "a11": [1, 2, 3, 4]}
    engine.version = 1  # new weights before the next step
    second = buf.run(1, prompts([1, 1], start=20), n=1, max_tokens=16, draw=None, generate=engine)
    # the two fresh ones finish in round 0; the carried ones need 2 more rounds; the target (2) is
    # reached after round 0, so the carried ones are still unfinished and now too old: dropped
    assert [g.fields["answers"] for g in second.groups] == ["a20", "a21"]
    assert second.metrics["partial/dropped"] == 2 and buf.carried == []
    assert [g.version for g in second.groups] == [1, 1]


def test_resumed_group_keeps_its_first_version():
    engine = FakeEngine()
    buf = PartialRollout(over_provision=2.0, max_carry=2)
    buf.run(0, prompts([1]), n=1, max_tokens=8, draw=lambda: prompts([6], start=5), generate=engine)
    (carried,) = buf.carried
    assert carried.version == 0 and carried.tokens[0] == [1, 2]  # chunk = ceil(8 / 4) = 2
    engine.version = 3
    step = buf.run(1, prompts([8], start=9), n=1, max_tokens=8, draw=None, generate=engine)
    # carried (length 6) finishes first and is the oldest: trained at version 0, not 3
    assert step.groups[0].fields["answers"] == "a5" and step.groups[0].version == 0
    assert step.groups[0].tokens[0] == [1, 2, 3, 4, 5, 6, EOS]
    assert step.groups[0].logprobs[0] == [-0.5] * 7
    assert step.metrics["partial/resumed"] == 1


def test_without_recycling_everything_unfinished_is_dropped():
    buf = PartialRollout(over_provision=1.5, max_carry=0)
    step = buf.run(0, prompts([1, 1, 20, 20]), n=2, max_tokens=16, draw=lambda: prompts([20, 20], start=50),
                   generate=FakeEngine())
    assert len(step.groups) == 4
    assert step.metrics["partial/recycled"] == 0 and buf.carried == []
    assert step.metrics["partial/dropped"] == 2


def test_state_round_trip_reproduces_the_next_step():
    def two_steps(restart: bool):
        engine = FakeEngine()
        buf = PartialRollout(over_provision=1.5, max_carry=1)
        buf.run(0, prompts([3, 9, 11, 5]), n=2, max_tokens=12, draw=lambda: prompts([7, 13], start=40),
                generate=engine)
        if restart:
            state = pickle.loads(pickle.dumps(buf.state_dict()))
            buf = PartialRollout(over_provision=1.5, max_carry=1)
            buf.load_state_dict(state)
        step = buf.run(1, prompts([4, 10, 2, 6], start=60), n=2, max_tokens=12,
                       draw=lambda: prompts([8, 8], start=80), generate=engine)
        return [(g.key, g.version, g.started, g.tokens) for g in step.groups], step.metrics, engine.calls

    assert two_steps(restart=True) == two_steps(restart=False)


def test_state_from_other_settings_is_refused():
    state = PartialRollout(over_provision=1.5, max_carry=1).state_dict()
    with pytest.raises(PartialRolloutError, match="over_provision=1.5 differs"):
        PartialRollout(over_provision=2.0, max_carry=1).load_state_dict(state)


def test_bad_settings_are_refused_with_the_values():
    with pytest.raises(PartialRolloutError, match="over_provision=0.5"):
        PartialRollout(over_provision=0.5, max_carry=1)


def test_rounds_split_max_tokens_and_respect_the_last_chunk():
    engine = FakeEngine()
    buf = PartialRollout(over_provision=1.0, max_carry=0, rounds=4)
    buf.run(0, prompts([20]), n=1, max_tokens=10, draw=None, generate=engine)
    # ceil(10 / 4) = 3 tokens per round: 3 + 3 + 3 + 1
    assert [c[1] for c in engine.calls] == [3, 3, 3, 1]


def _plan(staleness, over_provision, recycle):
    pipeline = SimpleNamespace(over_provision=over_provision, recycle=recycle)
    ops = (SimpleNamespace(id="rollouts", kind="generate"), SimpleNamespace(id="batch", kind="sample"))
    return SimpleNamespace(staleness=staleness, pipeline=pipeline, ops=ops)


@pytest.mark.parametrize("s,f,recycle,depth,carry", [
    (1, 1.0, False, 1, None),   # no partial rollout: no buffer
    (2, 1.5, True, 1, 1),       # recycling spends one version: synchronous producer + 1 carried step
    (3, 1.5, True, 2, 1),       # one-step-off overlap + recycling
    (4, 1.25, True, 3, 1),
    (1, 1.5, False, 1, 0),      # recycle = false: unfinished groups are dropped
    (4, 1.5, False, 4, 0),
])
def test_plan_rules_keep_every_sample_within_the_bound(s, f, recycle, depth, carry):
    plan = _plan(s, f, recycle)
    assert producer_depth(plan) == depth
    buffers = partial_buffers(plan)
    if carry is None:
        assert buffers == {} and not recycles(plan)
        return
    assert list(buffers) == ["rollouts"] and buffers["rollouts"].max_carry == carry
    # fresh samples are depth - 1 versions behind; carried ones up to `carry` more: never beyond s - 1
    assert depth - 1 + carry <= s - 1


def test_over_provisioned_count_is_the_ceiling():
    buf = PartialRollout(over_provision=1.25, max_carry=0)
    step = buf.run(0, prompts([1] * 6), n=1, max_tokens=4, draw=lambda: prompts([1] * 6, start=10),
                   generate=FakeEngine())
    assert step.metrics["partial/over_provisioned"] == math.ceil(6 * 1.25) - 6
