"""The simulator is bounded whatever the numbers (issue 32): a generate call past
:data:`~flowrl.cost.sim.SIM_REQUESTS` requests or :data:`~flowrl.cost.sim.SIM_REPLICAS`
replicas is simulated at scale, and the scaled estimate is the exact one's (compared with the
exact simulation of the same spec, computed here with the caps lifted)."""

from __future__ import annotations

import pytest

from flowrl.cost import sim
from flowrl.cost.sim import GenPhase, LengthDist, Phase, SimSpec, scaled, simulate


def _spec(samples: int, replicas: int, slots: int, over_provision: float = 1.0) -> SimSpec:
    gen = GenPhase(replicas=replicas, gpus_per_replica=1, concurrency=slots, iter_s=0.01, prefill_s=1e-4,
                   samples=samples, prompt_tokens=8, seq_s=5e-4, request_s=2e-4,
                   lengths=LengthDist("lognormal", median=50, sigma=1.0, cap=400))
    return SimSpec(phases=(Phase("gen", "generate", "gpu", (), gen=gen),
                           Phase("update", "work", "gpu", ("gen",), seconds=0.5, per_token_s=1e-5, tokens_from="gen"),
                           Phase("resync", "resync", "gpu", ("update",), seconds=0.1, block_s=0.1, gates=("gen",))),
                   lanes={"gpu": replicas}, over_provision=over_provision, recycle=over_provision > 1)


@pytest.mark.parametrize("samples, replicas, slots, over_provision", [
    (30_000, 8, 64, 1.0),  # many requests a replica
    (30_000, 128, 16, 1.0),  # many replicas
    (30_000, 2, 4, 1.0),  # fewer slots than the scale: one slot left, the duration scaled
    (20_000, 8, 256, 1.3),  # partial rollout, recycled requests
])
def test_a_scaled_simulation_estimates_what_the_exact_one_does(monkeypatch, samples, replicas, slots,
                                                                over_provision):
    spec = _spec(samples, replicas, slots, over_provision)
    assert scaled(spec.phases[0].gen, over_provision)[0] is not spec.phases[0].gen  # the caps apply
    approx = simulate(spec, steps=6)
    monkeypatch.setattr(sim, "SIM_REQUESTS", 10**9)
    monkeypatch.setattr(sim, "SIM_REPLICAS", 10**9)
    exact = simulate(spec, steps=6)
    assert approx.step_s == pytest.approx(exact.step_s, rel=0.05)
    assert approx.tokens_per_s == pytest.approx(exact.tokens_per_s, rel=0.05)
    assert approx.samples_per_s == pytest.approx(exact.samples_per_s, rel=0.05)
    assert approx.bubble == pytest.approx(exact.bubble, abs=0.05)


def test_any_size_is_simulated_from_a_bounded_sample():
    """2^40 prompts x 2^40 samples each on 10^6 replicas of 2^40 slots: the same few thousand requests."""
    spec = _spec(2**80, 10**6, 2**40)
    small, work, time, busy = scaled(spec.phases[0].gen)
    assert small.samples <= sim.SIM_REQUESTS and small.replicas <= sim.SIM_REPLICAS
    assert work * small.samples == pytest.approx(2**80)
    r = simulate(spec, steps=4)
    assert r.step_s > 0 and 0 <= r.bubble <= 1


def test_staleness_past_the_steps_simulated_keeps_no_more_in_flight():
    spec = _spec(64, 2, 8)
    deep = SimSpec(spec.phases, spec.lanes, staleness=10**9)
    r = simulate(deep, steps=5)
    assert len(r.step_ends) == 5
