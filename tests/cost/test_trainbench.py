"""What a train engine achieves on this machine (flowrl.cost.trainbench): the profile's mfu figures and the
fixed cost of a micro-batch, timed on the real torch engine."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from flowrl.catalog.models import tiny_facts
from flowrl.cost import trainbench
from flowrl.cost.model import forward_s, train_s
from flowrl.cost.profiles import CPU_FALLBACK


def test_the_figures_give_back_the_seconds_they_were_measured_from():
    # seconds per pass of the tiny model at 16 and 128 rows: the cost model, fed the figures, charges
    # those seconds again (less its per-op dispatch, which the engine's own timing does not include)
    facts = tiny_facts({"task": trainbench.TASK})
    forward, train = {16: 0.004, 128: 0.025}, {16: 0.012, 128: 0.060}
    figures = trainbench.rates(forward, train, facts.active_params, 0.2)
    prof = replace(CPU_FALLBACK, **figures, tflops=0.2, op_overhead_s=0.0)
    for rows in (16, 128):
        tokens = rows * trainbench.WIDTH
        assert train_s(facts, prof, kind="torch", tp=1, pp=1, dp=1, cp=1, tokens=tokens) == pytest.approx(
            train[rows], rel=0.01)
        slope = (forward[128] - forward[16]) / (112 * trainbench.WIDTH)
        assert forward_s(facts, prof, world=1, tokens=tokens) == pytest.approx(slope * tokens, rel=0.01)


def test_a_slower_machine_has_lower_figures_and_none_leaves_its_range():
    params = tiny_facts({"task": trainbench.TASK}).active_params
    fast = trainbench.rates({16: 0.004, 128: 0.025}, {16: 0.012, 128: 0.060}, params, 0.2)
    slow = trainbench.rates({16: 0.008, 128: 0.050}, {16: 0.024, 128: 0.120}, params, 0.2)
    assert slow["mfu_forward"] == pytest.approx(fast["mfu_forward"] / 2, rel=0.01)
    assert slow["mfu_train"] == pytest.approx(fast["mfu_train"] / 2, rel=0.01)
    # timing noise can make the larger batch no slower, or the line cross zero above the origin
    odd = trainbench.rates({16: 0.004, 128: 0.004}, {16: 0.001, 128: 0.060}, params, 0.2)
    assert 0 < odd["mfu_forward"] <= 1 and 0 < odd["mfu_train"] <= 1 and odd["micro_overhead_s"] == 0.0


def test_engine_threads_share_the_cores_among_the_engines_of_a_node():
    assert [trainbench.engine_threads(n) for n in (1, 2, 16)] == [1, 1, 8]


def test_the_real_engine_is_timed_on_each_batch_size(monkeypatch):
    # what the figures are timed on: the torch engine's log-prob pass and a one-micro-batch update, at
    # each of ROWS (which pass is slower is the machine's business, and never asserted: a test comparing
    # two timed passes failed on a busy machine). The timer is replaced by one run of each pass.
    ran = []

    def once(fn, repeat):
        ran.append(fn())
        return float(len(ran))

    monkeypatch.setattr(trainbench, "_median", once)
    forward, train = trainbench._time_passes(repeat=3)
    small, large = trainbench.ROWS
    assert set(forward) == set(train) == {small, large}
    assert sorted([*forward.values(), *train.values()]) == [1.0, 2.0, 3.0, 4.0]  # each pass timed once
    for rows, (logprobs, stats) in zip(trainbench.ROWS, zip(ran[::2], ran[1::2])):
        assert tuple(logprobs["logprobs"].shape) == (rows, trainbench.WIDTH)
        assert logprobs["logprobs"].isfinite().all() and (logprobs["logprobs"] <= 0).all()
        assert math.isfinite(stats["loss"]) and stats["loss"] != 0.0  # a real update ran


def test_engine_rates_turns_the_timed_seconds_into_figures_at_an_engines_threads(monkeypatch):
    import torch

    timed = ({16: 0.004, 128: 0.025}, {16: 0.012, 128: 0.060})
    seen = []
    monkeypatch.setattr(trainbench, "_time_passes", lambda repeat: seen.append(torch.get_num_threads()) or timed)
    before = torch.get_num_threads()
    figures = trainbench.engine_rates(0.2, threads=1)
    params = tiny_facts({"task": trainbench.TASK}).active_params
    assert figures == trainbench.rates(*timed, params, 0.2)
    assert seen == [1] and torch.get_num_threads() == before  # timed at one engine's share, then restored
