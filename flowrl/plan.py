"""The ExecutionPlan: everything the runtime needs, and nothing it must re-derive.

Frozen dataclasses of plain values (str, int, float, bool, lists, dicts), so a plan
round-trips through JSON exactly (``ExecutionPlan.from_json(plan.to_json()) == plan``).
Every record carries ``origin``: the ``file:line:col`` of the source it came from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, get_args, get_origin, get_type_hints


PLAN_VERSION = 1


@dataclass(frozen=True)
class Memory:
    """Estimated memory of one engine on one of its GPUs, in GB (1e9 bytes)."""

    weights_gb: float
    grads_gb: float = 0.0
    optimizer_gb: float = 0.0
    activations_gb: float = 0.0
    kv_cache_gb: float = 0.0
    other_gb: float = 0.0
    """Workspace, logits, CUDA context."""
    reserved_gb: float = 0.0
    """Rollout engines: what the engine takes up front (``gpu_memory_utilization`` x memory)."""
    kv_tokens: int = 0
    """Rollout engines: tokens the KV cache holds."""

    @property
    def total_gb(self) -> float:
        parts = self.weights_gb + self.grads_gb + self.optimizer_gb + self.activations_gb + self.kv_cache_gb \
            + self.other_gb
        return max(parts, self.reserved_gb)

    def to_dict(self) -> dict:
        return {"weights_gb": _r(self.weights_gb), "grads_gb": _r(self.grads_gb),
                "optimizer_gb": _r(self.optimizer_gb), "activations_gb": _r(self.activations_gb),
                "kv_cache_gb": _r(self.kv_cache_gb), "other_gb": _r(self.other_gb),
                "reserved_gb": _r(self.reserved_gb), "total_gb": _r(self.total_gb), "kv_tokens": int(self.kv_tokens)}


def _r(x: float) -> float:
    return round(float(x), 4)



@dataclass(frozen=True)
class EnginePlan:
    kind: str
    """Engine name from the schedule vocabulary: ``torch``, ``vllm``, ``megatron``..."""
    role: str
    """``train`` (forward, backward, optimizer) or ``rollout`` (generate)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    options: dict = field(default_factory=dict)
    """Other engine options from the schedule (``gpu_memory_utilization``...)."""
    pool: str = "all"
    bundles: tuple = ()
    """Indices of the pool's placement-group bundles, one per rank (tp*pp*cp*dp ranks)."""
    gpus_per_rank: float = 1.0
    """Fraction of a (logical) GPU each rank asks Ray for; < 1 when engines are colocated."""
    gpus: tuple[int, ...] = ()
    """Global GPU index of each rank (``node * gpus_per_node + local``); ranks are ordered
    tp fastest, then cp, dp, pp, so a tensor-parallel group is contiguous on one node."""
    colocated_with: tuple[str, ...] = ()
    """Other engines sharing these GPUs (``policy.rollout``...): they time-share them."""
    chosen: bool = False
    """The compiler chose this layout (the schedule wrote none for this engine)."""
    memory: Memory | None = None
    """Estimated memory of this engine on each of its GPUs."""
    origin: str = ""
    """Where the layout (or, when chosen, the placement or schedule) was written."""
    releases: str = ""
    """How this engine gives its GPU memory to the engines it shares GPUs with, between its
    phases (see :class:`MemoryPhase`), as the runtime must do: ``sleep`` (a rollout engine,
    after generating: weights offloaded to host memory, KV cache freed; woken before the next
    generation), ``offload`` (a train engine, before a generation: parameters, gradients and
    optimizer states to host memory; reloaded before its next op); empty: it stays resident
    (alone on its GPUs, on the ``cpu`` platform, or an engine that cannot free its memory)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


@dataclass(frozen=True)
class MemoryPhase:
    """One phase of a step on a pool's GPUs, and the memory each GPU holds in it (GB).

    On GPUs, engines sharing GPUs take turns: the ``generate`` phase runs the rollout
    engines, the ``train`` phase the train engines (log-probs, values, updates); an engine
    whose record frees memory gives it back while the other phase runs (``releases`` of its
    :class:`EnginePlan`). Where nothing is released (the ``cpu`` platform: logical GPUs, CPU
    vLLM has no sleep mode), there is one ``resident`` phase holding every engine.
    """

    name: str
    """``generate`` | ``train`` | ``resident``."""
    active: tuple[str, ...]
    """Engines that run in this phase, at their full memory."""
    released: tuple[tuple[str, str], ...] = ()
    """``(engine, how)`` of engines that gave their memory back for this phase (``sleep`` or
    ``offload``); each still holds its remainder (CUDA context, a sleeping engine's workspace)."""
    resident: tuple[str, ...] = ()
    """Engines that do not run in this phase but keep their memory (they cannot free it)."""
    peak_gb: float = 0.0
    """Memory per GPU in this phase: active and resident engines in full, released ones' remainders."""


@dataclass(frozen=True)
class PoolMemory:
    """The memory of one pool's GPUs over a step: the phases the runtime runs, and their peak."""

    pool: str
    engines: tuple[str, ...]
    """Engines on these GPUs."""
    turns: bool
    """The engines take turns (at least one releases its memory while another runs); False:
    they are resident together and the peak is their sum."""
    phases: tuple[MemoryPhase, ...]
    peak_gb: float
    """The largest phase, per GPU."""
    capacity_gb: float
    """Memory of one GPU (``cpu``: the machine's RAM over its logical GPUs)."""


@dataclass(frozen=True)
class ModelPlan:
    id: str
    source: str
    """``hf`` | ``tiny`` (built locally) | ``frozen`` | ``critic`` (derived from ``base``)."""
    args: dict
    """Constructor options: ``path`` for hf, task/sizes for tiny."""
    role: str
    """``trainable`` | ``frozen`` | ``critic``."""
    base: str | None
    """For frozen/critic models: the model whose initial weights they start from."""
    train_engine: EnginePlan | None
    rollout_engine: EnginePlan | None
    optim: dict
    """AdamW settings from the model's update op (lr, weight_decay, grad_clip)."""
    origin: str
    facts: dict = field(default_factory=dict)
    """Architecture numbers the compiler used (params, layers, heads, kv_heads, hidden, vocab);
    empty when unknown (an ``hf`` path without a ``config.json`` that is not a preset)."""


@dataclass(frozen=True)
class DatasetPlan:
    id: str
    format: str
    path: str
    """Absolute path (relative paths are resolved against the declaring file's directory)."""
    prompt: str
    answer: str
    eval_path: str
    origin: str
    chat: bool = False
    """Prompts are chat messages rendered with the tokenizer's chat template (``chat = true``,
    :mod:`flowrl.data.chat`); False: raw text."""
    bad_rows: str = "error"
    """What a bad row does (:data:`flowrl.catalog.ops.BAD_ROW_POLICIES`): ``error`` refuses it naming
    file and row; ``skip`` leaves it out and counts it (``data/rows_skipped``)."""
    eval_reward: str = ""
    """The rule verifier that scores the held-out split (``eval_reward = "math"``); empty: the flow's
    reward (:mod:`flowrl.runtime.heldout`)."""
    completion: str = ""
    """The field of a reference completion every row must hold (``completion = "solution"``); empty:
    none. The runtime checks it as it checks the answer's; the plan's response lengths read it."""
    template: str = ""
    """The prompt written from each row's fields (``"Question: {question}\\nAnswer:"``); empty: the
    ``prompt`` field as written (:mod:`flowrl.data.rows`)."""
    system: str = ""
    """A system prompt put before every prompt (a system message through the chat template)."""
    chat_auto: bool = False
    """``chat`` unset with a template or system prompt: rendered through the tokenizer's chat template
    where it has one, else as text (``chat`` True: always through it, the compiler checked it has one)."""
    parts: tuple[str, ...] = ()
    """A mixture (``mix(a, b, ...)``): the ids of the datasets it draws from, in order; empty otherwise."""
    weights: tuple[float, ...] = ()
    """A mixture's weight per part (not normalized)."""
    options: dict = field(default_factory=dict)
    """The constructor's other options as written (``split``, ``eval`` of ``hf_dataset``, ``stream``,
    ``window``; a procedural source's own), read by its row source (:data:`flowrl.data.sources.SOURCES`)."""

    @property
    def row_fields(self) -> tuple[str, ...]:
        """The fields every row must hold besides the prompt (:func:`row_fields`)."""
        return row_fields(self.answer, self.completion)


def row_fields(answer: str, completion: str = "") -> tuple[str, ...]:
    """The fields every row of a dataset must hold besides the prompt: the answer's, and the reference
    completion's when one is named. ``check`` reads a file's first row with them, ``run`` every row."""
    return (answer, completion) if completion else (answer,)


@dataclass(frozen=True)
class RewardPlan:
    id: str
    kind: str
    """``verifier`` | ``python_reward`` | ``reward_model``."""
    options: dict
    origin: str


@dataclass(frozen=True)
class EnvSizing:
    """How many workers an environment's pool gets, and why (``size_env_pools``)."""

    workers: int
    why: str


@dataclass(frozen=True)
class EnvPlan:
    """An environment resource (``python_env(...)``), served by a pool of workers (:mod:`flowrl.runtime.env_pool`)."""

    id: str
    kind: str
    """The op that declared it (``python_env``); its record names the runtime's builder."""
    options: dict
    """Its keyword options (``timeout``, ``workers``: as written, else as the schedule sized the pool)
    and ``target``: the ``module:Class`` it names."""
    origin: str
    workers_why: str = ""
    """Why the pool has its ``workers`` (as written, or the schedule's sizing)."""


@dataclass(frozen=True)
class OpPlan:
    id: str
    kind: str
    """OpKind value: sample, generate, score, logprobs, values, advantage, update, resync, ..."""
    op: str
    """Catalogue name: ``group_advantage``, ``gae``..."""
    inputs: dict
    """Argument name -> producing op / resource id."""
    options: dict
    """Keyword options with defaults filled in; losses as ``{"name": ..., **options}``."""
    model: str | None
    engine: str | None
    """Where it runs: rollout, train, reward, driver, env."""
    fields: tuple
    origin: str
    region: str | None = None


@dataclass(frozen=True)
class ReshardPiece:
    """One contiguous copy: rows ``[src_start, src_stop)`` of shard ``src_rank`` of source tensor
    ``src_name`` go to rows ``[dst_start, dst_stop)`` of destination shard ``dst_rank`` (rows = the
    sharded dimension; ``{i}`` in names stands for every layer)."""

    src_name: str
    src_rank: int
    src_start: int
    src_stop: int
    dst_rank: int
    dst_start: int
    dst_stop: int


@dataclass(frozen=True)
class ReshardTensor:
    """How one tensor family moves from the train layout to the rollout layout.

    ``name`` is the engines' (fused) tensor, ``{i}`` standing for every layer; ``parts`` the
    checkpoint tensors fused into it, in order (``q_proj, k_proj, v_proj``). ``action`` is
    ``copy`` (same sharding), ``gather`` (several source shards make one destination
    shard), ``split`` (one source shard feeds several), ``regroup`` (fused parts re-packed:
    Megatron interleaves q/k/v per KV-head group, vLLM concatenates them per shard).
    """

    name: str
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    """Full (unsharded, fused) shape."""
    dim: int
    """The sharded dimension (-1: replicated)."""
    action: str
    src_shards: int
    dst_shards: int
    pieces: tuple[ReshardPiece, ...]
    layers: int = 1
    """How many tensors this family stands for (one per layer, or 1)."""


@dataclass(frozen=True)
class ReshardPlan:
    """Train layout -> rollout layout of a model's weights: which rows of which train rank each
    rollout rank needs (:mod:`flowrl.compiler.reshard`). Shown by ``flowrl plan``. The runtime
    executes its destination side: a resync sends whole checkpoint tensors to each replica, and an
    engine with :attr:`~flowrl.catalog.engines.EngineSpec.rank_shards` (vLLM, tp > 1) sends each of
    its ranks only the rows the pieces give it (:mod:`flowrl.engines.tp_shards`)."""

    src: str
    """Source engine and layout, e.g. ``megatron(tp=2, pp=1)``."""
    dst: str
    src_tp: int
    src_pp: int
    dst_tp: int
    tensors: tuple[ReshardTensor, ...]
    stage_layers: tuple[int, ...] = ()
    """Layers held by each pipeline stage of the source (``layers / pp`` each)."""


@dataclass(frozen=True)
class ResyncPlan:
    id: str
    model: str
    after: str
    """The update op whose weights are sent."""
    protocol: str
    """``inplace`` (colocated) | ``broadcast`` | ``checkpoint`` | ``delta``..."""
    bucket_bytes: int
    every: int
    origin: str
    options: dict = field(default_factory=dict)
    """Other protocol options (``dir``, ``keep``, ``threshold``)."""
    reason: str = ""
    """Why this protocol: as written, or what the placement implied."""
    route: str = ""
    """``local`` (same GPUs) | ``intra-node`` | ``inter-node``: how far the weights travel."""
    transport: str = ""
    """What moves the bytes: ``cuda``/``ray`` (in place), ``nccl``, ``gloo``, ``disk``."""
    overlap: bool = False
    """Packing and sending overlap the next generation (disaggregated engines only)."""
    total_bytes: int = 0
    """Bytes of one full copy of the weights, as the rollout engine holds them."""
    buckets: int = 0
    """Buckets per resync: ceil(total_bytes / bucket_bytes) (a tensor larger than a bucket is split)."""
    largest_tensor: str = ""
    largest_bytes: int = 0
    seconds: float = 0.0
    """Estimated time of one resync (gather + transfer), seconds."""
    reshard: ReshardPlan | None = None


@dataclass(frozen=True)
class PoolPlan:
    name: str
    gpus: int
    strategy: str
    """Ray placement-group strategy: STRICT_PACK (one node), PACK (several nodes), SPREAD."""
    gpu_ids: tuple[int, ...] = ()
    """Global index of each bundle's GPU (``node * gpus_per_node + local``)."""
    nodes: tuple[int, ...] = ()
    """The node of each bundle."""
    engines: tuple[str, ...] = ()
    """Engines placed on this pool (``policy.train``...)."""
    origin: str = ""


@dataclass(frozen=True)
class PipelinePlan:
    """The modulo schedule: how many steps are in flight and how samples are buffered."""

    in_flight: int
    """Steps in flight = staleness: generation of step k reads the weights of step k - staleness."""
    max_version_lag: int
    """Most policy versions a trained sample may be behind: staleness - 1 + (every - 1)."""
    buffer_samples: int
    """Capacity of the versioned experience buffer (samples per step x steps in flight)."""
    samples_per_step: int
    requests_per_step: int
    """Generation requests sent per step (> samples with partial rollout)."""
    over_provision: float = 1.0
    recycle: bool = False
    """Unfinished generations resume in the next step (partial rollout)."""
    origin: str = ""


@dataclass(frozen=True)
class OpCost:
    """Estimated time of one op per step, and where it runs."""

    id: str
    kind: str
    where: str
    """``policy.train``, ``policy.rollout``, ``driver``, ``reward``..."""
    seconds: float
    tokens: int = 0


@dataclass(frozen=True)
class CostPlan:
    """Estimates of the cost model and the simulator for this plan (seconds, GB, tokens)."""

    profile: str
    """The hardware profile used (``H100``, ``cpu``...) and its source."""
    step_s: float
    """Simulated seconds per step in steady state."""
    samples_per_s: float
    tokens_per_s: float
    """Trained tokens (prompt + response) per second."""
    bubble: float
    """Fraction of GPU time not doing useful work (idle, or decoding below full batch)."""
    breakdown: dict = field(default_factory=dict)
    """Phase -> average seconds per step: generate, logprobs, update, resync, reward, ..."""
    utilization: dict = field(default_factory=dict)
    """Pool -> fraction of its GPU time busy."""
    memory: dict = field(default_factory=dict)
    """Pool -> peak GB per GPU (colocated engines time-share: the largest engine, plus the
    contexts of the others) and its capacity: ``{"peak_gb": .., "capacity_gb": ..}``."""
    ops: tuple[OpCost, ...] = ()
    assumptions: dict = field(default_factory=dict)
    """Workload assumed: prompt tokens, response-length distribution, steps simulated, seed."""
    bounds: dict = field(default_factory=dict)
    """Lower bounds on the step time: ``resource`` (busiest pool) and ``recurrence``
    (the weight cycle's latency / staleness): the modulo-scheduling view of async RL."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One schedule ``auto`` considered and ranked."""

    rank: int
    summary: str
    """E.g. ``disaggregated gen 32 / train 32, megatron(tp=2, pp=1, dp=16), vllm(tp=1, dp=32), s=2, nccl``."""
    step_s: float
    samples_per_s: float
    bubble: float
    schedule: str
    """The candidate as a manual schedule block (``flowrl`` syntax)."""
    why: str = ""


@dataclass(frozen=True)
class EngineVerdict:
    """What ``schedule auto`` made of one engine of the catalogue for one role of the flow."""

    role: str
    """``train`` or ``rollout``."""
    engine: str
    verdict: str
    """``chosen`` (the winner's), ``feasible`` (some layout fits, the winner was faster or simpler),
    ``refused`` (no layout of it fits: ``why`` gives the first reason), ``not searched`` (its
    record says ``searched = False``), ``not on platform`` (it does not run on the cluster's)."""
    why: str = ""
    seconds: float = 0.0
    """Its best feasible layout's seconds per step of the role's ops (``chosen``, ``feasible``)."""


@dataclass(frozen=True)
class SearchReport:
    """What ``schedule auto`` searched, rejected and chose."""

    considered: int
    feasible: int
    simulated: int
    seconds: float
    """Wall time of the search."""
    staleness_limit: int
    winner: Candidate
    runners_up: tuple[Candidate, ...] = ()
    rejected: dict = field(default_factory=dict)
    """Reason (the diagnostic's message pattern) -> how many candidates it rejected."""
    examples: dict = field(default_factory=dict)
    """Reason -> one full message, with numbers."""
    engines: tuple[EngineVerdict, ...] = ()
    """Every engine of the catalogue serving a role the flow has, and what the search made of it."""


@dataclass(frozen=True)
class RunPlan:
    steps: int = 20
    seed: int = 0
    eval_every: int = 10
    save_every: int = 0
    keep_last: int = 0
    """Checkpoint retention: keep the newest this many (0, and ``keep_best`` 0: keep every one); older
    ones are deleted as they are superseded (TRL's ``save_total_limit``)."""
    keep_best: int = 0
    """Also keep this many checkpoints with the best held-out accuracy (``eval/accuracy``; TRL's
    ``load_best_model_at_end``); with ``keep_last`` 0 the newest one is kept too (a run resumes from it)."""
    export_every: int = 0
    """Every this many steps, and after the last, the policy is exported as a Hugging Face directory to
    ``RUN_DIR/exports/step_NNNNNN`` (``flowrl export``); 0: never."""
    log: tuple[str, ...] = ()
    """Experiment trackers the run writes every metric to (names of ``flowrl.catalog.loggers.LOGGERS``)."""
    log_samples: int = 0
    """Every this many steps, a table of sample completions (prompt, completion, reward, step)
    goes to ``samples.jsonl`` and to each tracker (0: never)."""
    log_name: str = ""
    """The trackers' run name (W&B, MLflow); empty: ``$WANDB_NAME`` for W&B, else the run directory's name."""
    log_project: str = ""
    """W&B project and MLflow experiment; empty: ``$WANDB_PROJECT`` / ``$MLFLOW_EXPERIMENT_NAME``, else ``flowrl``."""
    log_entity: str = ""
    """W&B entity (team or user); empty: ``$WANDB_ENTITY``, else the account's default."""
    log_group: str = ""
    """W&B run group (MLflow: the tag ``group``); empty: ``$WANDB_RUN_GROUP``, else none."""
    log_tags: tuple[str, ...] = ()
    """Tags of the trackers' run (W&B tags; MLflow tags, ``key=value`` or a bare key)."""
    log_uri: str = ""
    """MLflow tracking URI (``http://host:5000``, a database, ``file:``); empty: ``$MLFLOW_TRACKING_URI``, else
    the file store ``RUN_DIR/mlruns``. Never holds a password (credentials come from MLflow's variables)."""

    @classmethod
    def from_settings(cls, values: dict) -> "RunPlan":
        """From run settings as a flow or the command line gives them: ints, ``log`` as
        ``"tensorboard,wandb"`` (or a sequence of names), ``log_tags`` as ``"a,b"`` (or a sequence),
        the other ``log_*`` strings. Names are checked by the compiler's run-settings pass and the
        command line, not here."""
        typed = {k: (str(v).strip() if k in TEXT_SETTINGS else int(v)) for k, v in values.items()
                 if k not in ("log", "log_tags")}
        if "log" in values:
            log = values["log"]
            names = log.split(",") if isinstance(log, str) else log
            typed["log"] = tuple(n.strip().lower() for n in names if n.strip() and n.strip().lower() != "none")
        if "log_tags" in values:
            tags = values["log_tags"]
            typed["log_tags"] = tuple(t.strip() for t in (tags.split(",") if isinstance(tags, str) else tags) if t.strip())
        return cls(**typed)


TEXT_SETTINGS = ("log_name", "log_project", "log_entity", "log_group", "log_uri")
"""Run settings that are plain strings (``log`` and ``log_tags`` are comma-separated lists)."""


@dataclass(frozen=True)
class ExecutionPlan:
    flow: str
    source: str
    cluster: dict
    pools: tuple[PoolPlan, ...]
    models: tuple[ModelPlan, ...]
    datasets: tuple[DatasetPlan, ...]
    rewards: tuple[RewardPlan, ...]
    ops: tuple[OpPlan, ...]
    """In execution order (a topological order of the intra-step graph)."""
    resyncs: tuple[ResyncPlan, ...]
    staleness: int
    run: RunPlan
    regions: dict = field(default_factory=dict)
    """Region id -> ``{"count": turns, "until": field or None, "carry": {op id: {arg: op id}}}``: a
    ``repeat`` loop; ``carry`` names the values its TURN edges carry to the next turn (from turn 2 on,
    argument ``arg`` of op ``op id`` reads that op's value of the turn before)."""
    version: int = PLAN_VERSION
    pipeline: PipelinePlan | None = None
    """Steps in flight, buffer, partial rollout (from ``staleness`` and ``partial_rollout``)."""
    estimate: CostPlan | None = None
    """Cost model + simulator estimates (step time, breakdown, memory per GPU)."""
    search: SearchReport | None = None
    """For ``schedule ... auto``: the candidates and why the winner won."""
    auto: bool = False
    """The schedule was chosen by the compiler."""
    scheduled: bool = True
    """False: the flow has no ``schedule`` block and runs on the default schedule."""
    memory: tuple[PoolMemory, ...] = ()
    """Each pool's memory phases: which engine sleeps or offloads when, and each phase's peak."""
    envs: tuple[EnvPlan, ...] = ()
    """Environment resources read by ``env_step`` ops."""
    params: dict = field(default_factory=dict)
    """The entry flow's scalar parameters as this run uses them (defaults after ``--set``): the
    trackers' run configuration."""

    def model(self, mid: str) -> ModelPlan:
        return next(m for m in self.models if m.id == mid)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ExecutionPlan":
        return _from_plain(cls, json.loads(text))


def _from_plain(tp, value: Any):
    """Rebuild dataclasses (and tuples) from their JSON form, guided by type hints."""
    if value is None:
        return None
    if is_dataclass(tp):
        hints = get_type_hints(tp)
        return tp(**{f.name: _from_plain(hints[f.name], value[f.name]) for f in fields(tp) if f.name in value})
    origin = get_origin(tp)
    if origin is tuple:
        (item, *_rest) = get_args(tp) or (Any,)
        return tuple(_from_plain(item, v) for v in value)
    if origin is not None and type(None) in get_args(tp):  # Optional[X]
        inner = next(a for a in get_args(tp) if a is not type(None))
        return _from_plain(inner, value)
    if tp is tuple:
        return tuple(value)
    return value
