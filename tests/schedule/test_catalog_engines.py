"""An engine or protocol added to the catalogue only is planned with its own record's facts.

Nothing in the compiler or the cost model names an engine: a new record is enough for a
schedule to lay it out on its axes with its options, for its memory model, KV-head rule,
sampling limits and platforms to be checked, for ``schedule auto`` to try it, and for the
weight sync to be chosen from the protocols' records.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from flowrl.catalog.engines import ENGINES, EngineSpec
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.catalog.spec import RUNS, KwSpec, limited, unsupported
from flowrl.diagnostics import FlowError

FLOW = '''
model policy = hf("Qwen/Qwen2.5-0.5B")
dataset d = jsonl("d.jsonl")
reward v = verifier("exact")
flow main() {
  b   = sample(d, size = 16)
  r   = generate(policy, b, n = 4, max_tokens = 256, temperature = 1.5)
  lp  = logprobs(policy, r)
  update(policy, r, group_advantage(v(r), group = 4), lp, epochs = 2)
}
'''

NEWGEN = EngineSpec(
    "newgen", "rollout", ("tp", "dp"),
    {"mem": KwSpec("float", 0.5, min=0.05, max=1.0, doc="fraction of each GPU it reserves")},
    "a rollout engine known to the catalogue only",
    adapter="example.newgen:NewGen", adapter_options={"tp": "tensor_parallel_size", "mem": "mem"},
    package="newgen", install="pip install newgen", memory="reserved", memory_option="mem",
    kv_replicates=False, sampling_limits={"temperature": 1.0}, weights="vllm", frees_memory="sleep",
    platforms={"cpu": limited("newgen runs one rank per replica on CPU", tp=1), "cuda": RUNS,
               "rocm": unsupported("newgen has no HIP kernels; use `vllm` on AMD GPUs")})

NEWTRAIN = EngineSpec(
    "newtrain", "train", ("tp", "dp"), {}, "a train engine known to the catalogue only",
    adapter="example.newtrain:NewTrain", adapter_options={"tp": "tp", "dp": "dp"}, package="newtrain",
    install="pip install newtrain", memory="megatron", weights="megatron", ranks="replicas",
    frees_memory="offload", platforms={"cpu": RUNS, "cuda": RUNS})


@pytest.fixture
def new_engines(monkeypatch):
    monkeypatch.setitem(ENGINES, "newgen", NEWGEN)
    monkeypatch.setitem(ENGINES, "newtrain", NEWTRAIN)


def _schedule(body: str, cluster: str = 'cluster(gpus_per_node = 4, gpu = "H100")') -> str:
    return FLOW.replace("temperature = 1.5", "temperature = 0.9") + f"schedule main on {cluster} {{\n{body}\n}}\n"


def test_a_new_rollout_engine_is_laid_out_on_its_axes_with_its_options(new_engines, plan_of):
    plan = plan_of(_schedule("  colocate policy.train, policy.rollout on all\n"
                             "  policy.rollout = newgen(tp = 2, mem = 0.7)"))
    roll = plan.model("policy").rollout_engine
    assert (roll.kind, roll.tp, roll.dp, roll.gpus) == ("newgen", 2, 2, (0, 1, 2, 3))  # not tp=1 dp=2
    assert roll.options == {"mem": 0.7}
    assert roll.memory.reserved_gb == pytest.approx(0.7 * 80)  # its memory option, its memory model
    assert roll.releases == "sleep"  # its record frees memory: it sleeps while the trainer works
    r = plan.resyncs[0]
    assert r.reshard.dst == "newgen(tp=2)" and r.reshard.dst_tp == 2  # its weight layout is vLLM's


def test_a_new_train_engine_is_laid_out_and_counted_by_its_memory_model(new_engines, plan_of):
    plan = plan_of(_schedule("  colocate policy.train, policy.rollout on all\n"
                             "  policy.train = newtrain(tp = 2)"))
    train = plan.model("policy").train_engine
    assert (train.kind, train.tp, train.dp) == ("newtrain", 2, 2)
    params = plan.model("policy").facts["params"]
    assert train.memory.weights_gb == pytest.approx(params * 2 / 2 / 1e9)     # megatron's model: by tp
    assert train.memory.optimizer_gb == pytest.approx(params * 12 / 4 / 1e9)  # and by tp x dp
    assert plan.resyncs[0].reshard.src == "newtrain(tp=2, pp=1)"


def test_its_limits_are_checked(new_engines, compile_flow):
    with pytest.raises(FlowError) as info:   # the model's shape
        compile_flow(_schedule("  policy.rollout = newgen(tp = 4)"))
    assert [d.code for d in info.value.diagnostics] == ["E425"]  # Qwen2.5-0.5B has 14 heads
    with pytest.raises(FlowError) as info:   # CPU limit from its record
        compile_flow(_schedule("  policy.rollout = newgen(tp = 2)", "cluster(gpus_per_node = 2)")
                     .replace('hf("Qwen/Qwen2.5-0.5B")', "tiny()").replace("max_tokens = 256", "max_tokens = 64"))
    (d,) = info.value.diagnostics
    assert d.code == "E441" and "newgen runs one rank per replica on CPU" in d.hint
    with pytest.raises(FlowError) as info:   # a platform it does not run on
        compile_flow(_schedule("  policy.rollout = newgen()", 'cluster(gpus_per_node = 4, gpu = "MI300X")'))
    assert [d.code for d in info.value.diagnostics] == ["E440"]


def test_its_sampling_limits_are_checked(new_engines, compile_flow):
    with pytest.raises(FlowError) as info:
        compile_flow(FLOW + 'schedule main on cluster(gpus_per_node = 4, gpu = "H100") {\n'
                            '  policy.rollout = newgen()\n}\n')
    (d,) = info.value.diagnostics
    assert d.code == "E438" and "above 1" in d.message and "`newgen`" in d.message


def test_schedule_auto_tries_every_searched_engine(new_engines, plan_of, monkeypatch):
    """With the catalogue's rollout engines all but the new one unsearched, the winner is the new one."""
    for name, e in list(ENGINES.items()):
        if e.serves == "rollout" and name != "newgen":
            monkeypatch.setitem(ENGINES, name, replace(e, searched=False))
    text = FLOW.replace("temperature = 1.5", "temperature = 0.9") + \
        'schedule main auto on cluster(gpus_per_node = 4, gpu = "H100") { staleness <= 1 }\n'
    plan = plan_of(text)
    assert plan.model("policy").rollout_engine.kind == "newgen"


def test_schedule_auto_tries_sglang(plan_of, monkeypatch):
    """vLLM is not special: auto lays out every searched rollout engine (SGLang too), and without
    vLLM in the search it picks SGLang."""
    text = FLOW.replace("temperature = 1.5", "temperature = 0.9").replace('hf("Qwen/Qwen2.5-0.5B")', "tiny()") \
        .replace("max_tokens = 256", "max_tokens = 64") + \
        'schedule main auto on cluster(gpus_per_node = 2) { staleness <= 1 }\n'
    both = plan_of(text).search.considered
    monkeypatch.setitem(ENGINES, "sglang", replace(ENGINES["sglang"], searched=False))
    vllm_only = plan_of(text).search.considered
    assert both == 2 * vllm_only  # the same tp choices for each of the two engines
    monkeypatch.setitem(ENGINES, "sglang", replace(ENGINES["sglang"], searched=True))
    monkeypatch.setitem(ENGINES, "vllm", replace(ENGINES["vllm"], searched=False))
    plan = plan_of(text)
    assert plan.model("policy").rollout_engine.kind == "sglang"
    assert "sglang(" in plan.search.winner.schedule


def test_a_protocol_is_chosen_from_the_records(plan_of, monkeypatch):
    """The protocol chosen for a route is the record whose ``chosen_for`` names it."""
    nccl, gloo = PROTOCOLS["nccl"], PROTOCOLS["gloo"]
    monkeypatch.setitem(PROTOCOLS, "nccl", replace(nccl, chosen_for=()))
    monkeypatch.setitem(PROTOCOLS, "gloo", replace(gloo, chosen_for=gloo.chosen_for + (("intra-node", "gpu"),)))
    plan = plan_of(_schedule("  pool gen = gpus(gpus = 2)\n  pool train = gpus(gpus = 2)\n"
                             "  place policy.rollout on gen\n  place policy.train on train\n  staleness 2"))
    r = plan.resyncs[0]
    assert (r.protocol, r.route, r.transport) == ("gloo", "intra-node", "gloo")
