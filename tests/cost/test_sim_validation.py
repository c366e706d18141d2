"""The simulator against measured runs: reading runs, calibration, a stored real CPU run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cost_cases import FIXTURES, ROOT, STEP_S

from flowrl.cost import model as cm
from flowrl.compiler import calibrate
from flowrl.cost import validate
from flowrl.cost.profiles import CPU_FALLBACK, Profile, load_profile, save_profile
from flowrl.cost.sim import GenPhase, LengthDist, Phase, SimSpec, simulate, with_workload



def test_measure_run_takes_medians_after_warmup_and_the_dispatch_gap(synthetic_run):
    run = synthetic_run(steps=5, slow_step=2)
    m = validate.measure_run(*validate.read_run(run))
    assert m["steps_used"] == 4  # step 0 is warm-up
    assert m["step_s"] == pytest.approx(STEP_S)  # the 3x slow step does not move the median
    assert m["phases"]["grpo.update"] == pytest.approx(0.200)
    assert m["engine"]["grpo.rollouts"] == pytest.approx(0.290)
    assert m["engine"]["grpo.update"] == pytest.approx(0.190)
    # logprobs/update/generate spans are 10 ms longer than the engine's own: the dispatch
    assert m["dispatch_s"] == pytest.approx(0.010)
    assert m["workload"]["mean_response"] == pytest.approx(3.5)
    assert m["workload"]["seconds"] == {"grpo.scores": pytest.approx(0.002)}


def test_read_run_names_the_directory_and_the_fix(tmp_path):
    with pytest.raises(validate.ValidateError, match=r"cannot read run directory .*nothere.*flowrl run"):
        validate.read_run(tmp_path / "nothere")


def test_measure_run_needs_steps_after_warmup():
    with pytest.raises(validate.ValidateError, match="run at least 3 steps"):
        validate.measure_run({"ops": []}, [{"step": 0, "perf/step_s": 1.0}], [])


def test_length_with_mean_hits_the_mean_and_keeps_shape():
    d = LengthDist("lognormal", median=2.0, sigma=1.0, cap=8)
    m = d.with_mean(3.5)
    assert m.mean() == pytest.approx(3.5, rel=1e-6)
    assert (m.sigma, m.cap, m.kind) == (1.0, 8, "lognormal")
    # a mean near the cap: most responses hit it (the median above the cap); at the cap, all do
    assert d.with_mean(7.5).mean() == pytest.approx(7.5, rel=1e-6) and d.with_mean(7.5).median > 8
    assert d.with_mean(9.0).mean() == pytest.approx(8.0, rel=1e-4)


def _one_gen(overhead: float = 0.0) -> SimSpec:
    gen = GenPhase(replicas=1, gpus_per_replica=1, concurrency=4, iter_s=0.01, prefill_s=0.0, samples=8,
                   prompt_tokens=4, lengths=LengthDist("lognormal", median=4, sigma=0.0, cap=4), overhead_s=overhead)
    return SimSpec((Phase("g", "generate", "gpu", gen=gen, label="generate"),
                    Phase("r", "work", "reward", ("g",), seconds=0.5, label="reward"),
                    Phase("u", "work", "gpu", ("g",), seconds=0.1, label="update")), {"gpu": 1, "reward": 0})


def test_generate_overhead_delays_the_step_by_exactly_it():
    # 8 requests of 4 tokens on 4 slots: two waves of 4 iterations = 0.08 s
    a, b = simulate(_one_gen(0.0), steps=4), simulate(_one_gen(0.05), steps=4)
    assert a.by_phase["g"] == pytest.approx(0.08)
    assert b.by_phase["g"] == pytest.approx(0.13)
    assert b.step_s - a.step_s == pytest.approx(0.05)


def test_with_workload_replaces_sizes_and_measured_seconds():
    spec = with_workload(_one_gen(), prompt_tokens=7.4, mean_response=4.0, seconds={"reward": 0.002})
    g = spec.phases[0].gen
    assert g.prompt_tokens == 7 and g.lengths.median == 4.0
    assert spec.phases[1].seconds == 0.002 and spec.phases[2].seconds == 0.1  # only the named one


def test_resync_pays_one_engine_call_its_ends_go_together():
    """Send and receives are submitted at once (``Fleet.push_weights``): one dispatch overhead, whatever
    the protocol and however many replicas."""
    from flowrl.catalog.protocols import PROTOCOLS

    hw = replace(CPU_FALLBACK, op_overhead_s=0.02)
    assert len({spec.cost for spec in PROTOCOLS.values()}) > 1  # every way a record says its bytes move
    for protocol in PROTOCOLS:
        base = cm.transfer_s(1e6, replace(hw, op_overhead_s=0.0), protocol=protocol, route="local", buckets=1)
        assert cm.transfer_s(1e6, hw, protocol=protocol, route="local", buckets=1) == pytest.approx(base + 0.02)


def test_calibrate_recovers_the_costs_it_was_given(_cost_cpu_profile, test_flow):
    """Make engine times from a profile with known costs; calibrating a different one must find them."""
    flow = test_flow
    prof = load_profile(_cost_cpu_profile)
    true = replace(prof, iter_overhead_s=0.0, seq_overhead_s=1.2e-4, request_overhead_s=0.0, mfu_train=0.55,
                   mfu_forward=0.35)
    save_profile(true, _cost_cpu_profile)
    _, spec, _ = calibrate.compile_spec(flow)
    workload = {"prompt_tokens": 7.0, "mean_response": 3.5}
    iters = validate.generate_iterations(spec, workload)
    gens = {p.id: p.gen for p in spec.phases if p.kind == "generate"}
    engine = {}
    for ph in spec.phases:
        if ph.kind == "generate":
            engine[ph.id] = _gen_seconds(iters[ph.id], ph.gen)
        elif ph.per_token_s > 0:
            g = gens[ph.tokens_from]
            engine[ph.id] = ph.per_token_s * g.samples * (7.0 + 3.5)
    assert {"logprobs", "update"} <= {p.label for p in spec.phases if p.id in engine}
    save_profile(prof, _cost_cpu_profile)  # start from the profile's own (wrong) figures
    measured = {"dispatch_s": 0.0123, "engine": engine, "workload": workload}
    cal = calibrate.calibrate(prof, [(flow, measured)])
    # one run, one batch size: the decode overhead is all per sequence (as in the true profile)
    assert cal.seq_overhead_s == pytest.approx(1.2e-4, rel=1e-3) and cal.iter_overhead_s == 0.0
    assert cal.mfu_train == pytest.approx(0.55, abs=1e-4) and cal.mfu_forward == pytest.approx(0.35, abs=1e-4)
    assert cal.op_overhead_s == pytest.approx(0.0123)
    assert "calibrated from runs of grpo_test.flow" in cal.source
    assert (cal.tflops, cal.hbm_gbs) == (prof.tflops, prof.hbm_gbs)  # measured figures stay


def _gen_seconds(parts, g) -> float:
    """A generate's seconds from generate_iterations' (a, s, n, b) and the phase's own costs."""
    a, s, n, b = parts
    return a * g.iter_s + s * g.seq_s + n * g.request_s + b * g.prefill_s


def test_generate_seconds_are_linear_in_the_decode_costs(_cost_cpu_profile, test_flow):
    """generate_iterations' coefficients reproduce the simulated generate time of any costs."""
    _, spec, _ = calibrate.compile_spec(test_flow)
    workload = {"prompt_tokens": 7.0, "mean_response": 3.5}
    parts = validate.generate_iterations(spec, workload)
    ph = next(p for p in spec.phases if p.kind == "generate")
    a, s, n, b = parts[ph.id]
    assert a >= 5 and s > a and n == ph.gen.samples and b > 0  # one replica, every request, 3.5-token answers
    costs = replace(ph.gen, iter_s=0.003, seq_s=2e-4, request_s=1.5e-4, prefill_s=1e-5, overhead_s=0.0)
    alone = replace(spec, phases=(replace(ph, deps=(), gen=costs), Phase("d", "work", ph.lane, (ph.id,))),
                    staleness=1)
    res = simulate(with_workload(alone, prompt_tokens=7.0, mean_response=3.5), steps=12, seed=0)
    assert res.by_phase[ph.id] == pytest.approx(_gen_seconds(parts[ph.id], costs), rel=1e-3)  # waves: nearly


def test_runs_with_other_response_lengths_separate_per_request_costs(_cost_cpu_profile, tmp_path):
    """Three runs: two batch sizes and one with long answers; calibration finds the fixed cost
    per iteration, the cost per running sequence and the serial cost per request."""
    from cost_cases import TEST_FLOW

    prof = load_profile(_cost_cpu_profile)
    true = replace(prof, iter_overhead_s=0.002, seq_overhead_s=1e-4, request_overhead_s=2e-4)
    runs = []
    for name, batch, tokens, mean in (("big", 64, 8, 3.5), ("small", 16, 8, 3.5), ("long", 16, 16, 14.0)):
        text = TEST_FLOW.replace("{ROOT}", str(ROOT)).replace("batch = 64", f"batch = {batch}")
        text = text.replace("max_tokens = 8", f"max_tokens = {tokens}")
        assert f"max_tokens = {tokens}" in text
        (tmp_path / f"{name}.flow").write_text(text)
        flow = str(tmp_path / f"{name}.flow")
        workload = {"prompt_tokens": 7.0, "mean_response": mean}
        _, spec, _ = calibrate.compile_spec(flow, profile=true)
        iters = validate.generate_iterations(spec, workload)
        engine = {ph.id: _gen_seconds(iters[ph.id], ph.gen) for ph in spec.phases if ph.kind == "generate"}
        runs.append((flow, {"dispatch_s": 0.01, "engine": engine, "workload": workload}))
    cal = calibrate.calibrate(prof, runs)
    assert cal.iter_overhead_s == pytest.approx(0.002, rel=1e-3)
    assert cal.seq_overhead_s == pytest.approx(1e-4, rel=1e-3)
    assert cal.request_overhead_s == pytest.approx(2e-4, rel=1e-3)
    assert "us/request" in cal.source
    # two runs of the same answer length cannot tell per-sequence from per-request costs apart:
    # the per-iteration and per-sequence model is kept
    two = calibrate.calibrate(prof, runs[:2])
    assert two.request_overhead_s == 0.0 and two.seq_overhead_s > 1e-4


def test_decode_iteration_pays_per_sequence():
    from flowrl.catalog.models import tiny_facts

    f, hw = tiny_facts({}), replace(CPU_FALLBACK, iter_overhead_s=0.0, seq_overhead_s=1e-4)
    one = cm.decode_iter_s(f, hw, tp=1, batch=128, context=10)
    two = cm.decode_iter_s(f, hw, tp=1, batch=256, context=10)
    base = cm.decode_iter_s(f, replace(hw, seq_overhead_s=0.0), tp=1, batch=128, context=10)
    assert one - base == pytest.approx(128 * 1e-4)
    assert two > one


def test_compare_reports_signed_errors():
    res = simulate(_one_gen(), steps=4)
    out = validate.compare(res, {"step_s": res.step_s * 2, "phases": {"g": 0.04, "nope": 1.0}})
    assert out["error_pct"] == pytest.approx(-50.0)
    assert out["ops"]["g"]["error_pct"] == pytest.approx(100.0)
    assert "nope" not in out["ops"]


def test_simulator_predicts_a_stored_real_cpu_run_within_25_percent(_cost_cpu_profile, tmp_path):
    """A real run measured on a 2-core CPU (bench/sim_validation.py --fixture): the flow text it
    ran, the profile calibrated on ANOTHER flow's run, its measured workload and median step
    time. The flow compiles again here and is simulated; no real run happens in the test."""
    fx = json.loads((FIXTURES / "sim_validation_run.json").read_text())
    assert fx["case"] not in fx["calibrated_on"]  # a prediction, not a fit
    save_profile(Profile(**fx["profile"]), _cost_cpu_profile)
    flow = tmp_path / "measured.flow"
    flow.write_text(fx["flow_text"].replace("{ROOT}", str(ROOT)))
    m = fx["measured"]
    res = calibrate.predict(str(flow), fx["sets"], m["workload"])
    cmp = validate.compare(res, m)
    assert abs(cmp["error_pct"]) <= 25.0, cmp
    # every op the run timed is in the plan again (the fixture's flow text is the one that ran)
    assert set(cmp["ops"]) == set(m["phases"])


def test_two_batch_sizes_separate_fixed_from_per_item_costs(_cost_cpu_profile, tmp_path):
    """Runs of two shapes (batch 64 x 8 in micro-batches of 128; 16 x 8 in micro-batches of 32)
    made with known fixed and per-item costs; calibration from other figures must find all."""
    from cost_cases import TEST_FLOW

    flows = []
    for name, batch, micro in (("big", 64, 128), ("small", 16, 32)):
        text = TEST_FLOW.replace("{ROOT}", str(ROOT)).replace("batch = 64", f"batch = {batch}") \
            .replace("micro_batch = 128", f"micro_batch = {micro}")
        (tmp_path / f"{name}.flow").write_text(text)
        flows.append(str(tmp_path / f"{name}.flow"))
    prof = load_profile(_cost_cpu_profile)
    true = replace(prof, iter_overhead_s=0.004, seq_overhead_s=1e-4, request_overhead_s=0.0, micro_overhead_s=0.02,
                   mfu_train=0.5, mfu_forward=0.3)
    workload = {"prompt_tokens": 7.0, "mean_response": 3.5}
    runs = []
    for flow in flows:
        _, spec, _ = calibrate.compile_spec(flow, profile=true)
        iters = validate.generate_iterations(spec, workload)
        engine = {}
        for ph in spec.phases:
            if ph.kind == "generate":
                engine[ph.id] = _gen_seconds(iters[ph.id], ph.gen)
            elif ph.per_token_s > 0:
                g = next(p.gen for p in spec.phases if p.id == ph.tokens_from)
                engine[ph.id] = ph.per_token_s * g.samples * 10.5 + (ph.seconds - true.op_overhead_s)
        runs.append((flow, {"dispatch_s": 0.01, "engine": engine, "workload": workload}))
    cal = calibrate.calibrate(prof, runs)
    assert cal.micro_overhead_s == pytest.approx(0.02, rel=1e-3)
    assert cal.mfu_train == pytest.approx(0.5, rel=1e-3)
    assert cal.iter_overhead_s == pytest.approx(0.004, rel=1e-2)
    assert cal.seq_overhead_s == pytest.approx(1e-4, rel=1e-2)
    assert cal.mfu_forward == pytest.approx(0.3, rel=1e-3)
