"""Lower a checked FlowGraph and its schedule to an :class:`ExecutionPlan`.

Requires: every pass in ``PASSES``. Without a ``schedule`` block the default schedule
applies: one node with one (logical) GPU, every engine colocated on it, synchronous
(staleness 1), in-place resync, ``torch`` training and ``vllm`` rollout.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... dataset d = jsonl("d.jsonl")
... flow main() { b = sample(d, size = 2)  r = generate(m, b) }''', "/tmp/x.flow")
>>> plan = lower(g, {})
>>> plan.model("m").rollout_engine.kind, plan.staleness
('vllm', 1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flowrl.compiler.plan import (DatasetPlan, EnginePlan, ExecutionPlan, ModelPlan, OpPlan, PoolPlan,
                                  RewardPlan, RunPlan, ResyncPlan)
from flowrl.diagnostics import Collector, SourceMap
from flowrl.ir.graph import Config, Const, EdgeKind, FlowGraph, Node, Ref, Symbol, plain
from flowrl.ir.ops import RESOURCE_KINDS, OpKind
from flowrl.ir.schedule_catalog import PROTOCOLS
from flowrl.syntax import ast

RUN_PARAMS = ("steps", "seed", "eval_every", "save_every")
"""Entry-flow parameters the runtime reads as run settings (``--set steps=100`` overrides)."""

DEFAULT_TRAIN = "torch"
DEFAULT_ROLLOUT = "vllm"


@dataclass
class _Layouts:
    """The schedule's statements, gathered by what they configure."""

    cluster: dict
    layouts: dict  # target "m.train" / "m.rollout" / "m" -> ast.Call
    staleness: int
    resync: dict  # model id -> ast.Resync
    colocated: list  # ast.Colocate


def lower(graph: FlowGraph, run_overrides: dict | None = None) -> ExecutionPlan:
    errors = Collector(graph.sources or SourceMap())
    sched = _gather(graph)
    models = _models(graph, sched, errors)
    datasets, rewards = _resources(graph, errors)
    ops = tuple(_op(n) for n in graph.topo_order() if n.kind not in RESOURCE_KINDS)
    resyncs = tuple(_resync(graph, n, sched) for n in graph.nodes() if n.kind == OpKind.RESYNC)
    gpus = sched.cluster["nodes"] * sched.cluster["gpus_per_node"]
    errors.raise_if_any()
    return ExecutionPlan(
        flow=graph.name, source=graph.span.path, cluster=sched.cluster,
        pools=(PoolPlan("all", gpus, "PACK" if sched.cluster["nodes"] == 1 else "SPREAD"),),
        models=models, datasets=datasets, rewards=rewards, ops=ops, resyncs=resyncs,
        staleness=sched.staleness, run=_run(graph, run_overrides or {}),
        regions={rid: {"count": plain(r.count), "until": r.until} for rid, r in graph.regions.items()})


def _gather(graph: FlowGraph) -> _Layouts:
    s: ast.ScheduleDef | None = graph.schedule
    cluster = {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}
    out = _Layouts(cluster, {}, 1, {}, [])
    if s is None:
        return out
    if s.cluster is not None:
        for kw in s.cluster.kwargs:
            if isinstance(kw.value, ast.Literal):
                cluster[kw.name] = kw.value.value
    models = {n.id for n in graph.nodes() if n.kind == OpKind.MODEL}
    for st in s.body:
        if isinstance(st, ast.Layout):
            out.layouts[_target_key(st.target, models)] = st.engine
        elif isinstance(st, ast.Staleness) and not st.bound_only:
            out.staleness = st.value
        elif isinstance(st, ast.Resync):
            out.resync[_match(st.model, models)] = st
        elif isinstance(st, ast.Colocate):
            out.colocated.append(st)
    return out


def _match(name: str, ids: set[str]) -> str:
    if name in ids:
        return name
    hits = sorted(i for i in ids if i.endswith("." + name))
    return hits[0] if hits else name


def _target_key(t: ast.Target, ids: set[str]) -> str:
    mid = _match(t.model, ids)
    return f"{mid}.{t.role or 'train'}"


def _engine(call: ast.Call | None, default: str, role: str, colocated_with: int) -> EnginePlan:
    opts = {}
    if call is not None:
        for kw in call.kwargs:
            if isinstance(kw.value, ast.Literal):
                opts[kw.name] = kw.value.value
    par = {k: int(opts.pop(k, 1)) for k in ("tp", "pp", "dp", "cp")}
    world = par["tp"] * par["pp"] * par["dp"] * par["cp"]
    return EnginePlan(kind=call.func if call is not None else default, role=role, options=opts,
                      bundles=tuple(range(world)), gpus_per_rank=round(1.0 / max(colocated_with, 1), 6), **par)


def _models(graph: FlowGraph, sched: _Layouts, errors: Collector) -> tuple[ModelPlan, ...]:
    readers: dict[str, set[str]] = {}
    for n in graph.nodes():
        if n.model and n.kind != OpKind.MODEL:
            readers.setdefault(n.model, set()).add("rollout" if n.kind == OpKind.GENERATE else "train")
    n_engines = sum(len(r) for r in readers.values()) or 1  # all colocated on one GPU (default placement)
    optims = {n.model: {k: plain(n.attr(k)) for k in ("lr", "weight_decay", "grad_clip")}
              for n in graph.nodes() if n.kind == OpKind.UPDATE}
    out = []
    for n in graph.nodes():
        if n.kind != OpKind.MODEL:
            continue
        if n.op == "param":
            errors.error("E501", f"model `{n.id}` is a parameter without a value, so there is nothing to run",
                         n.span, "run a flow whose models are declared (e.g. `model policy = hf(\"dir\")`), "
                                 "or give the parameter a default")
            continue
        base = n.args[0].target if n.args and isinstance(n.args[0], Ref) else None
        args = {k: plain(v) for k, v in n.attrs}
        if n.op == "hf" and n.args and isinstance(n.args[0], Const):
            args["path"] = _abspath(graph, n, str(n.args[0].value))
        uses = readers.get(n.id, set())
        train = _engine(sched.layouts.get(f"{n.id}.train"), DEFAULT_TRAIN, "train", n_engines) \
            if "train" in uses else None
        rollout = _engine(sched.layouts.get(f"{n.id}.rollout"), DEFAULT_ROLLOUT, "rollout", n_engines) \
            if "rollout" in uses else None
        out.append(ModelPlan(n.id, n.op, args, n.role or "trainable", base, train, rollout,
                             optims.get(n.id, {}), str(n.span)))
    return tuple(out)


def _abspath(graph: FlowGraph, node: Node, path: str) -> str:
    """Paths in a flow are relative to the file that wrote them (like imports)."""
    if os.path.isabs(path) or node.span.path.startswith("<"):
        return path
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(node.span.path)), path))


def _resources(graph: FlowGraph, errors: Collector):
    datasets, rewards = [], []
    for n in graph.nodes():
        if n.op == "param" and n.kind in (OpKind.DATASET, OpKind.REWARD_FN):
            errors.error("E501", f"`{n.id}` is a parameter without a value, so there is nothing to run", n.span,
                         "run a flow that passes it a declared dataset / reward")
        elif n.kind == OpKind.DATASET:
            path = _abspath(graph, n, str(plain(n.args[0]))) if n.args else ""
            ev = str(plain(n.attr("eval")) or "")
            datasets.append(DatasetPlan(n.id, n.op, path, str(plain(n.attr("prompt"))), str(plain(n.attr("answer"))),
                                        _abspath(graph, n, ev) if ev else "", str(n.span)))
        elif n.kind == OpKind.REWARD_FN:
            opts = {k: plain(v) for k, v in n.attrs}
            if n.args:
                arg = n.args[0]
                opts["target"] = arg.target if isinstance(arg, Ref) else plain(arg)
            rewards.append(RewardPlan(n.id, n.op, opts, str(n.span)))
    return tuple(datasets), tuple(rewards)


def _op(n: Node) -> OpPlan:
    from flowrl.ir.ops import OPS

    spec = OPS.get(n.op)
    inputs = {}
    for i, a in enumerate(n.args):
        if isinstance(a, Ref):
            name = spec.args[i].name if spec and i < len(spec.args) else f"arg{i}"
            inputs[name] = a.target
    options = {k: _opt(v) for k, v in n.attrs}
    consts = [plain(a) for a in n.args if isinstance(a, Const)]
    if consts:
        options["args"] = consts
    return OpPlan(n.id, n.kind.value, n.op, inputs, options, n.model, spec.engine if spec else None,
                  tuple(sorted(n.fields)), str(n.span), n.region)


def _opt(v):
    if isinstance(v, Config):
        return {"name": v.name, **{k: _opt(x) for k, x in v.options}}
    if isinstance(v, Symbol):
        return None
    return plain(v)


def _resync(graph: FlowGraph, n: Node, sched: _Layouts) -> ResyncPlan:
    after = next(u for u, e in graph.in_edges(n.id) if e.kind == EdgeKind.WEIGHTS)
    st = sched.resync.get(n.model)
    protocol, every = "inplace", 1
    bucket = PROTOCOLS["inplace"]["bucket"].default
    if st is not None:
        protocol = st.protocol.func
        every = st.every or 1
        bucket = PROTOCOLS[protocol].get("bucket").default if "bucket" in PROTOCOLS[protocol] else 0
        for kw in st.protocol.kwargs:
            if kw.name == "bucket" and isinstance(kw.value, ast.Literal):
                bucket = int(kw.value.value)
    return ResyncPlan(n.id, n.model, after, protocol, int(bucket), every, str(n.span))


def _run(graph: FlowGraph, overrides: dict) -> RunPlan:
    values = {}
    for p in graph.params:
        if p.name in RUN_PARAMS and isinstance(p.default, ast.Literal):
            values[p.name] = int(p.default.value)
    values.update({k: int(v) for k, v in overrides.items() if k in RUN_PARAMS and v is not None})
    return RunPlan(**values)


__all__ = ["lower", "RUN_PARAMS"]
