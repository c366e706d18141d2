"""Assign every engine of the flow a pool of GPUs on the declared cluster.

Requires: check_schedule (the schedule's statements name real models, engines and pools).

Guarantees: ``graph.sched`` is a :class:`~flowrl.compiler.sched.SchedState` holding the
cluster, the hardware profile, the model facts, the pools (with their GPUs, nodes and
Ray placement-group strategy) and one :class:`~flowrl.plan.EnginePlan` per engine
the flow uses (``policy.train``, ``policy.rollout``, ``grpo.ref.train``) with its pool,
its colocated neighbours and its share of each GPU. Layouts come in plan_layouts.

* Declared pools are disjoint slices of the cluster, carved in declaration order: a pool
  of ``gpus(gpus = N)`` takes N free GPUs on as few nodes as possible; ``nodes = K``
  takes N / K GPUs on each of K nodes. ``all`` is the whole cluster.
* An engine goes where ``place`` / ``colocate`` put it; an unplaced frozen model or critic
  follows its base model's trainer; anything else unplaced runs on ``all``.
* Engines whose GPUs overlap are colocated: they time-share the GPUs, each rank asking
  Ray for ``1 / (engines on its GPU)`` of a GPU.
* ``schedule ... auto`` first asks ``flowrl.compiler.auto`` for a schedule (the search
  reuses these checks), then places it like a written one.

Errors (E422, E423) point at the pool line, with the numbers.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset) { b = sample(d)  r = generate(m, b) }
... schedule f on cluster(nodes = 2, gpus_per_node = 4) { pool gen = gpus(gpus = 6, nodes = 2)  place m.rollout on gen }
... ''', "doc.flow", until="assign_placement")
>>> gen = next(p for p in g.sched.pools if p.name == "gen")
>>> gen.gpu_ids, gen.strategy
((0, 1, 2, 4, 5, 6), 'PACK')
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import model_facts
from flowrl.plan import EnginePlan, PoolPlan
from flowrl.compiler.sched import (DEFAULT_ENGINE, SchedState, ScheduleSpec, engines_needed, model_of, role_of,
                                   spec_from_ast)
from flowrl.cost.profiles import get_profile
from flowrl.diagnostics import Collector, Diagnostic
from flowrl.ir.graph import FlowGraph, Ref
from flowrl.catalog.ops import OpKind


def assign_placement(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    spec = spec_from_ast(graph)
    facts = model_facts(graph)
    hw = get_profile(str(spec.cluster["gpu"]), int(spec.cluster["gpus_per_node"]))
    needed = engines_needed(graph)
    search = None
    if spec.auto:
        from flowrl.compiler.auto import search_schedule

        spec, search = search_schedule(graph, spec, facts, hw, needed, ctx)
    pools, engines, problems = place(spec, needed, base_models(graph))
    errors = Collector(ctx.sources)
    errors.items.extend(problems)
    errors.raise_if_any()
    state = SchedState(spec, facts, hw, needed, pools, engines, staleness=spec.staleness, search=search,
                       lengths=dict(ctx.options.get("lengths", {})) if ctx is not None else {})
    return replace(graph, sched=state)


def base_models(graph: FlowGraph) -> dict[str, str]:
    """frozen / critic model id -> the model it is derived from."""
    out = {}
    for n in graph.nodes():
        if n.kind == OpKind.MODEL and n.op in ("frozen", "critic") and n.args and isinstance(n.args[0], Ref):
            out[n.id] = n.args[0].target
    return out


def place(spec: ScheduleSpec, needed: tuple[str, ...], bases: dict[str, str]):
    """Pools and engine placements of ``spec``: ``(pools, {engine key: EnginePlan}, [Diagnostic])``."""
    problems: list[Diagnostic] = []
    nodes, per_node = int(spec.cluster["nodes"]), int(spec.cluster["gpus_per_node"])
    pool_gpus = {"all": tuple(range(nodes * per_node))}
    pool_origin = {"all": str(spec.span)}
    free = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    for p in spec.pools:
        taken, problem = carve(p.name, p.gpus, p.nodes, free, spec, p.span)
        if problem is not None:
            problems.append(problem)
            continue
        pool_gpus[p.name] = taken
        pool_origin[p.name] = str(p.span)
    where = {}
    for key in needed:
        where[key] = _pool_of(key, spec, bases, needed, pool_gpus)
    on_gpu: dict[int, list[str]] = {}
    for key, pool in where.items():
        for gid in pool_gpus[pool]:
            on_gpu.setdefault(gid, []).append(key)
    engines = {}
    for key, pool in where.items():
        gids = pool_gpus[pool]
        share = max((len(on_gpu[g]) for g in gids), default=1)
        neighbours = sorted({k for g in gids for k in on_gpu[g]} - {key}, key=needed.index)
        engines[key] = EnginePlan(kind=DEFAULT_ENGINE[role_of(key)], role=role_of(key), pool=pool,
                                  gpus_per_rank=round(1.0 / max(share, 1), 6), colocated_with=tuple(neighbours),
                                  origin=str(spec.placement[key].span) if key in spec.placement else str(spec.span))
    used = {pool for pool in where.values()}
    order = ["all"] * ("all" in used or not spec.pools) + [p.name for p in spec.pools if p.name in pool_gpus]
    pools = tuple(_pool_plan(name, pool_gpus[name], per_node, tuple(k for k in needed if where[k] == name),
                             pool_origin[name]) for name in order)
    return pools, engines, problems


def _pool_of(key: str, spec: ScheduleSpec, bases: dict, needed: tuple, pool_gpus: dict) -> str:
    if key in spec.placement and spec.placement[key].pool in pool_gpus:
        return spec.placement[key].pool
    base = bases.get(model_of(key))
    if base is not None and role_of(key) == "train" and f"{base}.train" in spec.placement:
        pool = spec.placement[f"{base}.train"].pool  # a reference model follows its base's trainer
        if pool in pool_gpus:
            return pool
    return "all"


def carve(name: str, gpus: int, nodes: int | None, free: list[list[int]], spec: ScheduleSpec, span):
    """Take ``gpus`` free GPUs for pool ``name`` (mutating ``free``); ``(gpu ids, None)`` or ``((), problem)``."""
    per_node = int(spec.cluster["gpus_per_node"])
    n_nodes = int(spec.cluster["nodes"])
    left = sum(len(f) for f in free)
    cluster = f"cluster(nodes = {n_nodes}, gpus_per_node = {per_node})"
    if gpus > left:
        used = spec.gpus - left
        return (), Diagnostic(
            "E422", f"pool `{name}` needs {gpus} GPUs, but only {left} of the {spec.gpus} GPUs of {cluster} are "
                    f"free ({used} taken by earlier pools)", span,
            f"make the pools add up to at most {spec.gpus} GPUs, or add nodes")
    if nodes is not None:
        if gpus % nodes:
            return (), Diagnostic("E423", f"pool `{name}`: {gpus} GPUs do not split evenly over {nodes} nodes", span,
                                  f"use a multiple of {nodes} GPUs, or another `nodes`")
        each = gpus // nodes
        if each > per_node or nodes > n_nodes:
            return (), Diagnostic(
                "E423", f"pool `{name}` needs {each} GPUs on each of {nodes} node(s), but {cluster} has "
                        f"{n_nodes} node(s) of {per_node} GPUs", span,
                f"write `gpus(gpus = {gpus}, nodes = {-(-gpus // per_node)})`" if gpus <= spec.gpus
                else "shrink the pool or add nodes")
        hosts = [i for i, f in enumerate(free) if len(f) >= each][:nodes]
        if len(hosts) < nodes:
            return (), _fragmented(name, f"{each} free GPUs on each of {nodes} node(s)", free, span)
        taken = []
        for i in hosts:
            taken += free[i][:each]
            del free[i][:each]
        return tuple(sorted(taken)), None
    if gpus <= per_node:  # keep a small pool on one node
        host = next((i for i, f in enumerate(free) if len(f) >= gpus), None)
        if host is None:
            return (), _fragmented(name, f"{gpus} free GPUs on one node", free, span)
        taken = free[host][:gpus]
        del free[host][:gpus]
        return tuple(taken), None
    taken = []
    for f in sorted(free, key=len, reverse=True):  # whole free nodes first, then the rest
        grab = f[: gpus - len(taken)]
        taken += grab
        del f[: len(grab)]
        if len(taken) == gpus:
            break
    return tuple(sorted(taken)), None


def _fragmented(name: str, need: str, free: list[list[int]], span) -> Diagnostic:
    have = ", ".join(f"node {i}: {len(f)}" for i, f in enumerate(free))
    return Diagnostic("E423", f"pool `{name}` needs {need}, but earlier pools left free GPUs as {have}", span,
                      "declare the larger pools first, or let the pool span nodes with `nodes = K`")


def _pool_plan(name: str, gids: tuple[int, ...], per_node: int, engines: tuple[str, ...], origin: str) -> PoolPlan:
    nodes = tuple(g // per_node for g in gids)
    strategy = "STRICT_PACK" if len(set(nodes)) <= 1 else "PACK"
    return PoolPlan(name, len(gids), strategy, gids, nodes, engines, origin)


def ranges(gids) -> str:
    """``0-3, 8-11``: GPU ids as ranges."""
    out, run = [], []
    for g in sorted(gids):
        if run and g == run[-1] + 1:
            run.append(g)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [g]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


__all__ = ["assign_placement", "place", "carve", "base_models", "ranges"]
