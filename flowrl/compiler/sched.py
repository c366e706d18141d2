"""Schedule records shared by the schedule passes: what a schedule says, and what they decided.

:class:`ScheduleSpec` is a schedule as data: the pools, placements, layouts, staleness,
resync protocols and partial-rollout setting, each with the span it was written at. It
comes from the ``schedule`` block (:func:`spec_from_ast`), from the default schedule when
a flow has none (:func:`default_spec`), or from ``schedule auto``'s search
(``flowrl.compiler.auto``), so the placement, layout, staleness and sync passes check one
thing however the schedule was made.

:class:`SchedState` is what the passes decide, written into ``FlowGraph.sched`` one pass
at a time (``dataclasses.replace``): the schedule, model facts and hardware profile
(choose_schedule), pools and engine placements (assign_placement), layouts, memory and
memory phases (plan_layouts), staleness and the modulo schedule (resolve_staleness),
protocols, buckets and resharding (select_sync_protocol), estimates (estimate_cost).
``lower`` copies it into the :class:`~flowrl.plan.ExecutionPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.catalog.engines import AXES, ENGINES
from flowrl.catalog.models import ModelFacts
from flowrl.catalog.ops import OPS, OpKind
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Span
from flowrl.ir.graph import FlowGraph, Ref
from flowrl.plan import CostPlan, EnginePlan, PipelinePlan, PoolMemory, PoolPlan, SearchReport
from flowrl.syntax import ast

PAR_KEYS = AXES


@dataclass(frozen=True)
class PoolSpec:
    name: str
    gpus: int
    nodes: int | None
    """Nodes the pool spans as written; None: as few as fit."""
    span: Span


@dataclass(frozen=True)
class PlaceSpec:
    pool: str
    span: Span
    colocate: bool
    """Written with ``colocate`` (sharing is intended) rather than ``place``."""


@dataclass(frozen=True)
class LayoutSpec:
    kind: str
    options: dict
    """Every option as written (tp, pp, dp, cp and engine options)."""
    span: Span


@dataclass(frozen=True)
class ResyncSpec:
    protocol: str
    options: dict
    """Options as written (``bucket``, ``overlap``, ``dir``...)."""
    every: int
    span: Span
    chosen: str = ""
    """Set when ``schedule auto`` chose this protocol: why."""


@dataclass(frozen=True)
class PartialSpec:
    over_provision: float
    recycle: bool
    span: Span


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule as data (every field carries where it was written, for diagnostics)."""

    cluster: dict
    """``nodes``, ``gpus_per_node``, ``gpu``, ``address``."""
    span: Span
    """The schedule's header (``schedule main on cluster(...)``), or the flow's name."""
    pools: tuple[PoolSpec, ...] = ()
    placement: dict = field(default_factory=dict)
    """Engine key (``policy.rollout``) -> PlaceSpec."""
    layouts: dict = field(default_factory=dict)
    """Engine key -> LayoutSpec."""
    staleness: int = 1
    staleness_span: Span | None = None
    staleness_limit: int | None = None
    """``auto``: the bound ``staleness <= N``."""
    resyncs: dict = field(default_factory=dict)
    """Model id -> ResyncSpec."""
    partial: PartialSpec | None = None
    auto: bool = False
    written: bool = True
    """False for the default schedule of a flow without a ``schedule`` block."""

    @property
    def gpus(self) -> int:
        return int(self.cluster["nodes"]) * int(self.cluster["gpus_per_node"])


@dataclass(frozen=True)
class SchedState:
    """What the schedule passes decided (``FlowGraph.sched``)."""

    spec: ScheduleSpec
    facts: dict
    """Model id -> ModelFacts | None."""
    hw: Profile
    engines_needed: tuple[str, ...]
    """Engine keys the flow uses (``policy.train``, ``policy.rollout``, ``grpo.ref.train``)."""
    pools: tuple[PoolPlan, ...] = ()
    engines: dict = field(default_factory=dict)
    """Engine key -> EnginePlan (placement; layout and memory after plan_layouts)."""
    memory: tuple[PoolMemory, ...] = ()
    """The memory phases of each pool, as the runtime runs them (plan_layouts)."""
    staleness: int = 1
    pipeline: PipelinePlan | None = None
    resyncs: dict = field(default_factory=dict)
    """Resync node id -> ResyncPlan."""
    estimate: CostPlan | None = None
    search: SearchReport | None = None
    notes: tuple[str, ...] = ()
    """Advice the plan display shows (not errors)."""
    envs: dict = field(default_factory=dict)
    """Environment id -> :class:`~flowrl.plan.EnvSizing` of its pool (size_env_pools)."""
    lengths: dict = field(default_factory=dict)
    """Response-length model overrides for the estimates (``kind``, ``median``, ``sigma``), from
    ``ctx.options["lengths"]``; empty: the workload's default (flowrl.compiler.workload.lengths)."""
    data: dict = field(default_factory=dict)
    """Generate op id -> :class:`~flowrl.compiler.data_workload.DataWorkload` measured from its
    datasets; a generate not in it is estimated with the assumed lengths
    (:func:`~flowrl.compiler.workload.prompt_tokens`, :func:`~flowrl.compiler.workload.lengths`)."""


# ---- engines of a flow -----------------------------------------------------------------------------


def engines_needed(graph: FlowGraph) -> tuple[str, ...]:
    """Engine keys ``MODEL.ROLE`` the flow's ops use, in model order (train before rollout); ops
    the compiler elided (``graph.elided``) do not run, so they need no engine."""
    roles: dict[str, set[str]] = {}
    for n in graph.nodes():
        if n.model and n.kind != OpKind.MODEL and n.id not in graph.elided:
            roles.setdefault(n.model, set()).add("rollout" if n.kind == OpKind.GENERATE else "train")
        spec = OPS.get(n.op)
        if spec is not None and spec.serves_model and n.args and isinstance(n.args[0], Ref):
            roles.setdefault(n.args[0].target, set()).add(spec.serves_engine)  # reward_model(m): m's scorer
    out = []
    for n in graph.nodes():
        if n.kind == OpKind.MODEL:
            for role in ("train", "rollout"):
                if role in roles.get(n.id, ()):
                    out.append(f"{n.id}.{role}")
    return tuple(out)


def model_of(key: str) -> str:
    return key.rsplit(".", 1)[0]


def role_of(key: str) -> str:
    return key.rsplit(".", 1)[1]


def match_model(name: str, ids) -> str | None:
    """A schedule's model name -> the model id (exact, else the unique ``*.name``)."""
    ids = list(ids)
    if name in ids:
        return name
    hits = sorted(i for i in ids if i.endswith("." + name))
    return hits[0] if len(hits) == 1 else None


def target_key(t: ast.Target, ids) -> str | None:
    mid = match_model(t.model, ids)
    return None if mid is None else f"{mid}.{t.role or 'train'}"


# ---- from the AST ----------------------------------------------------------------------------------


def literal_options(call: ast.Call | None) -> dict:
    """A call's keyword options whose values are literals (others were reported by check_schedule)."""
    if call is None:
        return {}
    return {kw.name: kw.value.value for kw in call.kwargs if isinstance(kw.value, ast.Literal)}


CLUSTER_DEFAULTS = {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu", "address": ""}


def default_spec(graph: FlowGraph) -> ScheduleSpec:
    """The default schedule: one node with one GPU, everything colocated on it, staleness 1."""
    return ScheduleSpec(dict(CLUSTER_DEFAULTS), graph.span, written=False)


def spec_from_ast(graph: FlowGraph) -> ScheduleSpec:
    """The flow's ``schedule`` block as a :class:`ScheduleSpec` (the default one if there is none)."""
    s: ast.ScheduleDef | None = graph.schedule
    if s is None:
        return default_spec(graph)
    cluster = dict(CLUSTER_DEFAULTS)
    cluster.update({k: v for k, v in literal_options(s.cluster).items() if k in cluster})
    header = s.cluster.span if s.cluster is not None else s.flow_span
    span = Span(s.span.path, s.span.line, s.span.column, header.end_line, header.end_column)
    ids = [n.id for n in graph.nodes() if n.kind == OpKind.MODEL]
    pools, placement, layouts, resyncs = [], {}, {}, {}
    staleness, st_span, limit, partial = 1, None, None, None
    for st in s.body:
        if isinstance(st, ast.Pool):
            opts = literal_options(st.value)
            nodes_written = any(kw.name == "nodes" for kw in st.value.kwargs)
            pools.append(PoolSpec(st.name, int(opts.get("gpus", 1)), int(opts["nodes"]) if nodes_written
                                  and "nodes" in opts else None, st.span))
        elif isinstance(st, (ast.Colocate, ast.Place)):
            for t in st.targets:
                key = target_key(t, ids)
                if key is not None:
                    placement[key] = PlaceSpec(st.pool or "all", st.span, isinstance(st, ast.Colocate))
        elif isinstance(st, ast.Layout):
            key = target_key(st.target, ids)
            if key is not None:
                layouts[key] = LayoutSpec(st.engine.func, literal_options(st.engine), st.span)
        elif isinstance(st, ast.Staleness):
            if st.bound_only:
                limit = st.value
            else:
                staleness, st_span = st.value, st.span
            if st_span is None:
                st_span = st.span
        elif isinstance(st, ast.Resync):
            mid = match_model(st.model, ids)
            if mid is not None and st.protocol.func in PROTOCOLS:
                resyncs[mid] = ResyncSpec(st.protocol.func, literal_options(st.protocol), st.every or 1, st.span)
        elif isinstance(st, ast.SchedCall) and st.call.func == "partial_rollout":
            opts = literal_options(st.call)
            partial = PartialSpec(float(opts.get("over_provision", 1.25)), bool(opts.get("recycle", True)), st.span)
    return ScheduleSpec(cluster, span, tuple(pools), placement, layouts, staleness, st_span, limit, resyncs,
                        partial, auto=s.auto, written=True)


def engine_label(e: EnginePlan) -> str:
    """``megatron(tp=2, pp=1, dp=4)`` / ``vllm(tp=1, dp=8)`` / ``fsdp(dp=8)``: the layout with the
    engine's parallel axes (its record's), context parallelism and Megatron's expert parallelism
    (an option, ``ep``) only when used."""
    axes = ENGINES[e.kind].axes
    parts = [f"{k}={getattr(e, k)}" for k in PAR_KEYS if k in axes and (k != "cp" or e.cp != 1)]
    if "ep" in ENGINES[e.kind].options and e.options.get("ep", 1) != 1:
        parts.append(f"ep={e.options['ep']}")
    return f"{e.kind}({', '.join(parts)})"


__all__ = ["ScheduleSpec", "PoolSpec", "PlaceSpec", "LayoutSpec", "ResyncSpec", "PartialSpec", "SchedState",
           "engines_needed", "spec_from_ast", "default_spec", "literal_options", "match_model", "target_key",
           "model_of", "role_of", "engine_label", "ModelFacts"]
