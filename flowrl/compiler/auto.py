"""``schedule auto``: search placement x layouts x staleness x sync protocol, explain the choice.

The search space, for a flow on ``cluster(nodes = N, gpus_per_node = G)``:

* **placement**: every engine colocated on all GPUs (time-sharing), or disaggregated:
  a ``gen`` pool for the rollout engines and a ``train`` pool for every train engine
  (the reference and critic stay with the trainer), split at whole nodes on several
  nodes, or at any GPU count inside one node (at most 15 splits, evenly spaced);
* **layouts**: rollout ``vllm(tp)`` with dp filling its pool; training ``megatron(tp, pp)``,
  ``fsdp`` and ``torch`` with dp filling its pool (tp, pp powers of two, tp within a node);
  every train engine uses the trainer's layout;
* **staleness** 1 .. the bound ``staleness <= N`` (1 without one; lower when ``resync ...
  every K`` already makes rollouts older);
* **protocol**: colocated engines sync in place; disaggregated ones by NCCL (gloo on CPU),
  delta or checkpoint, unless the schedule names one.

Every combination is checked by the same functions the passes use (placement,
layouts against the model and memory, staleness, protocol), and a rejected one is
counted under its first failing reason (train layout, then rollout layout, then
staleness and protocol). The layouts of each role are ranked by their own op times and
the best two kept (the step time separates by role), each surviving combination gets
an analytic step time (the modulo-schedule bounds: busiest pool, and weight cycle /
staleness), and the best few distinct placements are simulated
(``flowrl.cost.sim``, the same estimate ``flowrl plan`` shows). The winner has the most
simulated samples per second; ties go to lower staleness, then simpler layouts.

The chosen schedule then goes through the passes like a written one, and
``flowrl plan --explain`` prints the :class:`~flowrl.plan.SearchReport`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from flowrl.compiler.passes.assign_placement import base_models, place
from flowrl.compiler.passes.plan_layouts import layout_engine
from flowrl.compiler.passes.resolve_staleness import pipeline_plan, staleness_problems
from flowrl.compiler.passes.select_sync_protocol import protocol_problems, route_of, sync_plan
from flowrl.plan import Candidate, SearchReport
from flowrl.compiler.sched import (LayoutSpec, PlaceSpec, PoolSpec, ResyncSpec, SchedState, ScheduleSpec,
                                   engine_label, model_of, role_of)
from flowrl.compiler.workload import workload
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Diagnostic, FlowError
from flowrl.ir.graph import FlowGraph
from flowrl.catalog.ops import OpKind

MAX_SPLITS = 15
KEEP_LAYOUTS = 2
"""Layouts kept per role and placement after ranking them by their own op times."""
SIMULATE = 4
"""Candidates simulated (the best analytic ones, at most one per placement and staleness)."""
SEARCH_SIM_STEPS = 5
TRAIN_KINDS = ("torch", "fsdp", "megatron")
"""In tie-break order: the simplest engine first."""
PROTOCOL_ORDER = ("", "delta", "checkpoint")
"""Protocols tried for disaggregated engines ("" = the route's own: NCCL, gloo on CPU), simplest first."""
TIE = 0.01
"""Simulated throughputs within 1% count as a tie (broken by staleness, then simplicity)."""
REASONS = {
    "E424": "the layout does not use its pool exactly", "E425": "tp does not divide the attention heads",
    "E426": "tp does not divide the KV heads", "E427": "pp does not divide the layers",
    "E428": "an engine does not fit in GPU memory", "E429": "a tensor-parallel group spans nodes",
    "E430": "the KV cache holds less than one sequence", "E431": "partial-rollout recycling needs staleness >= 2",
    "E432": "`inplace` needs colocated engines", "E433": "`ipc` needs both engines on one node",
    "E434": "`overlap` needs separate GPUs", "E435": "`checkpoint` across nodes needs a shared `dir`",
    "E438": "a sampling option the rollout engine refuses",
}


@dataclass
class _Problem:
    graph: FlowGraph
    spec: ScheduleSpec
    facts: dict
    hw: Profile
    needed: tuple
    work: object
    trained: set
    bases: dict
    limit: int
    every: int
    options: dict


@dataclass
class _Choice:
    placement: tuple  # ("colocated", 0) | ("disaggregated", gen GPUs)
    train: tuple  # (kind, tp, pp)
    rollout: int  # vllm tp
    staleness: int
    protocol: str  # "" = the one the route implies
    analytic: float = 0.0


def search_schedule(graph: FlowGraph, spec: ScheduleSpec, facts: dict, hw: Profile, needed: tuple, ctx):
    """The best schedule for ``graph`` under ``spec``'s cluster and limits, and the search report."""
    t0 = time.perf_counter()
    opts = dict(ctx.options.get("auto", {})) if ctx is not None else {}
    every = max((r.every for r in spec.resyncs.values()), default=1)
    limit = spec.staleness_limit or 1
    prob = _Problem(graph, spec, facts, hw, needed, workload(graph),
                    {n.model for n in graph.nodes() if n.kind == OpKind.UPDATE and n.model}, base_models(graph),
                    limit, every, opts)
    s_max = limit - every + 1
    if s_max < 1:
        r = next(r for r in spec.resyncs.values() if r.every == every)
        raise FlowError([Diagnostic(
            "E437", f"`every {every}` pushes weights every {every} steps, so rollouts are up to {every - 1} "
                    f"version(s) stale before any pipelining, over the limit `staleness <= {limit}`", r.span,
            f"raise the limit to `staleness <= {every}`, or resync more often")], ctx.sources if ctx else None)
    stal = tuple(s for s in opts.get("staleness", range(1, s_max + 1)) if 1 <= s <= s_max) or (1,)
    found = _enumerate(prob, stal, opts)
    if not found.pool:
        raise FlowError([_nothing_fits(prob, found.considered, found.counts, found.examples)],
                        ctx.sources if ctx else None)
    results = _rank(prob, _pick(found.pool, int(opts.get("simulate", SIMULATE))), opts)
    cands = [_candidate(prob, i + 1, c, st, est, results[0][2]) for i, (c, st, est) in enumerate(results)]
    report = SearchReport(considered=found.considered, feasible=found.feasible, simulated=len(results),
                          seconds=round(time.perf_counter() - t0, 4), staleness_limit=limit, winner=cands[0],
                          runners_up=tuple(cands[1:]),
                          rejected=dict(sorted(found.counts.items(), key=lambda kv: -kv[1])), examples=found.examples)
    return _spec(prob, *_spec_args(results[0][0])), report


@dataclass
class _Found:
    pool: list
    """Feasible candidates that survived layout pruning, with analytic step times."""
    considered: int = 0
    feasible: int = 0
    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)


def _enumerate(prob: _Problem, stal: tuple, opts: dict) -> _Found:
    """Every placement x layout x staleness x protocol: count, reject with reasons, keep the best layouts."""
    out = _Found([])
    cache: dict = {}
    for placement in _placements(prob, opts):
        pools, engines, problems = place(_spec(prob, placement, ("torch", 1, 1), 1, 1, ""), prob.needed, prob.bases)
        if problems:
            continue
        trains, t_rej = _train_layouts(prob, placement, pools, engines)
        rolls, r_rej = _rollout_layouts(prob, placement, pools, engines)
        sps = [(s, p) for s in stal for p in _protocols(prob, placement)]
        # a role the flow does not have counts as one (empty) choice
        t_ok = len(trains) if _train_keys(prob) else 1
        r_ok = len(rolls) if _rollout_keys(prob) else 1
        out.considered += (t_ok + len(t_rej)) * (r_ok + len(r_rej)) * len(sps)
        for d in t_rej:  # first failing reason: train layout, then rollout layout, then staleness/protocol
            _count(out.counts, out.examples, d, (r_ok + len(r_rej)) * len(sps))
        for d in r_rej:
            _count(out.counts, out.examples, d, t_ok * len(sps))
        if not (t_ok and r_ok):
            continue
        for s, proto in sps:
            d = _sp_problem(prob, placement, pools, engines, s, proto)
            if d is not None:
                _count(out.counts, out.examples, d, t_ok * r_ok)
                continue
            out.feasible += t_ok * r_ok
            for tl in trains[:KEEP_LAYOUTS] or [("torch", 1, 1, 0.0)]:
                for rl in rolls[:KEEP_LAYOUTS] or [(1, 0.0)]:
                    ch = _Choice(placement, tl[:3], rl[0], s, proto)
                    ch.analytic = _analytic(prob, ch, tl[3], rl[1], cache)
                    out.pool.append(ch)
    return out


def _rank(prob: _Problem, picked: list[_Choice], opts: dict) -> list[tuple]:
    """Simulate the picked candidates; best first (ties within :data:`TIE` go to the less stale, simpler one)."""
    from flowrl.compiler.passes.estimate_cost import estimate

    results = []
    for c in picked:
        st = _state(prob, c)
        results.append((c, st, estimate(prob.graph, st, prob.work, steps=int(opts.get("sim_steps",
                                                                                         SEARCH_SIM_STEPS)))))
    results.sort(key=lambda r: (-r[2].samples_per_s, r[0].staleness, _simplicity(r[0])))
    top = results[0][2].samples_per_s
    ties = [r for r in results if r[2].samples_per_s >= top * (1 - TIE)]
    winner = min(ties, key=lambda r: (r[0].staleness, _simplicity(r[0])))
    results.remove(winner)
    return [winner] + results


def _pick(pool: list[_Choice], k: int) -> list[_Choice]:
    """The ``k`` best placements-and-staleness groups by analytic time; in each, the simplest
    candidate within :data:`TIE` of the group's best."""
    groups: dict[tuple, list[_Choice]] = {}
    for c in pool:
        groups.setdefault((c.placement, c.staleness), []).append(c)
    reps = []
    for members in groups.values():
        best = min(c.analytic for c in members)
        close = [c for c in members if c.analytic <= best * (1 + TIE)]
        reps.append((best, min(close, key=_simplicity)))
    reps.sort(key=lambda r: (r[0], r[1].staleness, _simplicity(r[1])))
    return [c for _b, c in reps[:k]]


# ---- the space ----------------------------------------------------------------------------------------


def _rollout_keys(prob: _Problem) -> list[str]:
    return [k for k in prob.needed if role_of(k) == "rollout"]


def _train_keys(prob: _Problem) -> list[str]:
    return [k for k in prob.needed if role_of(k) == "train"]


def _placements(prob: _Problem, opts: dict) -> list[tuple]:
    allowed = set(opts.get("placements", ("colocated", "disaggregated")))
    out = [("colocated", 0)] if "colocated" in allowed else []
    n, g = prob.spec.gpus, int(prob.spec.cluster["gpus_per_node"])
    nodes = int(prob.spec.cluster["nodes"])
    if "disaggregated" not in allowed or not _rollout_keys(prob) or not _train_keys(prob) or n < 2:
        return out
    if nodes > 1:
        ks = _spread(list(range(1, nodes)), MAX_SPLITS)
        sizes = [k * g for k in ks]
    else:
        sizes = _spread(list(range(1, n)), MAX_SPLITS)
    return out + [("disaggregated", s) for s in sizes]


def _spread(values: list[int], k: int) -> list[int]:
    if len(values) <= k:
        return values
    return sorted({values[round(i * (len(values) - 1) / (k - 1))] for i in range(k)})


def _pow2(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def _pool_for(prob: _Problem, placement: tuple, role: str, pools) -> object:
    name = "all" if placement[0] == "colocated" else ("gen" if role == "rollout" else "train")
    return next(p for p in pools if p.name == name)


def _per_node(pool) -> int:
    return max((pool.nodes.count(n) for n in set(pool.nodes)), default=1)


def _train_layouts(prob: _Problem, placement, pools, engines):
    """Feasible train layouts ranked by their ops' time: [(kind, tp, pp, seconds)], and rejections."""
    keys = _train_keys(prob)
    if not keys:
        return [], []
    pool = _pool_for(prob, placement, "train", pools)
    layouts = []
    for kind in TRAIN_KINDS:
        if kind == "megatron":
            for tp in _pow2(min(_per_node(pool), 8)):
                for pp in _pow2(16):
                    if pool.gpus % (tp * pp) == 0 and (tp, pp) != (1, 1):
                        layouts.append((kind, tp, pp))
        else:
            layouts.append((kind, 1, 1))
    ok, rejected = [], []
    for kind, tp, pp in layouts:
        problem = None
        for key in keys:
            lspec = LayoutSpec(kind, {"tp": tp, "pp": pp} if kind == "megatron" else {}, prob.spec.span)
            _plan, probs = layout_engine(key, engines[key], lspec, prob.facts.get(model_of(key)), prob.hw, pool,
                                         prob.work, model_of(key) in prob.trained, prob.spec.span)
            if probs:
                problem = probs[0]
                break
        if problem is not None:
            rejected.append(problem)
        else:
            ok.append((kind, tp, pp, _role_seconds(prob, placement, (kind, tp, pp), 1, "train")))
    ok.sort(key=lambda t: (round(t[3], 9), TRAIN_KINDS.index(t[0]), t[1] * t[2]))
    return ok, rejected


def _rollout_layouts(prob: _Problem, placement, pools, engines):
    keys = _rollout_keys(prob)
    if not keys:
        return [], []
    pool = _pool_for(prob, placement, "rollout", pools)
    ok, rejected = [], []
    for tp in _pow2(min(_per_node(pool), 8)):
        if pool.gpus % tp:
            continue
        problem = None
        for key in keys:
            _plan, probs = layout_engine(key, engines[key], LayoutSpec("vllm", {"tp": tp}, prob.spec.span),
                                         prob.facts.get(model_of(key)), prob.hw, pool, prob.work, False,
                                         prob.spec.span)
            if probs:
                problem = probs[0]
                break
        if problem is not None:
            rejected.append(problem)
        else:
            ok.append((tp, _role_seconds(prob, placement, ("torch", 1, 1), tp, "rollout")))
    ok.sort(key=lambda t: (round(t[1], 9), t[0]))
    return ok, rejected


def _protocols(prob: _Problem, placement) -> list[str]:
    if prob.spec.resyncs:
        return [""]  # the schedule names them
    if placement[0] == "colocated" or not any(n.kind == OpKind.RESYNC for n in prob.graph.nodes()):
        return [""]
    return list(PROTOCOL_ORDER)


def _sp_problem(prob: _Problem, placement, pools, engines, s: int, proto: str) -> Diagnostic | None:
    spec = replace(prob.spec, staleness=s)
    d = staleness_problems(spec, s)
    if d:
        return d[0]
    per_node = int(prob.spec.cluster["gpus_per_node"])
    for n in prob.graph.nodes():
        if n.kind != OpKind.RESYNC:
            continue
        train, roll = engines[f"{n.model}.train"], engines[f"{n.model}.rollout"]
        tpool = next(p for p in pools if p.name == train.pool)
        rpool = next(p for p in pools if p.name == roll.pool)
        train, roll = replace(train, gpus=tpool.gpu_ids), replace(roll, gpus=rpool.gpu_ids)
        written = prob.spec.resyncs.get(n.model)
        protocol = written.protocol if written else (proto or "inplace")
        if not written and not proto:
            continue  # the route's own protocol always fits
        opts = dict(written.options) if written else {}
        probs = protocol_problems(protocol, opts, route_of(train, roll, per_node), train, roll,
                                  prob.spec.cluster, n.model, written.span if written else prob.spec.span)
        if probs:
            return probs[0]
    return None


def _count(counts: dict, examples: dict, d: Diagnostic, n: int) -> None:
    if n <= 0:
        return
    key = f"{d.code}: {REASONS.get(d.code, d.message)}"
    counts[key] = counts.get(key, 0) + n
    examples.setdefault(key, d.message)


def _simplicity(c: _Choice) -> tuple:
    """Simpler first: the route's own protocol, plain engines, less model parallelism."""
    return (PROTOCOL_ORDER.index(c.protocol), TRAIN_KINDS.index(c.train[0]), c.train[1] * c.train[2], c.rollout)


# ---- candidate schedules ----------------------------------------------------------------------------------


def _spec_args(c: _Choice) -> tuple:
    return (c.placement, c.train, c.rollout, c.staleness, c.protocol)


def _spec(prob: _Problem, placement, train, rollout_tp: int, s: int, proto: str) -> ScheduleSpec:
    """A candidate as a ScheduleSpec (everything points at the auto schedule's header)."""
    spec, span = prob.spec, prob.spec.span
    pools, place_ = (), {}
    if placement[0] == "disaggregated":
        gen = placement[1]
        pools = (PoolSpec("gen", gen, None, span), PoolSpec("train", spec.gpus - gen, None, span))
        for k in prob.needed:
            place_[k] = PlaceSpec("gen" if role_of(k) == "rollout" else "train", span, True)
    else:
        for k in prob.needed:
            place_[k] = PlaceSpec("all", span, True)
    kind, tp, pp = train
    layouts = {}
    for k in prob.needed:
        if role_of(k) == "train":
            layouts[k] = LayoutSpec(kind, {"tp": tp, "pp": pp} if kind == "megatron" else {}, span)
        else:
            layouts[k] = LayoutSpec("vllm", {"tp": rollout_tp}, span)
    resyncs = dict(spec.resyncs)
    if proto:
        for n in prob.graph.nodes():
            if n.kind == OpKind.RESYNC and n.model not in resyncs:
                resyncs[n.model] = ResyncSpec(proto, {}, 1, span, chosen=f"chosen by auto: {_why_protocol(proto)}")
    return replace(spec, pools=pools, placement=place_, layouts=layouts, staleness=s, resyncs=resyncs,
                   staleness_span=spec.staleness_span or span)


def _why_protocol(proto: str) -> str:
    return {"delta": "only changed weights cross the link", "checkpoint": "weights go through the shared disk"}.get(
        proto, proto)


def _state(prob: _Problem, c: _Choice) -> SchedState:
    """The SchedState the passes would build for candidate ``c``."""
    spec = _spec(prob, *_spec_args(c))
    pools, engines, _ = place(spec, prob.needed, prob.bases)
    by_name = {p.name: p for p in pools}
    for k in prob.needed:
        e, _probs = layout_engine(k, engines[k], spec.layouts[k], prob.facts.get(model_of(k)), prob.hw,
                                  by_name[engines[k].pool], prob.work, model_of(k) in prob.trained, spec.span)
        engines[k] = e
    st = SchedState(spec, prob.facts, prob.hw, prob.needed, pools, engines, staleness=c.staleness,
                    pipeline=pipeline_plan(spec, c.staleness, prob.work.gens),
                    lengths=dict(prob.options.get("lengths", {})))
    resyncs = {}
    for n in prob.graph.nodes():
        if n.kind == OpKind.RESYNC:
            resyncs[n.id] = sync_plan(n.id, n.model, "", st, str(n.span))[0]
    return replace(st, resyncs=resyncs)


def _role_seconds(prob: _Problem, placement, train, rollout_tp: int, role: str) -> float:
    """Seconds per step of the ops on ``role``'s engines under this layout (for ranking layouts)."""
    from flowrl.compiler.passes.estimate_cost import build_sim

    st = _state(prob, _Choice(placement, train, rollout_tp, 1, ""))
    _spec_, costs, _l, _d = build_sim(prob.graph, st, prob.work)
    return sum(sec for _pid, _k, where, sec, _t in costs if where.endswith("." + role))


def _analytic(prob: _Problem, c: _Choice, train_s: float, gen_s: float, cache: dict) -> float:
    """A lower-bound style step time, as the runtime pipelines a step (:func:`flowrl.cost.sim.simulate`):
    engines that take turns on GPUs add up; otherwise generation overlaps training up to the
    staleness, and every push waits for the queued generation (so each step pays a resync on
    the generation side as well as on the training side)."""
    from flowrl.compiler.passes.estimate_cost import build_sim

    key = (c.placement, c.train, c.rollout, c.protocol)
    if key not in cache:
        st = _state(prob, replace(c, staleness=1))
        spec, costs, _l, _d = build_sim(prob.graph, st, prob.work)
        resync = sum(sec for _p, kind, _w, sec, _t in costs if kind == "resync")
        other = sum(sec for _p, _k, where, sec, _t in costs if where in ("reward", "driver", "env"))
        switch = sum(p.seconds for p in spec.phases if p.label == "sleep/wake")
        cache[key] = (resync, other, switch, _partial_gen(spec))
    resync, other, switch, partial = cache[key]
    gen = min(partial, gen_s) if partial else gen_s
    if c.placement[0] == "colocated" and prob.hw.kind == "gpu":
        return gen + train_s + resync + other + switch
    cycle = gen + other + train_s + resync
    if c.staleness == 1:
        return cycle
    return max(gen + resync, train_s, cycle / c.staleness)


def _partial_gen(spec) -> float:
    """Generation time per step with partial rollout (over-provisioned requests, recycled): the slots
    stay full and a step ends at its N-th completion, so it is throughput-bound (tokens x iteration
    time at a full batch / slots), not waiting for the longest response; 0 without partial rollout."""
    if spec.over_provision <= 1.0:
        return 0.0
    out = 0.0
    for p in spec.phases:
        if p.kind != "generate":
            continue
        g = p.gen
        per_rep = math.ceil(g.samples / max(g.replicas, 1))
        it = g.iter_s + g.seq_s * g.concurrency
        work = per_rep * (g.lengths.mean() * it + g.prompt_tokens * g.prefill_s)
        out = max(out, work / max(g.concurrency, 1) + per_rep * spec.over_provision * g.request_s)
    return out


# ---- the report --------------------------------------------------------------------------------------------


def _candidate(prob: _Problem, rank: int, c: _Choice, st: SchedState, est, best) -> Candidate:
    return Candidate(rank=rank, summary=summary(st), step_s=est.step_s, samples_per_s=est.samples_per_s,
                     bubble=est.bubble, schedule=schedule_text(prob.graph, st), why=_why(st, est, best, rank))


def summary(st: SchedState) -> str:
    """One line: placement, layouts, staleness, protocols."""
    pools = {p.name: p.gpus for p in st.pools}
    trains = sorted({engine_label(e) for k, e in st.engines.items() if role_of(k) == "train"})
    rolls = sorted({engine_label(e) for k, e in st.engines.items() if role_of(k) == "rollout"})
    if "gen" in pools:
        where = f"disaggregated: gen {pools['gen']} GPUs {', '.join(rolls)} | train {pools['train']} GPUs " \
                f"{', '.join(trains)}"
    else:
        where = f"colocated on {pools.get('all', 0)} GPUs: {', '.join(trains + rolls) or 'no engines'}"
    protos = sorted({r.protocol for r in st.resyncs.values()})
    return f"{where}; staleness {st.staleness}" + (f"; {', '.join(protos)}" if protos else "")


def _why(st: SchedState, est, best, rank: int) -> str:
    b = est.bounds
    if b.get("recurrence_s", 0) > b.get("resource_s", 0) * 1.02:
        bound = f"bound by the weight cycle ({b['cycle_s']:.3g} s / staleness {st.staleness})"
    else:
        busiest = max(est.utilization.items(), key=lambda kv: kv[1], default=("", 0))[0]
        bound = f"bound by pool `{busiest}` ({b.get('resource_s', 0):.3g} s busy per step)"
    top = ", ".join(f"{k} {v:.3g} s" for k, v in sorted(est.breakdown.items(), key=lambda kv: -kv[1])[:2])
    if rank == 1:
        return f"fastest: {bound}; largest phases {top}; bubble {est.bubble:.0%}"
    slower = best.samples_per_s / est.samples_per_s if est.samples_per_s else float("inf")
    if slower <= 1 + TIE:
        return f"ties with the winner (within {TIE:.0%}), which is simpler or less stale: {bound}; " \
               f"largest phases {top}"
    return f"{slower:.2f}x slower: {bound}; largest phases {top}; bubble {est.bubble:.0%}"


def schedule_text(graph: FlowGraph, st: SchedState) -> str:
    """The schedule as a manual ``schedule`` block (to paste into the .flow and edit)."""
    c = st.spec.cluster
    opts = f"nodes = {c['nodes']}, gpus_per_node = {c['gpus_per_node']}" + \
        (f", gpu = \"{c['gpu']}\"" if c["gpu"] != "cpu" else "")
    lines = [f"schedule {graph.name} on cluster({opts}) {{"]
    ids = [n.id for n in graph.nodes() if n.kind == OpKind.MODEL]

    def name(mid: str) -> str:
        short = mid.rsplit(".", 1)[-1]
        return short if sum(1 for i in ids if i == short or i.endswith("." + short)) == 1 else mid

    def target(key: str) -> str:
        m, r = model_of(key), role_of(key)
        return f"{name(m)}.{r}" if r == "rollout" or m in _generated(graph) else name(m)

    for p in st.spec.pools:
        lines.append(f"  pool {p.name} = gpus(gpus = {p.gpus})")
    by_pool: dict[str, list[str]] = {}
    for k, e in st.engines.items():
        by_pool.setdefault(e.pool, []).append(target(k))
    for pool, targets in by_pool.items():
        verb = "colocate" if len(targets) > 1 else "place"
        lines.append(f"  {verb} {', '.join(targets)} on {pool}")
    for k, e in st.engines.items():
        lines.append(f"  {target(k)} = {_layout_text(e)}")
    lines.append(f"  staleness {st.staleness}")
    for r in st.resyncs.values():
        lines.append(f"  resync {name(r.model)} via {r.protocol}() every {r.every}")
    if st.spec.partial is not None:
        p = st.spec.partial
        lines.append(f"  partial_rollout(over_provision = {p.over_provision:g}, recycle = "
                     f"{'true' if p.recycle else 'false'})")
    lines.append("}")
    return "\n".join(lines)


def _generated(graph: FlowGraph) -> set:
    return {n.model for n in graph.nodes() if n.kind == OpKind.GENERATE}


def _layout_text(e) -> str:
    return engine_label(e).replace("=", " = ")


def _nothing_fits(prob: _Problem, considered: int, counts: dict, examples: dict) -> Diagnostic:
    c = prob.spec.cluster
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:2]
    hint = "; ".join(f"{n} rejected because {examples[k]}" for k, n in top) or "the flow has nothing to place"
    return Diagnostic("E436", f"no schedule of flow `{prob.graph.name}` fits cluster(nodes = {c['nodes']}, "
                              f"gpus_per_node = {c['gpus_per_node']}, gpu = \"{c['gpu']}\"): all {considered} "
                              f"candidates were rejected", prob.spec.span,
                      f"{hint}; add GPUs or nodes, or a larger GPU kind")


# ---- the async comparison (flowrl.cost.sim.compare_async) ------------------------------------------------

ASYNC_MODES = (
    ("sync", {"staleness": (1,)}, None),
    ("one-step-off", {"staleness": (2,)}, None),
    ("bounded async (s=4)", {"staleness": (4,)}, None),
    ("partial rollout", {"staleness": (2,)}, "partial"),
)
ANCHOR_OF = {"sync": "", "one-step-off": "NeMo-RL", "bounded async (s=4)": "AReaL", "partial rollout": "APRIL"}


def async_modes(*, model: str, gpus: int, gpu: str, gpus_per_node: int, batch: int, group: int, max_tokens: int,
                median: float | None, sigma: float, over_provision: float, steps: int, seed: int,
                anchors: dict) -> list[dict]:
    """See :func:`flowrl.cost.sim.compare_async`."""
    from flowrl.compiler.lower import lower
    from flowrl.compiler.pipeline import compile_text

    nodes = max(1, gpus // gpus_per_node)
    per = min(gpus, gpus_per_node)
    lengths = {"median": median} if median else {}
    lengths["sigma"] = sigma
    rows = []
    base = None
    for mode, auto_opts, extra in ASYNC_MODES:
        partial = f"\n  partial_rollout(over_provision = {over_provision:g})" if extra else ""
        text = ASYNC_FLOW.format(model=model, batch=batch, group=group, max_tokens=max_tokens, nodes=nodes,
                                 per=per, gpu=gpu, limit=max(auto_opts["staleness"]), partial=partial)
        graph = compile_text(text, "<compare_async>", options={
            "auto": {**auto_opts, "sim_steps": steps}, "sim_steps": steps, "lengths": lengths})
        plan = lower(graph)
        est = plan.estimate
        gen_s = est.breakdown.get("generate", 0.0)
        gen_tps = _rollout_tps(graph)
        row = {"mode": mode, "step_s": est.step_s, "samples_per_s": est.samples_per_s,
               "tokens_per_s": est.tokens_per_s, "generate_s": gen_s, "rollout_tokens_per_s": gen_tps,
               "bubble": est.bubble, "schedule": plan.search.winner.summary if plan.search else "",
               "anchor": anchors.get(ANCHOR_OF[mode], "")}
        if base is None:
            base = row
        row["speedup"] = round(base["step_s"] / row["step_s"], 3) if row["step_s"] else 0.0
        row["rollout_gain"] = round(row["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3) \
            if base["rollout_tokens_per_s"] else 0.0
        rows.append(row)
    return rows


def _rollout_tps(graph: FlowGraph) -> float:
    """Rollout throughput per rollout GPU (APRIL's metric, per GPU so that pools of different sizes
    compare): generated tokens per GPU-second the rollout engine had. A pool of its own has the
    whole wall time; colocated GPUs have only the generate phases."""
    from flowrl.compiler.passes.estimate_cost import build_sim
    from flowrl.cost.sim import simulate

    st = graph.sched
    spec, _c, _l, _d = build_sim(graph, st, workload(graph))
    res = simulate(spec, steps=st.estimate.assumptions.get("steps_simulated", 6), seed=0)
    gen = next((p for p in spec.phases if p.kind == "generate"), None)
    if gen is None or not spec.lanes.get(gen.lane):
        return 0.0
    shared = any(p.lane == gen.lane and p.kind != "generate" for p in spec.phases)
    wall_share = res.breakdown.get("generate", 0.0) / res.step_s if shared and res.step_s else 1.0
    return res.gen_tokens_per_s / max(wall_share, 1e-12) / spec.lanes[gen.lane]


ASYNC_PROGRAM = '''
model policy = hf("{model}")
dataset prompts = jsonl("prompts.jsonl")
reward correct = verifier("math")

flow main() {{
  ref      = frozen(policy)
  b        = sample(prompts, size = {batch})
  rollouts = generate(policy, b, n = {group}, max_tokens = {max_tokens})
  scores   = correct(rollouts)
  old_lp   = logprobs(policy, rollouts)
  ref_lp   = logprobs(ref, rollouts)
  adv      = group_advantage(scores, group = {group})
  update(policy, rollouts, adv, old_lp, ref_lp, kl = 0.001)
}}
'''
"""The GRPO program of the async comparison (format fields: model, batch, group, max_tokens)."""

ASYNC_FLOW = ASYNC_PROGRAM + '''
schedule main auto on cluster(nodes = {nodes}, gpus_per_node = {per}, gpu = "{gpu}") {{
  staleness <= {limit}{partial}
}}
'''

__all__ = ["search_schedule", "summary", "schedule_text", "async_modes", "REASONS"]
