"""``schedule auto``: search placement x layouts x staleness x sync protocol, explain the choice.

The search space, for a flow on ``cluster(nodes = N, gpus_per_node = G)``:

* **placement**: every engine colocated on all GPUs (time-sharing), or disaggregated:
  a ``gen`` pool for the rollout engines and a ``train`` pool for every train engine
  (the reference and critic stay with the trainer), split at whole nodes on several
  nodes, or at any GPU count inside one node (at most 15 splits, evenly spaced);
* **layouts**: every rollout and train engine whose record says ``searched`` and that runs
  on the cluster's platform (rollout: ``vllm``, ``sglang``; train: ``torch``, ``fsdp``,
  ``megatron``) and that runs the model (its architecture, E607) and, for a rollout engine,
  the flow's sampling options (E438), with dp filling its pool and, along the axes the engine has, tp and pp
  powers of two (tp within a node; an engine with model-parallel axes is tried with some
  model parallelism: pure data parallelism is what the simpler engines do); every train
  engine uses the trainer's layout;
* **staleness** 1 .. the bound ``staleness <= N`` (1 without one; lower when ``resync ...
  every K`` already makes rollouts older);
* **protocol**: colocated engines sync in place; disaggregated ones by the route's own
  protocol (NCCL, gloo on CPU) or any protocol whose record says ``searched`` (delta,
  checkpoint), unless the schedule names one.

Every combination is checked by the same library functions the passes use
(:mod:`flowrl.compiler.schedule`: placement, layouts against the model, the platform and
memory, the memory phases of shared GPUs, staleness, protocol), and a rejected one is
counted under its first failing reason (train layout, then rollout layout, then the
engines' memory together, then staleness and protocol). The layouts of each role are
ranked by their own op times and the best two of distinct times kept (the step time
separates by role; layouts of equal times are represented by the simplest), each surviving combination gets
an analytic step time (the modulo-schedule bounds: busiest pool, and weight cycle /
staleness), and the best few distinct placements are simulated
(``flowrl.cost.sim``, the same estimate ``flowrl plan`` shows). The winner has the most
simulated samples per second; ties go to lower staleness, then simpler layouts (the
route's own protocol, then the engines in :func:`~flowrl.catalog.engines.searched_engines`
order, then less model parallelism).

The chosen schedule then goes through the passes like a written one, and
``flowrl plan --explain`` prints the :class:`~flowrl.plan.SearchReport`: the winner, the
runners-up, the rejections by reason, and what became of every engine of the catalogue for
each role (chosen, feasible but slower, refused with its first reason, not searched, not on
the platform).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from flowrl.catalog.engines import ENGINES, EngineSpec, searched_engines
from flowrl.catalog.models import default_context
from flowrl.catalog.ops import OpKind
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.compiler.sched import (LayoutSpec, PlaceSpec, PoolSpec, ResyncSpec, SchedState, ScheduleSpec,
                                   engine_label, model_of, role_of)
from flowrl.compiler.schedule.estimate import build_sim, estimate
from flowrl.compiler.schedule.layouts import (architecture_problems, layout_engine, lora_engine_problem,
                                              sampling_problems)
from flowrl.compiler.schedule.memory import pool_memory, pool_problems, with_memory
from flowrl.compiler.schedule.placement import base_models, place
from flowrl.compiler.schedule.staleness import pipeline_plan, staleness_problems
from flowrl.compiler.schedule.sync import protocol_problems, route_of, sync_plan
from flowrl.compiler.workload import seq_len, workload
from flowrl.cost.profiles import Profile
from flowrl.cost.sim import PhaseKind
from flowrl.diagnostics import Diagnostic, FlowError
from flowrl.ir.graph import FlowGraph
from flowrl.plan import Candidate, EngineVerdict, SearchReport

MAX_SPLITS = 15
KEEP_LAYOUTS = 2
"""Layouts kept per role and placement after ranking them by their own op times."""
SIMULATE = 4
"""Candidates simulated (the best analytic ones, at most one per placement and staleness)."""
SEARCH_SIM_STEPS = 5
MODEL_PARALLEL = ("tp", "pp")
"""Axes enumerated as powers of two (dp fills the pool; cp is not searched)."""
TIE = 0.01
"""Simulated throughputs within 1% count as a tie (broken by staleness, then simplicity)."""
REASONS = {
    "E424": "the layout does not use its pool exactly", "E425": "tp does not divide the attention heads",
    "E426": "tp does not divide the KV heads", "E427": "pp does not divide the layers",
    "E428": "an engine does not fit in GPU memory", "E429": "a tensor-parallel group spans nodes",
    "E430": "the KV cache holds less than one sequence", "E431": "partial-rollout recycling needs staleness >= 2",
    "E432": "`inplace` needs colocated engines", "E433": "`ipc` needs both engines on one node",
    "E434": "`overlap` needs separate GPUs", "E435": "a disk protocol across nodes needs a shared `dir`",
    "E438": "a sampling option the rollout engine refuses",
    "E607": "an engine does not run the model's architecture",
    "E439": "engines sharing GPUs do not fit together", "E440": "an engine does not run on the platform",
    "E441": "a layout exceeds the platform's limits",
    "E443": "a protocol does not run on the platform",
    "E445": "a protocol's transport is missing on the platform",
    "E613": "the engine cannot train or serve the model's LoRA adapters",
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
    train_engines: list = field(default_factory=list)
    """Train engines searched (their records say ``searched``, they run on the platform), simplest first."""
    rollout_engines: list = field(default_factory=list)
    protocols: list = field(default_factory=list)
    """Protocols tried besides the route's own ("" first), simplest first."""
    best_s: dict = field(default_factory=dict)
    """``(role, engine)`` -> the least seconds per step of the role's ops over its feasible layouts."""
    refused: dict = field(default_factory=dict)
    """``(role, engine)`` -> the first problem of its first layout that did not fit."""
    data: dict = field(default_factory=dict)
    """Generate op id -> what its datasets say of its work (:attr:`~flowrl.compiler.sched.SchedState.data`)."""


@dataclass
class _Choice:
    placement: tuple  # ("colocated", 0) | ("disaggregated", gen GPUs)
    train: tuple  # (kind, tp, pp)
    rollout: tuple  # (kind, tp)
    staleness: int
    protocol: str  # "" = the one the route implies
    analytic: float = 0.0


def search_schedule(graph: FlowGraph, spec: ScheduleSpec, facts: dict, hw: Profile, needed: tuple, ctx,
                    data: dict | None = None):
    """The best schedule for ``graph`` under ``spec``'s cluster and limits, and the search report;
    ``data``: the workload measured from the datasets (:func:`~flowrl.compiler.data_workload.measured_workload`)."""
    t0 = time.perf_counter()
    opts = dict(ctx.options.get("auto", {})) if ctx is not None else {}
    every = max((r.every for r in spec.resyncs.values()), default=1)
    limit = spec.staleness_limit or 1
    runs = [e for e in searched_engines("train") + searched_engines("rollout") if e.support(hw.platform).ok]
    prob = _Problem(graph, spec, facts, hw, needed, workload(graph),
                    {n.model for n in graph.nodes() if n.kind == OpKind.UPDATE and n.model}, base_models(graph),
                    limit, every, opts,
                    train_engines=[e for e in runs if e.serves == "train"],
                    rollout_engines=[e for e in runs if e.serves == "rollout"],
                    protocols=[""] + [p.name for p in PROTOCOLS.values() if p.searched and p.support(hw.platform).ok],
                    data=dict(data or {}))
    s_max = limit - every + 1
    if s_max < 1:
        r = next(r for r in spec.resyncs.values() if r.every == every)
        raise FlowError([Diagnostic(
            "E437", f"`every {every}` pushes weights every {every} steps, so rollouts are up to {every - 1} "
                    f"version(s) stale before any pipelining, over the limit `staleness <= {limit}`", r.span,
            f"raise the limit to `staleness <= {every}`, or resync more often")], ctx.sources if ctx else None)
    stal = tuple(s for s in opts.get("staleness", _spread(range(1, s_max + 1), MAX_SPLITS))
                 if 1 <= s <= s_max) or (1,)
    found = _enumerate(prob, stal, opts)
    if not found.pool:
        raise FlowError([_nothing_fits(prob, found.considered, found.counts, found.examples)],
                        ctx.sources if ctx else None)
    results = _rank(prob, _pick(found.pool, int(opts.get("simulate", SIMULATE))), opts)
    cands = [_candidate(prob, i + 1, c, st, est, results[0][2]) for i, (c, st, est) in enumerate(results)]
    report = SearchReport(considered=found.considered, feasible=found.feasible, simulated=len(results),
                          seconds=round(time.perf_counter() - t0, 4), staleness_limit=limit, winner=cands[0],
                          runners_up=tuple(cands[1:]),
                          rejected=dict(sorted(found.counts.items(), key=lambda kv: -kv[1])), examples=found.examples,
                          engines=_verdicts(prob, results[0][0]))
    return _spec(prob, *_spec_args(results[0][0])), report


@dataclass
class _Found:
    pool: list
    """Feasible candidates that survived layout pruning, with analytic step times."""
    considered: int = 0
    feasible: int = 0
    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Layout:
    """One engine layout of a role, its ops' seconds per step, and the engine plans it gives."""

    kind: str
    tp: int
    pp: int
    seconds: float = 0.0
    plans: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> tuple:
        return (self.kind, self.tp, self.pp)


def _enumerate(prob: _Problem, stal: tuple, opts: dict) -> _Found:
    """Every placement x layout x staleness x protocol: count, reject with reasons, keep the best layouts."""
    out = _Found([])
    cache: dict = {}
    for placement in _placements(prob, opts):
        pools, engines, problems = place(_spec(prob, placement, _none(prob, "train"), _none(prob, "rollout"), 1, ""),
                                         prob.needed, prob.bases)
        if problems:
            continue
        trains, t_rej = _layouts(prob, "train", placement, pools, engines)
        rolls, r_rej = _layouts(prob, "rollout", placement, pools, engines)
        sps = [(s, p) for s in stal for p in _protocols(prob, placement)]
        # a role the flow does not have counts as one (empty) choice
        if not _train_keys(prob):
            trains = [_none(prob, "train")]
        if not _rollout_keys(prob):
            rolls = [_none(prob, "rollout")]
        t_ok, r_ok = len(trains), len(rolls)
        out.considered += (t_ok + len(t_rej)) * (r_ok + len(r_rej)) * len(sps)
        # first failing reason: train layout, then rollout layout, then memory together, then staleness/protocol
        for d in t_rej:
            _count(out.counts, out.examples, d, (r_ok + len(r_rej)) * len(sps))
        for d in r_rej:
            _count(out.counts, out.examples, d, t_ok * len(sps))
        pairs = []
        for tl in trains:
            for rl in rolls:
                d = _memory_problem(prob, pools, {**engines, **tl.plans, **rl.plans})
                if d is not None:
                    _count(out.counts, out.examples, d, len(sps))
                else:
                    pairs.append((tl, rl))
        if not pairs:
            continue
        kept_t = _distinct([tl for tl in trains if any(tl is a for a, _ in pairs)])
        kept_r = _distinct([rl for rl in rolls if any(rl is b for _, b in pairs)])
        for s, proto in sps:
            d = _sp_problem(prob, placement, pools, engines, s, proto)
            if d is not None:
                _count(out.counts, out.examples, d, len(pairs))
                continue
            out.feasible += len(pairs)
            for tl, rl in pairs:
                if any(tl is k for k in kept_t) and any(rl is k for k in kept_r):
                    ch = _Choice(placement, tl.key, rl.key, s, proto)
                    ch.analytic = _analytic(prob, ch, tl.seconds, rl.seconds, cache)
                    out.pool.append(ch)
    return out


def _distinct(ranked: list[_Layout], k: int = KEEP_LAYOUTS) -> list[_Layout]:
    """The first ``k`` layouts of distinct op times: of layouts that take the same time, the
    first (the simplest: they are ranked by time, then simplicity) stands for them all."""
    out: list[_Layout] = []
    for lay in ranked:
        if len(out) == k:
            break
        if all(round(lay.seconds, 9) != round(o.seconds, 9) for o in out):
            out.append(lay)
    return out


def _memory_problem(prob: _Problem, pools, engines: dict) -> Diagnostic | None:
    """E439 for the first pool whose engines do not fit together in some phase."""
    for pool in pools:
        m = pool_memory(pool, engines, prob.hw)
        if m is not None:
            d = pool_problems(m, engines, prob.hw, prob.spec.span)
            if d:
                return d[0]
    return None


def _rank(prob: _Problem, picked: list[_Choice], opts: dict) -> list[tuple]:
    """Simulate the picked candidates; best first (ties within :data:`TIE` go to the less stale, simpler one)."""
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
        ks = _spread(range(1, nodes), MAX_SPLITS)
        sizes = [k * g for k in ks]
    else:
        sizes = _spread(range(1, n), MAX_SPLITS)
    return out + [("disaggregated", s) for s in sizes]


def _spread(values, k: int) -> list[int]:
    """At most ``k`` of ``values`` (a sequence: a ``range`` is never listed), evenly spread, ends included."""
    if len(values) <= k:
        return list(values)
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
    return max(Counter(pool.nodes).values(), default=1)  # one pass: a pool may hold 10^5 GPUs


def _none(prob: _Problem, role: str) -> tuple:
    """The layout key standing for a role the flow does not have (or before layouts are chosen)."""
    engines = prob.train_engines if role == "train" else prob.rollout_engines
    return _Layout(engines[0].name if engines else "", 1, 1)


def _model_parallel(spec: EngineSpec, pool, others: list[EngineSpec]) -> list[tuple[int, int]]:
    """``(tp, pp)`` sizes tried for an engine on a pool: powers of two along the axes it has (tp
    within a node); an engine with model-parallel axes skips ``(1, 1)`` when a simpler engine of
    its role (one without them) covers pure data parallelism."""
    tps = _pow2(min(_per_node(pool), 8)) if "tp" in spec.axes else [1]
    pps = _pow2(16) if "pp" in spec.axes else [1]
    mp = any(a in spec.axes for a in MODEL_PARALLEL)
    covered = mp and any(not any(a in o.axes for a in MODEL_PARALLEL) for o in others)
    return [(tp, pp) for tp in tps for pp in pps if pool.gpus % (tp * pp) == 0 and not (covered and (tp, pp) == (1, 1))]


def _layout_options(spec: EngineSpec, tp: int, pp: int, prob: _Problem | None = None, key: str = "") -> dict:
    """A candidate layout's options: its axes, and for a rollout engine whose record has a context
    option (``max_model_len``), a context long enough for the flow's prompts and ``max_tokens``
    when the engine's default (:func:`~flowrl.catalog.models.default_context`) is shorter."""
    out = {a: v for a, v in (("tp", tp), ("pp", pp)) if a in spec.axes}
    facts = prob.facts.get(model_of(key)) if prob is not None and key else None
    if spec.context_option and facts is not None:
        need = seq_len(facts, prob.work.max_tokens.get(model_of(key)) or 0)
        if need > default_context(facts.max_len):
            out[spec.context_option] = min(need, facts.max_len)
    return out


def _layouts(prob: _Problem, role: str, placement, pools, engines) -> tuple[list[_Layout], list[Diagnostic]]:
    """Feasible layouts of a role's engines on their pool, ranked by their ops' seconds (then
    simplicity), and the rejections."""
    keys = _train_keys(prob) if role == "train" else _rollout_keys(prob)
    if not keys:
        return [], []
    searched = prob.train_engines if role == "train" else prob.rollout_engines
    pool = _pool_for(prob, placement, role, pools)
    ok, rejected = [], []
    for spec in searched:
        for tp, pp in _model_parallel(spec, pool, searched):
            problem, plans = None, {}
            for key in keys:
                lspec = LayoutSpec(spec.name, _layout_options(spec, tp, pp, prob, key), prob.spec.span)
                facts = prob.facts.get(model_of(key))
                plan, probs = layout_engine(key, engines[key], lspec, facts, prob.hw, pool, prob.work,
                                            role == "train" and model_of(key) in prob.trained, prob.spec.span)
                # the engine must also run the model and the flow's sampling options (the passes
                # after the search refuse them: E607, E438)
                probs = probs or architecture_problems(key, plan, facts, prob.spec.span)
                lora = prob.work.lora.get(model_of(key))
                why = lora_engine_problem(model_of(key), role, plan, lora[0], facts) if lora and not probs else None
                if why is not None:  # a LoRA model: only engines that train / serve adapters
                    probs = [Diagnostic("E613", why[0], prob.spec.span, why[1])]
                if probs:
                    problem = probs[0]
                    break
                plans[key] = plan
            if problem is None and role == "rollout":
                problem = next(iter(sampling_problems(prob.graph, plans)), None)
            if problem is not None:
                rejected.append(problem)
                prob.refused.setdefault((role, spec.name), problem)
                continue
            lay = _Layout(spec.name, tp, pp)
            other = _none(prob, "rollout" if role == "train" else "train")
            train, roll = (lay, other) if role == "train" else (other, lay)
            seconds = _role_seconds(prob, placement, train.key, roll.key, role)
            prob.best_s[(role, spec.name)] = min(seconds, prob.best_s.get((role, spec.name), seconds))
            ok.append(_Layout(spec.name, tp, pp, seconds, plans))
    order = {e.name: i for i, e in enumerate(searched)}
    ok.sort(key=lambda t: (round(t.seconds, 9), order[t.kind], t.tp * t.pp))
    return ok, rejected


def _protocols(prob: _Problem, placement) -> list[str]:
    if prob.spec.resyncs:
        return [""]  # the schedule names them
    if placement[0] == "colocated" or not any(n.kind == OpKind.RESYNC for n in prob.graph.nodes()):
        return [""]
    return list(prob.protocols)


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
        if not written and not proto:
            continue  # the route's own protocol always fits
        protocol = written.protocol if written else proto
        opts = dict(written.options) if written else {}
        probs = protocol_problems(protocol, opts, route_of(train, roll, per_node), train, roll,
                                  prob.spec.cluster, n.model, written.span if written else prob.spec.span, prob.hw)
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
    """Simpler first: the route's own protocol, plain engines (:func:`searched_engines` order),
    less model parallelism."""
    engines = [e.name for e in searched_engines("train") + searched_engines("rollout")]
    protocols = [""] + [p.name for p in PROTOCOLS.values() if p.searched]
    return (protocols.index(c.protocol), engines.index(c.train[0]) if c.train[0] in engines else -1,
            c.train[1] * c.train[2], engines.index(c.rollout[0]) if c.rollout[0] in engines else -1,
            c.rollout[1] * c.rollout[2])


# ---- candidate schedules ----------------------------------------------------------------------------------


def _spec_args(c: _Choice) -> tuple:
    return (c.placement, c.train, c.rollout, c.staleness, c.protocol)


def _spec(prob: _Problem, placement, train, rollout, s: int, proto: str) -> ScheduleSpec:
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
    layouts = {}
    for k in prob.needed:
        kind, tp, pp = _key(train if role_of(k) == "train" else rollout)
        if kind:
            layouts[k] = LayoutSpec(kind, _layout_options(ENGINES[kind], tp, pp, prob, k), span)
    resyncs = dict(spec.resyncs)
    if proto:
        for n in prob.graph.nodes():
            if n.kind == OpKind.RESYNC and n.model not in resyncs:
                resyncs[n.model] = ResyncSpec(proto, {}, 1, span, chosen=f"chosen by auto: {_why_protocol(proto)}")
    return replace(spec, pools=pools, placement=place_, layouts=layouts, staleness=s, resyncs=resyncs,
                   staleness_span=spec.staleness_span or span)


def _key(layout) -> tuple:
    return layout.key if isinstance(layout, _Layout) else tuple(layout)


def _why_protocol(proto: str) -> str:
    return PROTOCOLS[proto].doc


def _state(prob: _Problem, c: _Choice) -> SchedState:
    """The SchedState the passes would build for candidate ``c``."""
    spec = _spec(prob, *_spec_args(c))
    pools, engines, _ = place(spec, prob.needed, prob.bases)
    by_name = {p.name: p for p in pools}
    for k in prob.needed:
        e, _probs = layout_engine(k, engines[k], spec.layouts.get(k), prob.facts.get(model_of(k)), prob.hw,
                                  by_name[engines[k].pool], prob.work, model_of(k) in prob.trained, spec.span)
        engines[k] = e
    engines, memory = with_memory(engines, pools, prob.hw)
    st = SchedState(spec, prob.facts, prob.hw, prob.needed, pools, engines, memory=memory, staleness=c.staleness,
                    pipeline=pipeline_plan(spec, c.staleness, prob.work.gens),
                    lengths=dict(prob.options.get("lengths", {})), data=prob.data)
    resyncs = {}
    for n in prob.graph.nodes():
        if n.kind == OpKind.RESYNC:
            resyncs[n.id] = sync_plan(n.id, n.model, "", st, str(n.span), prob.work.lora.get(n.model))[0]
    return replace(st, resyncs=resyncs)


def _role_seconds(prob: _Problem, placement, train: tuple, rollout: tuple, role: str) -> float:
    """Seconds per step of the ops on ``role``'s engines under this layout (for ranking layouts)."""
    st = _state(prob, _Choice(placement, train, rollout, 1, ""))
    _spec_, costs, _l, _d = build_sim(prob.graph, st, prob.work)
    return sum(sec for _pid, _k, where, sec, _t in costs if where.endswith("." + role))


def _analytic(prob: _Problem, c: _Choice, train_s: float, gen_s: float, cache: dict) -> float:
    """A lower-bound style step time, as the runtime pipelines a step (:func:`flowrl.cost.sim.simulate`):
    engines that take turns on GPUs add up; otherwise generation overlaps training up to the
    staleness, and every push waits for the queued generation (so each step pays a resync on
    the generation side as well as on the training side)."""
    key = (c.placement, c.train, c.rollout, c.protocol)
    if key not in cache:
        st = _state(prob, replace(c, staleness=1))
        spec, costs, _l, _d = build_sim(prob.graph, st, prob.work)
        resync = sum(sec for _p, kind, _w, sec, _t in costs if kind == OpKind.RESYNC)
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
        if p.kind != PhaseKind.GENERATE:
            continue
        g = p.gen
        per_rep = math.ceil(g.samples / max(g.replicas, 1))
        it = g.iter_s + g.seq_s * g.concurrency
        work = per_rep * (g.lengths.mean() * it + g.prompt_tokens * g.prefill_s)
        out = max(out, work / max(g.concurrency, 1) + per_rep * spec.over_provision * g.request_s)
    return out


# ---- the report --------------------------------------------------------------------------------------------


def _verdicts(prob: _Problem, winner: _Choice) -> tuple[EngineVerdict, ...]:
    """Every catalogue engine serving a role the flow has: chosen, feasible, refused (the first
    reason), not searched, or not on the platform; the winner's engine first in each role."""
    out = []
    for role, keys, chosen in (("rollout", _rollout_keys(prob), winner.rollout[0]),
                               ("train", _train_keys(prob), winner.train[0])):
        if not keys:
            continue
        for name in sorted((n for n, e in ENGINES.items() if e.serves == role), key=lambda n: n != chosen):
            spec, key = ENGINES[name], (role, name)
            if not spec.support(prob.hw.platform).ok:
                out.append(EngineVerdict(role, name, "not on platform", spec.support(prob.hw.platform).why))
            elif not spec.searched:
                out.append(EngineVerdict(role, name, "not searched", "its catalogue record says `searched = False`"))
            elif name == chosen:
                out.append(EngineVerdict(role, name, "chosen", "in the fastest schedule", prob.best_s.get(key, 0.0)))
            elif key in prob.best_s:
                out.append(EngineVerdict(role, name, "feasible", _slower(prob, role, name, chosen), prob.best_s[key]))
            elif key in prob.refused:
                d = prob.refused[key]
                out.append(EngineVerdict(role, name, "refused", f"{d.code}: {d.message}"))
            else:
                out.append(EngineVerdict(role, name, "refused", "no placement left it a pool"))
    return tuple(out)


def _slower(prob: _Problem, role: str, name: str, chosen: str) -> str:
    mine, theirs = prob.best_s[(role, name)], prob.best_s.get((role, chosen), 0.0)
    if theirs and mine > theirs * (1 + TIE):
        return f"its {role} ops take {mine / theirs:.2f}x the chosen `{chosen}`'s"
    if theirs and mine < theirs * (1 - TIE):
        return f"its {role} ops are faster than the chosen `{chosen}`'s, but the schedules it fits are slower"
    return f"within {TIE:.0%} of the chosen `{chosen}`'s time; ties go to the simpler engine"


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
    """The layout as a schedule writes it, with its options (``vllm(tp = 1, dp = 8, max_model_len = 4608)``)."""
    opts = "".join(f", {k} = {v!r}" if isinstance(v, str) else f", {k} = {v}" for k, v in sorted(e.options.items()))
    return engine_label(e).replace("=", " = ")[:-1] + opts + ")"


def _nothing_fits(prob: _Problem, considered: int, counts: dict, examples: dict) -> Diagnostic:
    c = prob.spec.cluster
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:2]
    hint = "; ".join(f"{n} rejected because {examples[k]}" for k, n in top) or "the flow has nothing to place"
    return Diagnostic("E436", f"no schedule of flow `{prob.graph.name}` fits cluster(nodes = {c['nodes']}, "
                              f"gpus_per_node = {c['gpus_per_node']}, gpu = \"{c['gpu']}\"): all {considered} "
                              f"candidates were rejected", prob.spec.span,
                      f"{hint}; add GPUs or nodes, or a larger GPU kind")


__all__ = ["search_schedule", "summary", "schedule_text", "async_modes", "REASONS"]
