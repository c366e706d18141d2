"""Pools carved out of the cluster, and engines placed on them.

* Declared pools are disjoint slices of the cluster, carved in declaration order: a pool
  of ``gpus(gpus = N)`` takes N free GPUs on as few nodes as possible; ``nodes = K``
  takes N / K GPUs on each of K nodes. ``all`` is the whole cluster.
* An engine goes where ``place`` / ``colocate`` put it; an unplaced derived model (a frozen
  copy or a critic) follows its base model's trainer; anything else unplaced runs on ``all``.
* Engines whose GPUs overlap are colocated: they time-share the GPUs, each rank asking
  Ray for ``1 / (engines on its GPU)`` of a GPU.

Errors (E422, E423) point at the pool line, with the numbers.

>>> ranges((0, 1, 2, 3, 8, 9))
'0-3, 8-9'
"""

from __future__ import annotations

from flowrl.catalog.engines import default_engine
from flowrl.catalog.ops import OpKind
from flowrl.compiler.sched import ScheduleSpec, model_of, role_of
from flowrl.diagnostics import Diagnostic
from flowrl.ir.graph import FlowGraph, Ref
from flowrl.plan import EnginePlan, PoolPlan


def base_models(graph: FlowGraph) -> dict[str, str]:
    """Derived model id (``frozen(m)``, ``critic(m)``: a model made from another) -> its base model."""
    out = {}
    for n in graph.nodes():
        if n.kind == OpKind.MODEL and n.args and isinstance(n.args[0], Ref) and n.args[0].target in graph \
                and graph.node(n.args[0].target).kind == OpKind.MODEL:
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
    order = {k: i for i, k in enumerate(needed)}
    sharing: dict[str, set[str]] = {}  # pool -> engines on any of its GPUs (pools are few, engines many)
    for pool in set(where.values()):
        sharing[pool] = {k for g in pool_gpus[pool] for k in on_gpu[g]}
    for key, pool in where.items():
        gids = pool_gpus[pool]
        share = max((len(on_gpu[g]) for g in gids), default=1)
        neighbours = sorted(sharing[pool] - {key}, key=order.__getitem__)
        engines[key] = EnginePlan(kind=default_engine(role_of(key)).name, role=role_of(key), pool=pool,
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
    have = ", ".join(f"node {i}: {len(f)}" for i, f in enumerate(free[:8])) + (", ..." if len(free) > 8 else "")
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


__all__ = ["place", "carve", "base_models", "ranges"]
