"""The cost model's formulas, hardware profiles, and the discrete-event simulator's behaviour."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flowrl.catalog.models import PRESETS, from_config, preset, tiny_facts
from flowrl.cost import model as cm
from flowrl.cost.profiles import CPU_FALLBACK, ProfileError, get_profile, load_profile, save_profile
from flowrl.cost.sim import GenPhase, LengthDist, Phase, SimSpec, simulate

Q7 = PRESETS["qwen/qwen2.5-7b"]
H100 = get_profile("H100")


# ---- model facts -----------------------------------------------------------------------------------------


def test_presets_match_public_parameter_counts():
    counts = {"Qwen/Qwen2.5-0.5B": 0.494, "Qwen/Qwen2.5-7B": 7.616, "Qwen/Qwen2.5-72B": 72.706,
              "meta-llama/Llama-3.1-8B": 8.030, "meta-llama/Llama-3.1-70B": 70.554}
    for name, billions in counts.items():
        assert preset(name).params / 1e9 == pytest.approx(billions, abs=0.001), name
    assert preset("qwen2.5-7b") is Q7  # short names, any case


def test_facts_from_a_local_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": True, "model_type": "llama",
        "torch_dtype": "float32", "max_position_embeddings": 2048}))
    f = from_config(tmp_path)
    assert (f.hidden, f.layers, f.heads, f.kv_heads, f.hd, f.dtype_bytes, f.max_len) == (256, 3, 8, 2, 32, 4, 2048)
    attn = 256 * 256 + 2 * 256 * 64 + 256 * 256
    assert f.params == 1000 * 256 + 3 * (attn + 3 * 256 * 512 + 2 * 256) + 256


def test_tiny_facts_follow_the_constructor():
    f = tiny_facts({"hidden": 256, "layers": 3, "heads": 8, "kv_heads": 4, "task": "arith"})
    assert (f.hidden, f.layers, f.heads, f.kv_heads, f.vocab, f.dtype_bytes) == (256, 3, 8, 4, 4 + 13, 4)


def test_unknown_hf_path_has_no_facts(compile_flow):
    g = compile_flow('model m = hf("nowhere/at-all")\ndataset d = jsonl("d.jsonl")\n'
                     'flow main() { x = generate(m, sample(d))  return x }\n')
    assert g.sched.facts["m"] is None
    assert any("unknown" in n for n in g.sched.estimate.notes)


# ---- formulas --------------------------------------------------------------------------------------------


def test_train_time_is_six_p_t_over_achieved_flops():
    t = cm.train_s(Q7, H100, kind="fsdp", tp=1, pp=1, dp=1, cp=1, tokens=1e6)
    assert t == pytest.approx(6 * Q7.params * 1e6 / (989e12 * 0.40))
    pp = cm.train_s(Q7, H100, kind="megatron", tp=1, pp=4, dp=1, cp=1, tokens=1e6, n_micro=8)
    assert pp == pytest.approx(6 * Q7.params * 1e6 / (4 * 989e12 * 0.40) * (1 + 3 / 8))  # 1F1B bubble


def test_forward_is_two_p_t():
    assert cm.forward_s(Q7, H100, world=8, tokens=1e6) == pytest.approx(2 * Q7.params * 1e6 / (8 * 989e12 * 0.5))


def test_decode_is_bandwidth_bound_at_small_batch():
    t1 = cm.decode_iter_s(Q7, H100, tp=1, batch=1, context=0)
    assert t1 == pytest.approx(Q7.params * 2 / (3350e9 * 0.7) + H100.iter_overhead_s)
    t2 = cm.decode_iter_s(Q7, H100, tp=2, batch=1, context=0)
    assert t2 < t1  # half the weights per GPU, plus two all-reduces per layer


def test_kv_heads_are_replicated_beyond_tp():
    assert cm.kv_bytes_per_token_per_gpu(Q7, H100, 8) == cm.kv_bytes_per_token_per_gpu(Q7, H100, 4)
    assert cm.kv_bytes_per_token_per_gpu(Q7, H100, 2) == 2 * 28 * 2 * 128 * 2


def test_transfer_routes_use_their_links():
    b = 1e9
    assert cm.transfer_s(b, H100, protocol="nccl", route="inter-node", buckets=1) == \
        pytest.approx(b / (50e9 * 0.8) + 30e-6)
    assert cm.transfer_s(b, H100, protocol="nccl", route="intra-node", buckets=1) == \
        pytest.approx(b / (450e9 * 0.8) + 30e-6)
    assert cm.transfer_s(b, H100, protocol="delta", route="inter-node", buckets=1) == \
        pytest.approx(b * cm.DELTA_FRACTION / (50e9 * 0.8) + 30e-6)
    assert cm.transfer_s(b, H100, protocol="checkpoint", route="inter-node", buckets=1) == \
        pytest.approx(2 * b / 2e9 + 30e-6)


# ---- profiles --------------------------------------------------------------------------------------------


def test_gpu_profiles_are_public_figures():
    a100, h200 = get_profile("A100"), get_profile("H200")
    assert (a100.tflops, a100.hbm_gb, a100.hbm_gbs) == (312.0, 80.0, 2039.0)
    assert (h200.tflops, h200.hbm_gb, h200.hbm_gbs) == (989.0, 141.0, 4800.0)
    with pytest.raises(ProfileError, match="unknown GPU kind 'B300'"):
        get_profile("B300")


def test_cpu_profile_is_read_from_the_profile_file(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    prof = CPU_FALLBACK.__class__(**{**CPU_FALLBACK.to_dict(), "tflops": 0.123, "memory_total_gb": 64.0,
                                     "source": "measured here"})
    save_profile(prof, path)
    assert load_profile(path) == prof
    monkeypatch.setenv("FLOWRL_PROFILE", str(path))
    got = get_profile("cpu", gpus_per_node=4)
    assert got.tflops == 0.123 and got.hbm_gb == 16.0 and got.source == "measured here"
    monkeypatch.setenv("FLOWRL_PROFILE", str(tmp_path / "missing.json"))
    assert get_profile("cpu").source == CPU_FALLBACK.source


def test_broken_profile_file_says_how_to_fix_it(tmp_path):
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(ProfileError, match="rerun `flowrl profile`"):
        load_profile(tmp_path / "p.json")


# ---- lengths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lognormal", "pareto"])
def test_length_samples_follow_the_distribution(kind):
    import random

    d = LengthDist(kind, median=200, sigma=1.0, alpha=1.5, cap=4000)
    xs = sorted(d.draw(random.Random(1), 20000))
    assert xs[len(xs) // 2] == pytest.approx(200, rel=0.05)
    assert xs[-1] <= 4000 and xs[0] >= 1
    assert sum(xs) / len(xs) == pytest.approx(d.mean(), rel=0.05)
    assert xs[int(0.99 * len(xs))] == pytest.approx(d.quantile(0.99), rel=0.08)


# ---- the simulator ---------------------------------------------------------------------------------------


def _spec(s=1, shared=True, over=1.0, recycle=False, train_s=2.0, sigma=1.0, replicas=4, samples=64, every=1):
    gen_lane, train_lane = ("gpu", "gpu") if shared else ("gen", "train")
    lanes = {"gpu": 8} if shared else {"gen": 4, "train": 4}
    lanes["driver"] = 0
    gen = GenPhase(replicas=replicas, gpus_per_replica=1 if not shared else 2, concurrency=64, iter_s=0.01,
                   prefill_s=0.0, samples=samples, prompt_tokens=16,
                   lengths=LengthDist("lognormal", median=100, sigma=sigma, cap=2000))
    return SimSpec((Phase("sample", "work", "driver", seconds=0.001),
                    Phase("gen", "generate", gen_lane, ("sample",), gen=gen, label="generate"),
                    Phase("update", "work", train_lane, ("gen",), seconds=train_s, label="update"),
                    Phase("resync", "resync", train_lane, ("update",), seconds=0.2, block_s=0.2, gates=("gen",),
                          label="resync", every=every)),
                   lanes, staleness=s, over_provision=over, recycle=recycle)


def test_simulation_is_deterministic_and_sane():
    a, b = simulate(_spec(), steps=8, seed=3), simulate(_spec(), steps=8, seed=3)
    assert a.step_s == b.step_s and a.timeline == b.timeline
    assert a.step_s >= a.breakdown["generate"] + a.breakdown["update"] + a.breakdown["resync"] - 1e-9
    assert 0 < a.bubble < 1 and set(a.utilization) == {"gpu", "driver"}
    assert simulate(_spec(), steps=8, seed=4).step_s != a.step_s


def test_colocated_engines_gain_nothing_from_staleness():
    """Time-sharing: generation cannot overlap training on the same GPUs."""
    s1 = simulate(_spec(s=1, shared=True), steps=40)
    s2 = simulate(_spec(s=2, shared=True), steps=40)
    assert s2.step_s == pytest.approx(s1.step_s, rel=0.03)
    for r in (s1, s2):  # a shared lane never runs two phases at once
        spans = sorted((t0, t1) for lane, _l, _k, t0, t1 in r.timeline if lane == "gpu")
        assert all(b0 >= a1 - 1e-9 for (_a0, a1), (b0, _b1) in zip(spans, spans[1:]))


def test_disaggregated_one_step_off_overlaps_generation_and_training():
    s1 = simulate(_spec(s=1, shared=False), steps=16)
    s2 = simulate(_spec(s=2, shared=False), steps=16)
    assert s2.step_s < 0.8 * s1.step_s
    # in steady state the step is bounded by the slower pool, not their sum
    assert s2.step_s < s1.breakdown["generate"] + s1.breakdown["update"]


def _by(r, label):
    return {k: (t0, t1) for _lane, lab, k, t0, t1 in r.timeline if lab == label}


@pytest.mark.parametrize("s", [1, 2, 4])
def test_the_modulo_schedule_of_the_runtime(s):
    """As flowrl.runtime.pipeline runs it: one generate call at a time, generation of step j
    after the push of step j - s, and each push after every queued generation (j < k + s)."""
    r = simulate(_spec(s=s, shared=False, sigma=1.5, train_s=3.0), steps=12)
    gen, push, upd = _by(r, "generate"), _by(r, "resync"), _by(r, "update")
    ks = sorted(gen)
    assert all(gen[b][0] >= gen[a][1] - 1e-9 for a, b in zip(ks, ks[1:]))
    for j in ks:
        if j - s in push:
            assert gen[j][0] >= push[j - s][1] - 1e-9
    for k, (t0, _t1) in push.items():
        assert t0 >= max(gen[j][1] for j in gen if j < k + s) - 1e-9
        if k + 1 in upd:  # the driver's main thread: the next update after this push
            assert upd[k + 1][0] >= push[k][1] - 1e-9


def test_a_deeper_pipeline_never_costs_throughput():
    """Every push waits for the queued generations, so beyond one step off a deeper pipeline
    only absorbs step-to-step variation; it never makes a step slower."""
    kw = dict(shared=False, sigma=1.5, train_s=0.5)
    s2 = simulate(_spec(s=2, **kw), steps=24)
    s4 = simulate(_spec(s=4, **kw), steps=24)
    assert s4.step_s <= s2.step_s * 1.001


def test_partial_rollout_cuts_the_tail_and_recycles():
    base = simulate(_spec(s=2, shared=False, sigma=1.5, train_s=0.5), steps=16)
    part = simulate(_spec(s=2, shared=False, sigma=1.5, train_s=0.5, over=1.5, recycle=True), steps=16)
    drop = simulate(_spec(s=2, shared=False, sigma=1.5, train_s=0.5, over=1.5, recycle=False), steps=16)
    assert part.breakdown["generate"] < base.breakdown["generate"]
    assert part.step_s < base.step_s
    assert part.wasted_tokens == 0 and drop.wasted_tokens > 0


def test_resync_every_k_gates_generation_less_often():
    every1 = simulate(_spec(s=1, shared=False), steps=12)
    every2 = simulate(_spec(s=1, shared=False, every=2), steps=12)
    assert every2.step_s < every1.step_s
    assert sum(1 for lane, label, *_ in every2.timeline if label == "resync") == 6


def test_trace_events_are_chrome_format():
    ev = simulate(_spec(), steps=4).trace_events()
    spans = [e for e in ev if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and "ts" in e for e in spans)
    assert {e["args"]["name"] for e in ev if e["ph"] == "M"} >= {"gpu"}


def test_compare_async_anchor_shape(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from compare_async import compare_async  # bench/compare_async.py: the comparison compiles flows

    rows = compare_async(gpus=16, batch=64, group=4, max_tokens=2048, steps=8)
    modes = [r["mode"] for r in rows]
    assert modes == ["sync", "one-step-off", "bounded async (s=4)", "partial rollout"]
    sync = rows[0]
    assert sync["speedup"] == 1.0 and "staleness 1" in sync["schedule"]
    assert all(r["step_s"] > 0 and r["anchor"] or r["mode"] == "sync" for r in rows)
    best_async = min(r["step_s"] for r in rows[1:])
    assert best_async < sync["step_s"]
    assert math.isclose(rows[2]["speedup"], sync["step_s"] / rows[2]["step_s"], rel_tol=1e-3)
