"""Refuse what does not run on the schedule's platform: ops, resources, losses and statements the catalogue marks so.

Requires: check_schedule (the cluster's ``gpu`` names a known hardware profile).

Guarantees: every op and resource of the flow, every ``update``'s loss, every schedule
statement and every ``repeat`` loop runs on the cluster's platform (its hardware profile's:
``cpu`` for ``gpu = "cpu"``, ``cuda``, ``rocm``), by its record's ``support``
(:class:`~flowrl.catalog.ops.OpSpec`, :class:`~flowrl.catalog.losses.LossSpec`,
:class:`~flowrl.catalog.schedule.StatementSpec`) (E444, where it is written, quoting the
record's ``why``: what stands in the way and what to use instead). Engines and weight-sync
protocols are checked where the schedule chooses them (E440-E443:
:mod:`flowrl.compiler.schedule`), so a flow that ``check`` accepts has a runtime path on its
platform.

Every shipped record runs everywhere today; a loss limited to GPUs (a record made here) is refused on CPU:

>>> from dataclasses import replace
>>> from flowrl.catalog.losses import LOSSES
>>> from flowrl.catalog.spec import RUNS, unsupported
>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> shipped = LOSSES["pg"]
>>> LOSSES["pg"] = replace(shipped, platforms={"cpu": unsupported("an example"), "cuda": RUNS, "rocm": RUNS})
>>> try:
...     compile_text('''
... flow f(m: model, d: dataset, j: reward) {
...   r = generate(m, sample(d), n = 2)  update(m, r, group_advantage(j(r), group = 2), loss = pg()) }
... ''', "doc.flow", until="check_platform")
... except FlowError as e:
...     print(e.diagnostics[0].code)
... finally:
...     LOSSES["pg"] = shipped
E444
"""

from __future__ import annotations

from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OPS, OpKind
from flowrl.catalog.platforms import PLATFORMS
from flowrl.catalog.schedule import STATEMENTS
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import spec_from_ast
from flowrl.cost.profiles import get_profile
from flowrl.diagnostics import Collector, Span
from flowrl.ir.graph import Config, FlowGraph
from flowrl.syntax import ast

STATEMENT_OF = {ast.Pool: "pool", ast.Place: "place", ast.Colocate: "colocate", ast.Staleness: "staleness",
                ast.Resync: "resync"}
"""Schedule statement type -> its record in :data:`~flowrl.catalog.schedule.STATEMENTS` (a call
statement, ``partial_rollout(...)``, by the name it calls; a layout by its engine's record)."""


def check_platform(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    cluster = spec_from_ast(graph).cluster
    gpu = str(cluster["gpu"])
    platform = get_profile(gpu).platform
    errors = Collector(ctx.sources)

    def refuse(what: str, record, span: Span) -> None:
        sup = record.support(platform)
        if sup.ok:
            return
        elsewhere = [p for p in PLATFORMS if record.support(p).ok]
        where = f"on {', '.join(elsewhere)} only" if elsewhere else "on no platform yet"
        errors.error("E444", f"{what} does not run on {platform} (cluster gpu = \"{gpu}\"): "
                             f"`{record.name}` runs {where}", span,
                     sup.why or f"`{record.name}` runs on {', '.join(elsewhere)}")

    for n in graph.nodes():
        spec = OPS.get(n.op)
        if spec is None:
            continue  # a parameter or an unresolved call: nothing runs it
        refuse(f"{'resource' if spec.engine is None else 'op'} `{n.id}` = {spec.name}(...)", spec, n.span)
        loss = n.attr("loss") if n.kind == OpKind.UPDATE else None
        if isinstance(loss, Config) and loss.name in LOSSES:
            refuse(f"loss `{loss.name}(...)` of `{n.id}`", LOSSES[loss.name], loss.span)
    schedule = graph.schedule
    for stmt in getattr(schedule, "body", None) or ():
        name = stmt.call.func if isinstance(stmt, ast.SchedCall) else STATEMENT_OF.get(type(stmt))
        if name in STATEMENTS:
            refuse(f"schedule statement `{name}`", STATEMENTS[name], stmt.span)
    for region in graph.regions.values():
        refuse("a `repeat` loop", STATEMENTS["repeat"], region.span)
    errors.raise_if_any()
    return graph


__all__ = ["check_platform", "STATEMENT_OF"]
