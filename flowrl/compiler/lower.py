"""Lower a checked FlowGraph and its schedule to an :class:`ExecutionPlan`.

Requires: every pass in ``PASSES``. The schedule passes already decided pools, placements,
layouts, staleness, protocols and estimates (``graph.sched``); lowering copies them and
adds the step's ops, datasets, rewards and run settings. Without a ``schedule`` block the
default schedule applies: one node with one (logical) GPU, every engine colocated on it,
synchronous (staleness 1), in-place resync, ``torch`` training and ``vllm`` rollout.

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
from dataclasses import replace

from flowrl.compiler.elide import elided_logprobs
from flowrl.plan import DatasetPlan, ExecutionPlan, ModelPlan, OpPlan, RewardPlan, RunPlan
from flowrl.compiler.sched import SchedState
from flowrl.diagnostics import Collector, SourceMap
from flowrl.ir.graph import Config, Const, FlowGraph, Node, Ref, Symbol, plain
from flowrl.catalog.ops import RESOURCE_KINDS, OpKind
from flowrl.syntax import ast

RUN_PARAMS = ("steps", "seed", "eval_every", "save_every")
"""Entry-flow parameters the runtime reads as run settings (``--set steps=100`` overrides)."""



def lower(graph: FlowGraph, run_overrides: dict | None = None) -> ExecutionPlan:
    """The execution plan of a graph that went through every pass of ``PASSES``."""
    st: SchedState | None = graph.sched
    if st is None or st.estimate is None:
        raise ValueError(f"lower() needs a graph that went through every pass (flow `{graph.name}` stopped "
                         "before estimate_cost); compile it without `until`")
    errors = Collector(graph.sources or SourceMap())
    models = _models(graph, st, errors)
    datasets, rewards = _resources(graph, errors)
    elided = elided_logprobs(graph)  # passes the update makes redundant (flowrl.compiler.elide)
    ops = tuple(_op(n, elided) for n in graph.topo_order() if n.kind not in RESOURCE_KINDS and n.id not in elided)
    models = _without_unread_engines(models, ops, datasets, rewards)
    resyncs = tuple(st.resyncs[n.id] for n in graph.nodes() if n.kind == OpKind.RESYNC)
    errors.raise_if_any()
    return ExecutionPlan(
        flow=graph.name, source=graph.span.path, cluster=dict(st.spec.cluster), pools=st.pools,
        models=models, datasets=datasets, rewards=rewards, ops=ops, resyncs=resyncs,
        staleness=st.staleness, run=_run(graph, run_overrides or {}),
        regions={rid: {"count": plain(r.count), "until": r.until} for rid, r in graph.regions.items()},
        pipeline=st.pipeline, estimate=st.estimate, search=st.search, auto=st.spec.auto)


def _models(graph: FlowGraph, st: SchedState, errors: Collector) -> tuple[ModelPlan, ...]:
    optims = {n.model: {k: plain(n.attr(k)) for k in ("lr", "weight_decay", "beta1", "beta2", "grad_clip")}
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
        facts = st.facts.get(n.id)
        out.append(ModelPlan(n.id, n.op, args, n.role or "trainable", base, st.engines.get(f"{n.id}.train"),
                             st.engines.get(f"{n.id}.rollout"), optims.get(n.id, {}), str(n.span),
                             facts.to_dict() if facts is not None else {}))
    return tuple(out)


def _without_unread_engines(models, ops, datasets, rewards) -> tuple[ModelPlan, ...]:
    """Frozen models no op or reward reads any more (their only pass was elided) start no engine."""
    read = {op.model for op in ops} | {v for op in ops for v in op.inputs.values()} \
        | {str(r.options.get("target")) for r in rewards}
    return tuple(m if m.role != "frozen" or m.id in read else replace(m, train_engine=None, rollout_engine=None)
                 for m in models)


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


def _op(n: Node, elided: dict[str, tuple[str, str]]) -> OpPlan:
    from flowrl.catalog.ops import OPS

    spec = OPS.get(n.op)
    inputs = {}
    options = {k: _opt(v) for k, v in n.attrs}
    for i, a in enumerate(n.args):
        if isinstance(a, Ref):
            name = spec.args[i].name if spec and i < len(spec.args) else f"arg{i}"
            if elided.get(a.target, ("",))[0] == n.id:
                options.setdefault("elided", {})[name] = a.target  # argument -> dropped pass (`flowrl plan`)
                if name == "old":
                    options["old_logprobs"] = "forward"  # the pass it read was elided: its own forward stands in
                continue
            inputs[name] = a.target
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


def _run(graph: FlowGraph, overrides: dict) -> RunPlan:
    values = {}
    for p in graph.params:
        if p.name in RUN_PARAMS and isinstance(p.default, ast.Literal):
            values[p.name] = int(p.default.value)
    values.update({k: int(v) for k, v in overrides.items() if k in RUN_PARAMS and v is not None})
    return RunPlan(**values)


__all__ = ["lower", "RUN_PARAMS"]
