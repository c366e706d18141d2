"""The automatic `cpu` profile: cached per machine, measured on a miss, used by `flowrl plan`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.cost import autoprofile
from flowrl.cost.profiles import CPU_FALLBACK, ProfileError, load_profile, save_profile

REPO = Path(__file__).resolve().parents[2]
FACTS = {"cpu": "Test CPU 9000", "cores": 2, "torch_version": "2.13.0"}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLOWRL_PROFILE", raising=False)
    monkeypatch.setenv("FLOWRL_AUTO_PROFILE", "1")
    return tmp_path / "cache"


def writer(calls: list, tflops: float = 0.123):
    """A benchmark that writes a known profile and records each call."""
    def bench(path):
        calls.append(path)
        save_profile(replace(CPU_FALLBACK, tflops=tflops, source="bench"), path)
    return bench


def test_miss_measures_then_hit_reuses(cache):
    calls: list = []
    path, fresh = autoprofile.auto_profile(FACTS, bench=writer(calls))
    assert fresh and calls == [path] and path.parent == cache / "profiles"
    assert path.name == f"cpu-{autoprofile.machine_key(FACTS)}.json"
    prof = load_profile(path)
    assert prof.tflops == 0.123 and "Test CPU 9000 (2 cores, torch 2.13.0)" in prof.source
    again, fresh = autoprofile.auto_profile(FACTS, bench=writer(calls))
    assert (again, fresh) == (path, False) and len(calls) == 1


def test_key_follows_cpu_cores_and_torch(cache):
    keys = {autoprofile.machine_key(f) for f in (FACTS, {**FACTS, "cpu": "Other"}, {**FACTS, "cores": 4},
                                                  {**FACTS, "torch_version": "2.14.0"})}
    assert len(keys) == 4
    calls: list = []
    autoprofile.auto_profile(FACTS, bench=writer(calls))
    autoprofile.auto_profile({**FACTS, "cores": 4}, bench=writer(calls))
    assert len(calls) == 2 and calls[0] != calls[1]


def test_unreadable_cache_is_measured_again(cache):
    path = autoprofile.cached_path(FACTS)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    calls: list = []
    assert autoprofile.auto_profile(FACTS, bench=writer(calls)) == (path, True) and calls == [path]


def test_explicit_profile_or_switch_turns_it_off(cache, monkeypatch, tmp_path):
    assert autoprofile.enabled()
    monkeypatch.setenv("FLOWRL_AUTO_PROFILE", "0")
    assert not autoprofile.enabled() and autoprofile.use_auto_profile(bench=writer([])) is None
    monkeypatch.setenv("FLOWRL_AUTO_PROFILE", "1")
    save_profile(CPU_FALLBACK, cache / "profile.json")  # a `flowrl profile` measurement wins
    assert not autoprofile.enabled()


def test_failing_benchmark_is_a_clear_error(cache):
    def broken(path):
        raise ProfileError("the automatic CPU benchmark failed (boom); hint: run `flowrl profile`")
    with pytest.raises(ProfileError, match="hint: run `flowrl profile`"):
        autoprofile.auto_profile(FACTS, bench=broken)


def test_plan_uses_the_cached_profile(cache, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    fast = replace(CPU_FALLBACK, tflops=CPU_FALLBACK.tflops * 10, hbm_gbs=CPU_FALLBACK.hbm_gbs * 10, source="bench")
    path = autoprofile.cached_path()
    save_profile(fast, path)
    assert main(["plan", "flows/arith_rloo.flow", "--json"]) == 0
    out = capsys.readouterr().out
    fast_step = _step(out)
    assert '"profile": "cpu: bench"' in out
    assert load_profile(path).source == "bench"  # a hit is used as it is, not measured again
    monkeypatch.setenv("FLOWRL_AUTO_PROFILE", "0")
    monkeypatch.setenv("FLOWRL_PROFILE", str(cache / "none.json"))  # the built-in figures
    assert main(["plan", "flows/arith_rloo.flow", "--json"]) == 0
    assert fast_step < _step(capsys.readouterr().out)


GPU_FLOW = """
import stdlib.grpo
model policy = tiny(task = "arith")
dataset d = jsonl("{data}")
reward exact = verifier("math")
flow main() {{ grpo(policy, d, exact, batch = 8, group = 2, max_tokens = 4) }}
schedule main on cluster(nodes = 1, gpus_per_node = 8, gpu = "{gpu}") {{
  colocate policy.train, policy.rollout, ref on all
}}
"""


@pytest.mark.parametrize("gpu, measures", [("H100", False), ("cpu", True)])
def test_plan_measures_this_machine_only_for_a_plan_on_cpu(cache, monkeypatch, tmp_path, capsys, gpu, measures):
    calls: list = []
    monkeypatch.setattr(autoprofile, "run_quick_bench", writer(calls))
    flow = tmp_path / "f.flow"
    flow.write_text(GPU_FLOW.format(data=REPO / "data" / "arith" / "train.jsonl", gpu=gpu))
    assert main(["plan", str(flow), "--json"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == int(measures)
    assert ('"profile": "cpu: measured automatically' in out) is measures  # planned with the figures just measured


def test_without_torch_plan_keeps_the_built_in_figures(cache, monkeypatch, capsys):
    from flowrl.cost import profiles

    calls: list = []
    monkeypatch.setattr(autoprofile, "run_quick_bench", writer(calls))
    monkeypatch.setattr(profiles, "MEASURES_WITH", "flowrl_no_such_package")  # what measuring imports, absent
    monkeypatch.chdir(REPO)
    assert not autoprofile.enabled()
    assert main(["plan", "flows/arith_rloo.flow"]) == 0  # the compiler alone needs no torch
    assert calls == [] and "default figures" in capsys.readouterr().out


def _step(text: str) -> float:
    import json
    return json.loads(text)["estimate"]["step_s"]


def test_quick_benchmark_measures_this_machine(cache):
    path, fresh = autoprofile.auto_profile()
    prof = load_profile(path)
    assert fresh and prof.tflops > 0 and prof.hbm_gbs > 0 and prof.platform == "cpu"
    assert autoprofile.machine_facts()["cpu"] in prof.source
    # and what the train engine achieves of that matmul (flowrl.cost.trainbench), not another machine's
    assert 0 < prof.mfu_forward <= 1 and 0 < prof.mfu_train <= 1 and prof.micro_overhead_s >= 0
    kept = (CPU_FALLBACK.mfu_forward, CPU_FALLBACK.mfu_train, CPU_FALLBACK.micro_overhead_s)
    assert (prof.mfu_forward, prof.mfu_train, prof.micro_overhead_s) != kept


def test_a_new_benchmark_measures_again(cache, monkeypatch):
    calls: list = []
    autoprofile.auto_profile(FACTS, bench=writer(calls))
    monkeypatch.setattr(autoprofile, "QUICK_VERSION", autoprofile.QUICK_VERSION + 1)
    path, fresh = autoprofile.auto_profile(FACTS, bench=writer(calls))
    assert fresh and len(calls) == 2 and calls[0] != calls[1] == path


def test_new_kept_figures_measure_again(cache, monkeypatch):
    # The benchmark measures matmul and memcpy and keeps the built-in figures (overheads...): a
    # profile cached under older figures is not reused once they change.
    calls: list = []
    autoprofile.auto_profile(FACTS, bench=writer(calls))
    monkeypatch.setattr(autoprofile, "CPU_FALLBACK", replace(CPU_FALLBACK, op_overhead_s=CPU_FALLBACK.op_overhead_s * 2))
    path, fresh = autoprofile.auto_profile(FACTS, bench=writer(calls))
    assert fresh and len(calls) == 2 and calls[0] != calls[1] == path
