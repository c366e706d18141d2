"""What carries a resync's bytes, decided by the catalogue and checked by ``flowrl check`` (issue 9).

Each protocol record says what it sends over on each platform (``ProtocolSpec.transport``),
each platform what it has (``flowrl.catalog.platforms.TRANSPORTS``). The compiler refuses a
protocol whose transport the schedule's platform lacks (E445, at the ``resync`` statement);
no shipped record does (checked here), so the refusal is shown with a record that claims NCCL
on a CPU cluster. What only the run knows (the machine: a plan for GPUs started on a CPU
machine) is refused before any model is prepared, from the same catalogue fields; and every
option the catalogue lets a schedule write is one the runtime's classes take, so an option
``check`` accepts cannot fail at run time.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from flowrl.catalog.platforms import PLATFORMS, TRANSPORTS
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError
from flowrl.plan import ResyncPlan

FLOW = '''model policy = tiny(task = "arith")

flow main(prompts: dataset, r: reward) {
  b        = sample(prompts, size = 8)
  rollouts = generate(policy, b, n = 2, max_tokens = 16)
  adv      = group_advantage(r(rollouts), group = 2)
  update(policy, rollouts, adv, logprobs(policy, rollouts))
}

schedule main on cluster(nodes = 1, gpus_per_node = 2, gpu = "%s") {
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  place policy.train on train
  resync policy via %s
}
'''


def _resync(gpu: str, protocol: str):
    g = compile_text(FLOW % (gpu, protocol), "t.flow", until="select_sync_protocol", allow_missing=True)
    return next(iter(g.sched.resyncs.values()))


def test_every_shipped_protocol_sends_over_what_its_platforms_have():
    for p in PROTOCOLS.values():
        for platform in PLATFORMS:
            if p.support(platform).ok:
                assert p.transport_on(platform) in TRANSPORTS[platform], (p.name, platform)


@pytest.mark.parametrize("gpu, protocol, transport", [
    ("cpu", "nccl()", "gloo"),     # the same flow runs on CPU (gloo) and on GPUs (NCCL)
    ("H100", "nccl()", "nccl"),
    ("MI300X", "broadcast()", "nccl"),
    ("cpu", "checkpoint()", "disk"),
    ("H100", "gloo()", "gloo"),
])
def test_the_plan_records_the_platforms_transport(gpu, protocol, transport):
    assert _resync(gpu, protocol).transport == transport


def test_a_transport_the_platform_lacks_is_refused_at_the_resync(monkeypatch):
    # A record claiming NCCL on a CPU cluster (what `nccl` would be without its gloo fallback).
    nccl = PROTOCOLS["nccl"]
    monkeypatch.setitem(PROTOCOLS, "nccl", replace(nccl, transport={**nccl.transport, "cpu": "nccl"}))
    with pytest.raises(FlowError) as info:
        _resync("cpu", "nccl(bucket = 1MB)")
    (d,) = info.value.diagnostics
    assert d.code == "E445"
    assert (d.span.line, d.span.column) == (15, 3)  # the `resync` statement
    assert "`nccl` resync of `policy` sends over nccl on cpu (cluster gpu = \"cpu\"), which has only " \
           "disk, gloo, ray, shm" in d.message
    assert "`resync policy via gloo()`" in d.hint and "cuda or rocm GPUs" in d.hint
    assert _resync("H100", "nccl()").transport == "nccl"  # on GPUs it stands


def test_a_protocol_with_no_transport_on_a_platform_is_refused_with_the_cpu_hint(monkeypatch):
    gloo = PROTOCOLS["gloo"]
    monkeypatch.setitem(PROTOCOLS, "gloo", replace(gloo, transport={"cpu": "gloo"}))
    with pytest.raises(FlowError) as info:
        _resync("H100", "gloo()")
    (d,) = info.value.diagnostics
    assert d.code == "E445" and "names no transport on cuda" in d.message
    assert "`resync policy via nccl()`" in d.hint and 'declare `gpu = "cpu"`' in d.hint


# ---- the run: the machine, and options ------------------------------------------------------------------


def _plan(protocol: str, transport: str, **options) -> ResyncPlan:
    return ResyncPlan("resync.policy", "policy", "update", protocol, 1 << 20, 1, "t.flow:15:3",
                      options=options, transport=transport)


def test_a_plan_for_gpus_on_a_cpu_machine_is_refused_by_the_catalogue(monkeypatch):
    from flowrl.runtime.sync import from_plan

    monkeypatch.setattr(from_plan, "machine_platform", lambda: "cpu")
    problem = from_plan.sync_problem(_resync("H100", "broadcast()"))
    assert "sends over nccl, which this machine (platform cpu) lacks" in problem
    assert "cuda or rocm cluster" in problem and "via gloo()" in problem
    assert from_plan.sync_problem(_resync("H100", "broadcast()"), nccl_elsewhere=True) is None
    assert from_plan.sync_problem(_resync("cpu", "broadcast()")) is None
    monkeypatch.setattr(from_plan, "machine_platform", lambda: "cuda")
    assert from_plan.sync_problem(_resync("H100", "delta()")) is None


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_every_option_a_schedule_may_write_is_taken_by_the_runtime(name, monkeypatch):
    """All of a record's options at once, on every platform it runs on: the runtime builds its options
    without a WeightSyncError (the compiler has checked their names, types and ranges)."""
    from flowrl.runtime.sync import from_plan

    spec = PROTOCOLS[name]
    options = {k: ("/shared/w" if k == "dir" else s.default) for k, s in spec.options.items()}
    for platform in PLATFORMS:
        if not spec.support(platform).ok:
            continue
        monkeypatch.setattr(from_plan, "machine_platform", lambda: platform)
        assert from_plan.sync_problem(_plan(name, spec.transport[platform], **options)) is None, (name, platform)
