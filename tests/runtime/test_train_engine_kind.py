"""`torch(dp = N)` runs data parallel on the fsdp engine's ranks; the driver accepts and sizes it."""

from __future__ import annotations

from pathlib import Path

from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text
from flowrl.runtime.driver import Runtime, _train_layout
from flowrl.runtime.placement import processes_per_node
from flowrl.runtime.workers import MULTI_RANK_TRAIN, train_engine_kind

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


def test_kind_mapping():
    assert train_engine_kind("torch", 1) == "torch"
    assert train_engine_kind("torch", 2) == "fsdp" and "fsdp" in MULTI_RANK_TRAIN
    assert train_engine_kind("megatron", 2) == "megatron"
    assert train_engine_kind("fsdp", 1) == "fsdp"


def test_torch_dp2_is_executable_and_gets_two_rank_processes(tmp_path):
    plan = _plan("torch(dp = 2)", gpus=2)
    e = plan.model("policy").train_engine
    assert (e.kind, e.dp, e.world_size) == ("torch", 2, 2)
    Runtime(plan, tmp_path).check_executable()  # refused before fsdp existed: "runs on one rank"
    assert _train_layout(e) == {"tp": 1, "pp": 1, "dp": 2, "offload": False}
    rollout = plan.model("policy").rollout_engine
    # the node's cores are shared by two trainer ranks and every vLLM replica (the pool of 2 holds dp = 2)
    assert processes_per_node(plan) == {0: 2 + rollout.dp}


def test_single_rank_torch_keeps_the_torch_engine(tmp_path):
    plan = _plan("torch(dp = 1)", gpus=1)
    e = plan.model("policy").train_engine
    assert train_engine_kind(e.kind, e.dp) == "torch"
    assert _train_layout(e) == {"tp": 1, "pp": 1, "dp": 1}
    assert processes_per_node(plan) == {0: 2}


def test_context_parallel_megatron_is_executable_and_gets_cp_rank_processes(tmp_path):
    plan = _plan("megatron(tp = 1, cp = 2)", gpus=2)
    e = plan.model("policy").train_engine
    assert (e.kind, e.cp, e.world_size) == ("megatron", 2, 2)
    Runtime(plan, tmp_path).check_executable()  # refused before the engine had context parallelism
    assert _train_layout(e) == {"tp": 1, "pp": 1, "dp": 1, "cp": 2}
