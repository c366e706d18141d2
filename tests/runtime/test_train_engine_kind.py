"""`torch(dp = N)` runs data parallel on the fsdp engine's ranks: the engine records say so, the driver
accepts and sizes it, and the worker builds the adapter the record names with the layout's options."""

from __future__ import annotations

from pathlib import Path

from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text
from flowrl.engines.registry import adapter_kwargs, runs_on
from flowrl.runtime.driver import check_executable
from flowrl.runtime.placement import processes_per_node
from flowrl.runtime.workers import layout_of

ROOT = Path(__file__).resolve().parents[2]

FLOW = """import stdlib.grpo
model policy = tiny(task = "arith")
dataset arith = jsonl("../data/arith/train.jsonl", prompt = "prompt", answer = "answer")
reward exact = verifier("math")
flow main() { grpo(policy, arith, exact, batch = 8, group = 4, max_tokens = 5, kl = 0.0) }
schedule main on cluster(nodes = 1, gpus_per_node = GPUS) {
  colocate policy.train, policy.rollout on all
  policy.train = LAYOUT
  policy.rollout = vllm(tp = 1)
}
"""


def _plan(layout: str, gpus: int):
    text = FLOW.replace("LAYOUT", layout).replace("GPUS", str(gpus))
    return lower(compile_text(text, str(ROOT / "flows" / "kind_test.flow")))


def _adapter(e) -> tuple[str, dict]:
    spec = runs_on(e.kind, e.world_size)
    return spec.adapter, adapter_kwargs(spec, layout_of(e))


def test_a_single_rank_engine_runs_larger_layouts_on_its_records_multi_rank_engine():
    assert runs_on("torch", 1).name == "torch"
    assert runs_on("torch", 2).name == "fsdp" and runs_on("torch", 2).ranks == "actors"
    assert runs_on("megatron", 2).name == "megatron"
    assert runs_on("fsdp", 1).name == "fsdp"


def test_torch_dp2_is_executable_and_gets_two_rank_processes():
    plan = _plan("torch(dp = 2)", gpus=2)
    e = plan.model("policy").train_engine
    assert (e.kind, e.dp, e.world_size) == ("torch", 2, 2)
    check_executable(plan)  # refused before fsdp existed: "runs on one rank"
    assert _adapter(e) == ("flowrl.engines.fsdp:FsdpTrainEngine", {"dp": 2})
    rollout = plan.model("policy").rollout_engine
    # the node's cores are shared by two trainer ranks and every vLLM replica (the pool of 2 holds dp = 2)
    assert processes_per_node(plan) == {0: 2 + rollout.dp}


def test_single_rank_torch_keeps_the_torch_engine():
    plan = _plan("torch(dp = 1)", gpus=1)
    e = plan.model("policy").train_engine
    assert _adapter(e) == ("flowrl.engines.torch_train:TorchTrainEngine", {})
    assert processes_per_node(plan) == {0: 2}


def test_context_parallel_megatron_is_executable_and_gets_cp_rank_processes():
    plan = _plan("megatron(tp = 1, cp = 2)", gpus=2)
    e = plan.model("policy").train_engine
    assert (e.kind, e.cp, e.world_size) == ("megatron", 2, 2)
    check_executable(plan)  # refused before the engine had context parallelism
    assert _adapter(e) == ("flowrl.engines.megatron.engine:MegatronTrainEngine", {"tp": 1, "pp": 1, "dp": 1, "cp": 2})
