"""Staleness: the modulo schedule's depth, the versioned buffer, and what staleness asks for.

``staleness s`` relaxes the loop-carried weight edge into ``generate`` to distance s:
generation at step k reads the weights pushed at step k - s, so the runtime keeps s steps
in flight. :func:`pipeline_plan` sizes that schedule; :func:`staleness_problems` is what a
staleness cannot be (partial-rollout recycling needs s >= 2, E431); :func:`off_policy_notes`
advises an importance correction for updates that train stale samples, and
:func:`auto_corrections` gives one to them when ``schedule auto`` chose the staleness.

>>> from flowrl.compiler.sched import ScheduleSpec
>>> p = pipeline_plan(ScheduleSpec({}, None), 2, ())
>>> (p.in_flight, p.max_version_lag)
(2, 1)
"""

from __future__ import annotations

import math

from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import AUTO_TIS_CAP, OpKind
from flowrl.compiler.sched import ScheduleSpec
from flowrl.diagnostics import Diagnostic
from flowrl.ir.graph import Const, FlowGraph, plain
from flowrl.plan import PipelinePlan


def off_policy_notes(graph: FlowGraph, lag: int) -> list[str]:
    """Updates that train samples up to ``lag`` versions old without an importance correction.

    With one optimiser step per batch the PPO ratio is taken against log-probs the trainer
    computes now, so it is 1 and does not see the staleness; truncated importance sampling
    against the rollout engine's own log-probs (``tis``) does (veRL and AReaL use it for async RL).
    """
    if lag < 1:
        return []
    out = []
    for n in graph.nodes():
        if n.kind != OpKind.UPDATE or not n.model:
            continue
        if not _corrected(n):
            out.append(f"`{n.id}` trains samples up to {lag} version(s) behind the weights without an off-policy "
                       f"correction: consider `tis = 2.0` (truncated importance sampling against the rollout's "
                       f"log-probs)")
    return out


def _corrected(update) -> bool:
    """The update corrects for stale samples (``tis`` or ``mis`` set)."""
    return bool(plain(update.attr("tis", 0.0)) or plain(update.attr("mis", 0.0)))


def auto_corrections(graph: FlowGraph, spec: ScheduleSpec, lag: int) -> tuple[FlowGraph, list[str]]:
    """Under ``schedule auto``, give every policy ``update`` that trains stale samples (``lag >= 1``)
    without a correction ``tis = AUTO_TIS_CAP``, and say so; ``update(auto_correct = false)`` opts out.

    The search may pick a staleness > 1 for throughput; the user did not write it, so the
    compiler does not leave its off-policy gap uncorrected behind the user's back.
    """
    if not spec.auto or lag < 1:
        return graph, []
    out, notes = graph, []
    for n in graph.nodes():
        loss = LOSSES.get(getattr(n.attr("loss"), "name", ""))
        if (n.kind != OpKind.UPDATE or loss is None or loss.needs_old != "logprobs" or _corrected(n)
                or not plain(n.attr("auto_correct", True))):
            continue
        if out is graph:
            out = graph.copy()
        out.replace(n.with_attrs(tis=Const(AUTO_TIS_CAP, "float", n.span)))
        notes.append(f"`schedule auto` chose a staleness where `{n.id}` trains samples up to {lag} version(s) behind "
                     f"the weights, so it corrects them: `tis = {AUTO_TIS_CAP}` (truncated importance sampling "
                     f"against the rollout's log-probs); write `auto_correct = false` in the update to train them "
                     f"uncorrected")
    return out, notes


def staleness_problems(spec: ScheduleSpec, s: int) -> list[Diagnostic]:
    """What is wrong with staleness ``s`` under ``spec`` (partial-rollout recycling needs s >= 2)."""
    p = spec.partial
    if p is not None and p.recycle and p.over_provision > 1.0 and s < 2:
        return [Diagnostic(
            "E431", f"partial_rollout(recycle = true) resumes unfinished generations under newer weights, so their "
                    f"samples are up to 1 version stale, but staleness {s} allows none", p.span,
            "write `staleness 2` (one-step-off), or `recycle = false` to drop unfinished generations")]
    return []


def pipeline_plan(spec: ScheduleSpec, s: int, gens) -> PipelinePlan:
    samples = sum(g.samples for g in gens)
    p = spec.partial
    f = p.over_provision if p is not None else 1.0
    every = max((r.every for r in spec.resyncs.values()), default=1)
    requests = math.ceil(samples * f)
    return PipelinePlan(in_flight=s, max_version_lag=s - 1 + every - 1, buffer_samples=requests * s,
                        samples_per_step=samples, requests_per_step=requests, over_provision=f,
                        recycle=bool(p.recycle) if p is not None else False,
                        origin=str(spec.staleness_span or spec.span))


__all__ = ["staleness_problems", "pipeline_plan", "off_policy_notes", "auto_corrections"]
