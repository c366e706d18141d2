"""Refuse what does not run on the schedule's platform: ops and resources the catalogue marks so.

Requires: check_schedule (the cluster's ``gpu`` names a known hardware profile).

Guarantees: every op and resource of the flow runs on the cluster's platform (its hardware
profile's: ``cpu`` for ``gpu = "cpu"``, ``cuda``, ``rocm``), by its record's
:meth:`~flowrl.catalog.ops.OpSpec.support` (E444, at the op, quoting the record's ``why``:
what stands in the way and what to use instead). Engines and weight-sync protocols are
checked where the schedule chooses them (E440-E443: :mod:`flowrl.compiler.schedule`), so a
flow that ``check`` accepts has a runtime path on its platform.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... reward j = llm_judge(frozen(m0))
... model m0 = tiny()
... flow f(m: model, d: dataset) {
...   r = generate(m, sample(d), n = 2)  update(m, r, group_advantage(j(r), group = 2), loss = pg()) }
... ''', "doc.flow", until="check_platform")
... except FlowError as e:
...     print(e.diagnostics[0].code)
E444
"""

from __future__ import annotations

from flowrl.catalog.ops import OPS
from flowrl.catalog.platforms import PLATFORMS
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import spec_from_ast
from flowrl.cost.profiles import get_profile
from flowrl.diagnostics import Collector
from flowrl.ir.graph import FlowGraph


def check_platform(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    cluster = spec_from_ast(graph).cluster
    gpu = str(cluster["gpu"])
    platform = get_profile(gpu).platform
    errors = Collector(ctx.sources)
    for n in graph.nodes():
        spec = OPS.get(n.op)
        if spec is None:
            continue  # a parameter or an unresolved call: nothing runs it
        sup = spec.support(platform)
        if sup.ok:
            continue
        elsewhere = [p for p in PLATFORMS if spec.support(p).ok]
        where = f"on {', '.join(elsewhere)} only" if elsewhere else "on no platform yet"
        what = "resource" if spec.engine is None else "op"
        errors.error("E444", f"{what} `{n.id}` = {spec.name}(...) does not run on {platform} (cluster gpu = \"{gpu}\"): "
                             f"`{spec.name}` runs {where}", n.span,
                     sup.why or f"`{spec.name}` runs on {', '.join(elsewhere)}")
    errors.raise_if_any()
    return graph


__all__ = ["check_platform"]
