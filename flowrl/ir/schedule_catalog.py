"""The schedule vocabulary as data: clusters, pools, engines and their layouts, sync protocols.

The compiler checks schedules against these tables; the runtime dispatches on the same
names. Nothing here imports an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.ir.ops import KwSpec


@dataclass(frozen=True)
class EngineSpec:
    name: str
    serves: str
    """``train`` (updates, logprobs, values) or ``rollout`` (generate)."""
    kwargs: dict[str, KwSpec]
    doc: str = ""


_PAR = {"tp": KwSpec("int", 1, min=1, doc="tensor parallel size"),
        "dp": KwSpec("int", 1, min=1, doc="data parallel size")}

ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec("megatron", "train", {**_PAR, "pp": KwSpec("int", 1, min=1, doc="pipeline parallel size"),
                                     "cp": KwSpec("int", 1, min=1, doc="context parallel size"),
                                     "micro_batch": KwSpec("int", 1, min=1)},
               "Megatron-core: tensor/pipeline/data/context parallel training"),
    EngineSpec("fsdp", "train", {"dp": KwSpec("int", 1, min=1), "offload": KwSpec("bool", False)},
               "PyTorch FSDP2 data-parallel (sharded) training"),
    EngineSpec("torch", "train", {"dp": KwSpec("int", 1, min=1)}, "Plain PyTorch/transformers training"),
    EngineSpec("vllm", "rollout", {**_PAR, "gpu_memory_utilization": KwSpec("float", 0.5, min=0.05, max=1.0),
                                   "max_model_len": KwSpec("int", 512, min=8)}, "vLLM generation"),
    EngineSpec("sglang", "rollout", {**_PAR, "mem_fraction": KwSpec("float", 0.5, min=0.05, max=1.0)},
               "SGLang generation"),
    EngineSpec("hf_generate", "rollout", {"dp": KwSpec("int", 1, min=1)},
               "transformers generate (no inference engine needed)"),
)}

CLUSTER = {"nodes": KwSpec("int", 1, min=1), "gpus_per_node": KwSpec("int", 1, min=1),
           "gpu": KwSpec("str", "cpu", choices=("cpu", "A100", "H100", "H200")),
           "address": KwSpec("str", "")}

POOL = {"gpus": KwSpec("int", 1, min=1, required=True), "nodes": KwSpec("int", 1, min=1)}

PROTOCOLS: dict[str, dict[str, KwSpec]] = {
    "inplace": {"bucket": KwSpec("size", 256 * 2**20, min=1)},
    "ipc": {"bucket": KwSpec("size", 256 * 2**20, min=1)},
    "nccl": {"bucket": KwSpec("size", 512 * 2**20, min=1), "overlap": KwSpec("bool", True)},
    "gloo": {"bucket": KwSpec("size", 512 * 2**20, min=1), "overlap": KwSpec("bool", True)},
    "broadcast": {"bucket": KwSpec("size", 512 * 2**20, min=1), "overlap": KwSpec("bool", True)},
    "checkpoint": {"dir": KwSpec("str", ""), "keep": KwSpec("int", 1, min=1)},
    "delta": {"bucket": KwSpec("size", 256 * 2**20, min=1), "threshold": KwSpec("float", 0.0, min=0.0)},
}

SCHED_CALLS: dict[str, dict[str, KwSpec]] = {
    "partial_rollout": {"over_provision": KwSpec("float", 1.25, min=1.0,
                                                 doc="requests sent per sample needed"),
                        "recycle": KwSpec("bool", True)},
}

AUTO = {"max_staleness": KwSpec("int", 1, min=1)}

ROLES = ("train", "rollout")
"""Engine roles of a trainable model in a schedule target: ``policy.train``, ``policy.rollout``."""
