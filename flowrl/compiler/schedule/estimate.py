"""The cost model and the simulator run over a placed, laid-out schedule: a CostPlan.

The step's ops become a :class:`~flowrl.cost.sim.SimSpec` (each op on the lane of GPUs its
engine occupies; colocated engines share one lane on GPUs, each engine has its own lane on
the ``cpu`` platform) with per-op costs from :mod:`flowrl.cost.model`, and the
discrete-event simulator runs it for a few steps with long-tailed response lengths (seed
0, so the estimate is deterministic).

* ops of a ``repeat`` loop are unrolled, one copy per turn;
* engines that take turns on GPUs pay for the swap each step (the engines whose plan says
  they release memory move it to the host and back over PCIe);
* log-prob passes the update makes redundant (``graph.elided``) cost nothing;
* a model whose shape is unknown is estimated as a tiny model (the plan says so).

:func:`estimate` is what the ``estimate_cost`` pass and ``schedule auto``'s candidates both run.

>>> from flowrl.catalog.ops import OpKind
>>> _where_of(OpKind.SCORE, None)
'reward'
"""

from __future__ import annotations

import math
from dataclasses import replace

from flowrl.catalog.engines import ENGINES
from flowrl.catalog.models import ModelFacts, tiny_facts
from flowrl.catalog.ops import OPS, PRODUCER_KINDS, RESOURCE_KINDS, OpKind
from flowrl.compiler.sched import SchedState, model_of
from flowrl.compiler.schedule.layouts import micro_batch
from flowrl.compiler.workload import LENGTH_MEDIAN_FRACTION, Workload, int_option, lengths, prompt_tokens
from flowrl.cost import model as cm
from flowrl.cost.sim import GenPhase, LengthDist, Phase, PhaseKind, SimSpec, simulate
from flowrl.ir.graph import Const, EdgeKind, FlowGraph, Node, Ref
from flowrl.plan import CostPlan, EnginePlan, OpCost

SIM_STEPS = 6
MAX_UNROLL = 16
"""Turns of a ``repeat`` loop unrolled in the simulation (longer loops are cut here)."""
DRIVER_S = 1e-3
"""A driver-side op's fixed cost (sampling prompts, advantage math setup)."""


def estimate(graph: FlowGraph, st: SchedState, work: Workload, steps: int = SIM_STEPS, seed: int = 0) -> CostPlan:
    """Simulate the plan ``st`` of ``graph`` and summarise it as a CostPlan."""
    spec, costs, lane_pools, dists = build_sim(graph, st, work)
    if not spec.phases:
        return CostPlan(profile=_profile_label(st), step_s=0.0, samples_per_s=0.0, tokens_per_s=0.0, bubble=0.0)
    res = simulate(spec, steps=steps, seed=seed)
    ops = tuple(OpCost(oid, kind, where, round(res.by_phase.get(oid, secs), 6), toks)
                for oid, kind, where, secs, toks in costs)
    util = {}
    used = {p.lane for p in spec.phases}
    for lane, frac in res.utilization.items():
        if spec.lanes.get(lane) and lane in used:
            util[lane_pools.get(lane, lane)] = round(frac, 4)
    notes = list(st.notes)
    unknown = sorted(m for m, f in st.facts.items() if f is None and any(k.startswith(m + ".") for k in st.engines))
    if unknown:
        notes.append(f"shape of {', '.join(unknown)} unknown: times are estimated as for a tiny model")
    if st.staleness > 1 and hw_shares_gpus(st) and _all_colocated(st):
        notes.append(f"staleness {st.staleness} with colocated engines: they take turns on the same GPUs, "
                     "so generation cannot overlap training")
    notes += [f"`{g.op}` is expected to run {g.draws:.3g} times a step (an op after it draws again until it keeps "
              f"enough groups: dynamic sampling), so {g.generated} completions are generated for {g.samples} trained"
              for g in work.gens if g.draws > 1]
    assumptions = {"prompt_tokens": {g.op: prompt_len(st, g.op, g.model) for g in work.gens},
                   "prompt_source": {g.op: st.data[g.op].prompt_source if g.op in st.data
                                     else "assumed: a quarter of the model's context" for g in work.gens},
                   "response_lengths": {op: d.to_dict() for op, d in dists.items()},
                   "response_source": {op: response_source(st, op) for op in dists},
                   "steps_simulated": res.steps, "warmup_steps": res.warmup, "seed": seed}
    return CostPlan(
        profile=_profile_label(st), step_s=round(res.step_s, 6), samples_per_s=round(res.samples_per_s, 4),
        tokens_per_s=round(res.tokens_per_s, 3), bubble=round(res.bubble, 4),
        breakdown={k: round(v, 6) for k, v in sorted(res.breakdown.items())}, utilization=util,
        memory=pool_memory(st), ops=ops, assumptions=assumptions, bounds=_bounds(spec, res, st),
        notes=tuple(notes))


def _profile_label(st: SchedState) -> str:
    return f"{st.hw.name}: {st.hw.source}"


def hw_shares_gpus(st: SchedState) -> bool:
    """Colocated engines take turns on a GPU; on logical GPUs of a CPU machine they run side by side."""
    return st.hw.kind == "gpu"


def _all_colocated(st: SchedState) -> bool:
    return all(not e.gpus or set(e.gpus) & set(o.gpus) for e in st.engines.values() for o in st.engines.values())


# ---- the simulator's input ------------------------------------------------------------------------------


def lanes_of(st: SchedState) -> dict[str, str]:
    """Engine key -> lane: engines whose GPUs overlap share a lane (they time-share)."""
    keys = list(st.engines)
    parent = {k: k for k in keys}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    first_on: dict[int, str] = {}  # GPU -> the first engine seen on it (engines without GPUs share -1)
    for k in keys:
        for g in st.engines[k].gpus or (-1,):
            if g in first_on:
                parent[find(k)] = find(first_on[g])
            else:
                first_on[g] = k
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(find(k), []).append(k)
    pool_order = {q.name: i for i, q in enumerate(st.pools)}
    lane = {}
    for members in groups.values():
        pools = sorted({st.engines[m].pool for m in members}, key=lambda p: pool_order.get(p, 0))
        name = "+".join(pools)
        for m in members:
            lane[m] = name
    return lane


def engine_lanes(st: SchedState) -> dict[str, str]:
    """Engine key -> lane on ``cpu`` profiles: every engine process has a lane of its own.

    Logical GPUs on a CPU machine do not time-share: each engine process runs on its share
    of the cores (``flowrl.runtime.workers``), so colocated engines compute side by side.
    An engine alone on its pool's GPUs keeps the pool's lane name."""
    shared = lanes_of(st)
    count: dict[str, int] = {}
    for lane in shared.values():
        count[lane] = count.get(lane, 0) + 1
    return {k: (lane if count[lane] == 1 else f"{lane}:{k}") for k, lane in shared.items()}


def producer_ops(graph: FlowGraph, order: list[Node]) -> set[str]:
    """Ops of the producer stage, by the runtime's rule (:func:`flowrl.runtime.pipeline.split_stages`):
    sampling, generation and scoring that read only other producer ops (and resources)."""
    out: set[str] = set()
    for n in order:
        if n.kind in PRODUCER_KINDS and all(u in out or graph.node(u).kind in RESOURCE_KINDS
                                            for u, e in graph.in_edges(n.id) if e.distance == 0):
            out.add(n.id)
    return out


def build_sim(graph: FlowGraph, st: SchedState, work: Workload):
    """``(SimSpec, [(op id, kind, where, seconds, tokens)], lane -> pool label, generate id -> LengthDist)``."""
    hw = st.hw
    lane_of = lanes_of(st) if hw_shares_gpus(st) else engine_lanes(st)
    lane_gpus: dict[str, set] = {}
    for key, lane in lane_of.items():
        lane_gpus.setdefault(lane, set()).update(st.engines[key].gpus)
    lanes = {lane: len(g) for lane, g in lane_gpus.items()}
    lanes.update({"driver": 0, "reward": 0, "env": 0})  # work on the driver's CPUs does not serialise
    elided = graph.elided  # lowering drops these passes: they cost nothing
    order = [n for n in graph.topo_order() if n.kind not in RESOURCE_KINDS and n.id not in elided]
    gen_of = _generate_ancestors(graph, order)
    tokens_est = _expected_tokens(st, work)
    phases: list[Phase] = []
    costs: list = []
    dists = {}
    turns_of = {rid: _turns(r) for rid, r in graph.regions.items()}
    unrolled = _unroll(graph, order, turns_of)
    producers = producer_ops(graph, order)
    gen_by_model: dict[str, list[str]] = {}  # model -> its generate ops (the readers a resync gates)
    for n in graph.nodes():
        if n.kind == OpKind.GENERATE and n.model:
            gen_by_model.setdefault(n.model, []).append(n.id)
    for n, t, deps in unrolled:
        pid = n.id if t is None else f"{n.id}@{t}"
        ph, cost = _phase(graph, st, work, n, pid, deps, lane_of, gen_of, tokens_est, dists, gen_by_model)
        if ph is None:
            continue
        stage = "producer" if n.id in producers else "consumer"
        phases.append(replace(ph, stage=stage))
        costs.append(cost)
        if n.kind == OpKind.GENERATE:
            sw = _switch(st, n, pid, lane_of)
            if sw is not None:
                phases.append(replace(sw, stage=stage))
    valid = {p.id for p in phases}
    phases = [replace(p, deps=tuple(d for d in p.deps if d in valid)) for p in phases]
    spec = SimSpec(tuple(phases), lanes, staleness=st.staleness,
                   over_provision=st.pipeline.over_provision if st.pipeline else 1.0,
                   recycle=st.pipeline.recycle if st.pipeline else False)
    pools_label = {lane: lane for lane in lanes}
    return spec, costs, pools_label, dists


def _turns(region) -> int:
    c = region.count
    v = getattr(c, "value", 1)
    return max(1, min(int(v) if isinstance(v, int) else 1, MAX_UNROLL))


def _unroll(graph: FlowGraph, order: list[Node], turns_of: dict) -> list[tuple[Node, int | None, tuple[str, ...]]]:
    """Ops with their phase dependencies; ops of a ``repeat`` loop once per turn, turn t + 1 after turn t."""
    ids = {n.id for n in order}
    by_region: dict[str, list[Node]] = {}
    for n in order:
        if n.region:
            by_region.setdefault(n.region, []).append(n)
    last_turn = {rid: turns_of.get(rid, 1) - 1 for rid in by_region}
    out, emitted = [], set()
    deps_of = {n.id: n for n in order}

    def phase_id(nid: str) -> str:
        node = deps_of.get(nid)
        if node is not None and node.region in by_region:
            return f"{nid}@{last_turn[node.region]}"
        return nid

    for n in order:
        if n.region in by_region:
            if n.region in emitted:
                continue
            emitted.add(n.region)
            members = by_region[n.region]
            for t in range(last_turn[n.region] + 1):
                for i, m in enumerate(members):
                    deps = []
                    for u in _preds(graph, m):
                        if u not in ids:
                            continue
                        deps.append(f"{u}@{t}" if deps_of[u].region == n.region else phase_id(u))
                    if i == 0 and t > 0:
                        deps.append(f"{members[-1].id}@{t - 1}")
                    out.append((m, t, tuple(deps)))
            continue
        out.append((n, None, tuple(phase_id(u) for u in _preds(graph, n) if u in ids)))
    return out


def _preds(graph: FlowGraph, n: Node) -> list[str]:
    """Producers of ``n`` within the step (every distance-0 edge)."""
    return sorted({u for u, e in graph.in_edges(n.id) if e.distance == 0})


def _generate_ancestors(graph: FlowGraph, order: list[Node]) -> dict[str, str]:
    """Op id -> the generate op whose completions it processes (nearest upstream generate)."""
    out: dict[str, str] = {}
    for n in order:
        if n.kind == OpKind.GENERATE:
            out[n.id] = n.id
            continue
        for u, e in graph.in_edges(n.id):
            if e.kind == EdgeKind.DATA and e.distance == 0 and u in out:
                out[n.id] = out[u]
                break
    return out


def prompt_len(st: SchedState, op: str, model: str | None) -> float:
    """Mean prompt tokens of generate ``op``: measured from its datasets (``st.data``), else assumed."""
    found = st.data.get(op)
    return found.prompt_tokens if found is not None else prompt_tokens(st.facts.get(model) if model else None)


def response_lengths(st: SchedState, op: str, max_tokens: int) -> LengthDist:
    """The response lengths of generate ``op``: the assumed long tail (``st.lengths`` overrides it),
    with the mean of its datasets' reference completions where they name one and nothing overrides it."""
    dist = lengths(max_tokens, **st.lengths)
    found = st.data.get(op)
    if st.lengths or found is None or found.response_tokens is None:
        return dist
    return dist.with_mean(found.response_tokens)


def response_source(st: SchedState, op: str) -> str:
    """Where :func:`response_lengths` took its mean from, as the plan prints it."""
    found = st.data.get(op)
    if st.lengths:
        return "as the compile options say"
    if found is None or found.response_tokens is None:
        return f"assumed: a median of max_tokens x {LENGTH_MEDIAN_FRACTION:g}"
    return found.response_source


def _facts(st: SchedState, model: str | None) -> ModelFacts:
    f = st.facts.get(model) if model else None
    return f if f is not None else tiny_facts({})


def _expected_tokens(st: SchedState, work: Workload) -> dict[str, float]:
    """Generate op id -> expected trained tokens per step (prompt + mean response, per sample)."""
    out = {}
    for g in work.gens:
        d = response_lengths(st, g.op, g.max_tokens)
        out[g.op] = g.samples * (prompt_len(st, g.op, g.model) + d.mean())
    return out


def _where(n: Node) -> str:
    return _where_of(n.kind, n.model)


def _where_of(kind: OpKind, model: str | None) -> str:
    """The engine an op runs on (``policy.rollout``, ``policy.train``), or ``reward``/``env``/``driver``."""
    if kind == OpKind.GENERATE:
        return f"{model}.rollout"
    if kind in (OpKind.LOGPROBS, OpKind.VALUES, OpKind.UPDATE, OpKind.RESYNC) and model:
        return f"{model}.train"
    return {OpKind.SCORE: "reward", OpKind.ENV_STEP: "env"}.get(kind, "driver")


def _phase(graph: FlowGraph, st: SchedState, work: Workload, n: Node, pid: str, deps: tuple, lane_of: dict,
           gen_of: dict, tokens_est: dict, dists: dict, gen_by_model: dict):
    hw = st.hw
    where = _where(n)
    rows = work.samples.get(n.id, 0)
    src_gen = gen_of.get(n.id, "")
    if n.kind == OpKind.GENERATE:
        e: EnginePlan = st.engines[where]
        g = next((x for x in work.gens if x.op == n.id), None)
        if g is None:
            return None, None
        f = _facts(st, n.model)
        dist = response_lengths(st, n.id, g.max_tokens)
        dists[n.id] = dist
        ptoks = max(int(round(prompt_len(st, n.id, n.model))), 1)  # as the simulator counts them
        seq = ptoks + g.max_tokens
        f_over = st.pipeline.over_provision if st.pipeline else 1.0
        issued = math.ceil(g.generated * f_over)  # every expected draw (dynamic sampling) is generated
        per_rep, conc = _slots(e, hw, issued, seq)
        context = ptoks + dist.mean() / 2
        fixed, per_seq = cm.decode_iter_parts(f, hw, tp=e.tp, batch=conc, context=context)
        prefill = 2 * f.params / (e.tp * hw.tflops * 1e12 * hw.mfu_forward)
        gp = GenPhase(replicas=max(e.dp, 1), gpus_per_replica=e.tp * e.pp, concurrency=conc, iter_s=fixed,
                      prefill_s=prefill, samples=g.generated, prompt_tokens=ptoks, lengths=dist,
                      trained=g.samples if g.draws > 1 else 0,
                      overhead_s=hw.op_overhead_s, seq_s=per_seq, request_s=hw.request_overhead_s)
        # without simulating: the longest response, or the waves of the slots, whichever is longer
        busy = max(dist.quantile(1 - 1 / (per_rep + 1)), per_rep * dist.mean() / conc)
        est = (busy * (fixed + per_seq * min(conc, per_rep * dist.mean() / busy))
               + prefill * ptoks * -(-per_rep // conc) + hw.request_overhead_s * per_rep)
        return (Phase(pid, PhaseKind.GENERATE, lane_of[where], deps, gen=gp, label=OpKind.GENERATE.value),
                (pid, n.kind.value, where, est, int(tokens_est.get(n.id, 0))))
    if n.kind in (OpKind.LOGPROBS, OpKind.VALUES, OpKind.UPDATE):
        e = st.engines[where]
        f = _facts(st, n.model)
        toks = tokens_est.get(src_gen, rows * 64.0)
        mb = micro_batch(ENGINES[e.kind], e.options, work.micro_batch.get(n.model, 8))
        n_micro = max(1, rows // max(e.dp * mb, 1))
        if n.kind == OpKind.UPDATE:
            fixed = cm.train_s(f, hw, kind=e.kind, tp=e.tp, pp=e.pp, dp=e.dp, cp=e.cp, tokens=0,
                               epochs=work.epochs.get(n.model, 1), n_micro=n_micro,
                               dp_inter_node=_spans_nodes(e, st))
            full = cm.train_s(f, hw, kind=e.kind, tp=e.tp, pp=e.pp, dp=e.dp, cp=e.cp, tokens=toks,
                              epochs=work.epochs.get(n.model, 1), n_micro=n_micro,
                              dp_inter_node=_spans_nodes(e, st))
        else:
            fixed = hw.op_overhead_s
            full = cm.forward_s(f, hw, world=e.world_size, tokens=toks, pp=e.pp, n_micro=n_micro)
        per_tok = (full - fixed) / toks if toks else 0.0
        return (Phase(pid, PhaseKind.WORK, lane_of[where], deps, seconds=fixed, per_token_s=per_tok,
                      tokens_from=_gen_pid(graph, src_gen, pid), label=n.kind.value),
                (pid, n.kind.value, where, full, int(toks)))
    if n.kind == OpKind.RESYNC:
        plan = st.resyncs.get(n.id)
        secs = plan.seconds if plan is not None else 0.0
        pack = secs if plan is None or not plan.overlap else min(secs, _pack_s(plan, st))
        gate_ids = tuple(g2 for g in gen_by_model.get(n.model, ()) for g2 in _pids_of(graph, g))
        return (Phase(pid, PhaseKind.RESYNC, lane_of[where], deps, seconds=secs, block_s=pack, gates=gate_ids,
                      label=OpKind.RESYNC.value, every=plan.every if plan is not None else 1),
                (pid, n.kind.value, where, secs, 0))
    if n.kind == OpKind.SCORE:
        return _score_phase(graph, st, n, pid, deps, rows, src_gen, tokens_est.get(src_gen, rows * 64.0), lane_of)
    if n.kind == OpKind.ENV_STEP:
        env = n.args[0].target if n.args and isinstance(n.args[0], Ref) else None
        sizing = st.envs.get(env)
        secs = cm.ENV_S_PER_CALL * rows / (sizing.workers if sizing is not None else 1) + hw.op_overhead_s
        return (Phase(pid, PhaseKind.WORK, "env", deps, seconds=secs, label="env"), (pid, n.kind.value, where, secs, 0))
    secs = DRIVER_S + cm.DRIVER_S_PER_SAMPLE * rows
    return (Phase(pid, PhaseKind.WORK, "driver", deps, seconds=secs, label="driver"),
            (pid, n.kind.value, where, secs, 0))


def _gen_pid(graph: FlowGraph, src_gen: str, pid: str) -> str:
    if not src_gen:
        return ""
    region = graph.node(src_gen).region
    if region is None:
        return src_gen
    turn = pid.split("@")[1] if "@" in pid else None
    if turn is not None:
        return f"{src_gen}@{turn}"
    last = max(_turns(graph.regions[region]) - 1, 0) if region in graph.regions else 0
    return f"{src_gen}@{last}"


def _pids_of(graph: FlowGraph, nid: str) -> list[str]:
    region = graph.node(nid).region
    if region is None or region not in graph.regions:
        return [nid]
    return [f"{nid}@{t}" for t in range(_turns(graph.regions[region]))]


def _pack_s(plan, st: SchedState) -> float:
    """Seconds the trainer is busy packing buckets when sending overlaps generation (one HBM pass)."""
    return plan.total_bytes / (st.hw.hbm_gbs * cm.GB * st.hw.bw_eff) + plan.buckets * st.hw.latency_s


def _spans_nodes(e: EnginePlan, st: SchedState) -> bool:
    per = int(st.spec.cluster["gpus_per_node"])
    return len({g // per for g in e.gpus}) > 1


def _score_phase(graph: FlowGraph, st: SchedState, n: Node, pid: str, deps: tuple, rows: int, src_gen: str,
                 toks: float, lane_of: dict):
    """A score op: its rewards' CPU work and the driver's call on the ``reward`` lane; where a model's
    engine serves a reward (a reward model, a judge), on that engine's lane, with its pass over the
    scored rows (``toks`` tokens: prompts and responses) and the dispatch to it."""
    hw, found = st.hw, st.data.get(src_gen)
    per_sample, workers, served = _reward_cost(graph, n, found is not None and found.integer_answers)
    engines = [(k, r) for k, r in served if k in st.engines]
    fixed = cm.reward_s(per_sample, rows, workers) + cm.score_call_s(rows, hw.op_overhead_s * len(engines))
    if not engines:
        return (Phase(pid, PhaseKind.WORK, "reward", deps, seconds=fixed, label="reward"),
                (pid, n.kind.value, "reward", fixed, 0))
    per_tok = 0.0
    for key, r in engines:  # by the engine role its record serves it on
        more_fixed, more_per_tok = SERVED_PASS[OPS[r.op].serves_engine](
            _facts(st, model_of(key)), st.engines[key], hw, r, rows, toks)
        fixed, per_tok = fixed + more_fixed, per_tok + more_per_tok
    where = engines[0][0]
    return (Phase(pid, PhaseKind.WORK, lane_of[where], deps, seconds=fixed, per_token_s=per_tok,
                  tokens_from=_gen_pid(graph, src_gen, pid), label="reward"),
            (pid, n.kind.value, where, fixed + per_tok * toks, int(toks)))


Served = tuple[tuple[str, Node], ...]
"""The engines serving a reward: ``(engine key, reward node)`` of each reward model or judge in it."""


def _reward_cost(graph: FlowGraph, n: Node, integer_answers: bool = False) -> tuple[float, int, Served]:
    """(CPU seconds per scored sample, worker processes, the engines serving it) of the reward function a
    score op reads; ``integer_answers``: every reference answer of the rows scored is an integer
    (verifiers' fast paths)."""
    for u, e in graph.in_edges(n.id):
        if e.kind == EdgeKind.RESOURCE and graph.node(u).kind == OpKind.REWARD_FN:
            return _reward_fn_cost(graph, graph.node(u), integer_answers)
    return 0.0, 2, ()


def _reward_fn_cost(graph: FlowGraph, r: Node, integer_answers: bool) -> tuple[float, int, Served]:
    """A reward's (CPU seconds per sample, workers, serving engines); a combined one (``weighted_sum``)
    pays for each of its rewards in turn, at the fewest workers among them; a built-in verifier costs
    what its record (:data:`~flowrl.catalog.ops.VERIFIER_COSTS`) says; a reward model or a judge runs on
    its model's engine (the record's ``serves_model`` and ``serves_engine``), costed there."""
    spec = OPS.get(r.op)
    if spec is not None and spec.rest is not None:
        parts = [_reward_fn_cost(graph, graph.node(u), integer_answers) for u, e in graph.in_edges(r.id)
                 if e.kind == EdgeKind.RESOURCE and graph.node(u).kind == OpKind.REWARD_FN]
        return (sum(s for s, _, _ in parts), min((w for _, w, _ in parts), default=2),
                tuple(x for _, _, served in parts for x in served))
    model = r.args[0].target if r.args and isinstance(r.args[0], Ref) else None
    served = ((f"{model}.{spec.serves_engine}", r),) if spec is not None and spec.serves_model and model else ()
    w = getattr(r.attr("workers"), "value", 2)
    workers = w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else 2
    name = r.args[0].value if r.args and isinstance(r.args[0], Const) else None
    if spec is not None and spec.costs_by_name and name in spec.costs_by_name:
        cost = spec.costs_by_name[name]
        fast = cost.integer_seconds_per_item if integer_answers else None
        return (fast if fast is not None else cost.seconds_per_item), workers, served
    return (spec.seconds_per_item if spec is not None else 0.0), workers, served


def _forward_pass(f: ModelFacts, e: EnginePlan, hw, r: Node, rows: int, toks: float) -> tuple[float, float]:
    """A reward model on its train engine: one forward of every scored row, (fixed s, s per token)."""
    return 0.0, cm.forward_s(f, hw, world=e.world_size, tokens=1) - hw.op_overhead_s


def _judge_pass(f: ModelFacts, e: EnginePlan, hw, r: Node, rows: int, toks: float) -> tuple[float, float]:
    """A judge on its rollout engine: it prefills every row, then decodes its ``max_tokens`` for each
    (its replicas sharing the rows, in waves of its concurrency), plus its cost per request."""
    max_tokens = int_option(r, "max_tokens", 1)
    per_rep, conc = _slots(e, hw, rows, int(toks / max(rows, 1)) + max_tokens)
    waves = -(-per_rep // conc)
    step = cm.decode_iter_s(f, hw, tp=e.tp, batch=conc, context=toks / max(rows, 1) + max_tokens / 2)
    decode = waves * max_tokens * step + hw.request_overhead_s * per_rep
    return decode, cm.prefill_s(f, hw, tp=e.tp, tokens=1) / max(e.dp, 1)


def _slots(e: EnginePlan, hw, requests: int, seq: int) -> tuple[int, int]:
    """``(requests per replica, sequences a replica decodes at once)`` for ``requests`` on rollout engine
    ``e``: its replicas share them, and a replica runs as many as its KV-cache memory holds at ``seq``
    tokens each (the profile's ``max_num_seqs`` where the plan knows no memory), at most its share."""
    per_rep = -(-requests // max(e.dp, 1))
    conc = cm.concurrency(e.memory, seq, hw) if e.memory is not None else hw.max_num_seqs
    return per_rep, max(1, min(conc, per_rep))


SERVED_PASS = {"train": _forward_pass, "rollout": _judge_pass}
"""A served reward's pass over the scored rows, by the engine role its record serves it on
(``OpSpec.serves_engine``): ``(fixed seconds, seconds per token)``."""


def _switch(st: SchedState, n: Node, pid: str, lane_of: dict) -> Phase | None:
    """After a generation, engines that take turns on its GPUs swap: the rollout engine sleeps
    (its weights to host memory and back) and the offloaded train engines reload (weights,
    gradients and optimizer states back, and out again before the next generation) -- exactly
    the engines whose plan says they release memory (:mod:`flowrl.compiler.schedule.memory`)."""
    key = f"{n.model}.rollout"
    lane = lane_of[key]
    moved = [k for k, l in lane_of.items() if l == lane and st.engines[k].releases]
    if not moved:
        return None
    gb = 0.0
    for k in moved:
        m = st.engines[k].memory
        if m is None:
            continue
        gb += 2 * m.weights_gb if st.engines[k].releases == "sleep" else 2 * (m.weights_gb + m.grads_gb + m.optimizer_gb)
    if gb <= 0:
        return None
    return Phase(f"{pid}.switch", PhaseKind.WORK, lane, (pid,), seconds=cm.offload_s(gb, st.hw), label="sleep/wake")


def pool_memory(st: SchedState) -> dict:
    """Pool -> peak GB per GPU over the phases the runtime runs (:attr:`SchedState.memory`), its
    capacity and its engines."""
    return {m.pool: {"peak_gb": m.peak_gb, "capacity_gb": m.capacity_gb, "engines": ", ".join(m.engines)}
            for m in st.memory}


def _bounds(spec: SimSpec, res, st: SchedState) -> dict:
    """The modulo-schedule lower bounds: busiest lane (resource) and weight cycle / staleness (recurrence)."""
    busy: dict[str, float] = {}
    for p in spec.phases:
        busy[p.lane] = busy.get(p.lane, 0.0) + res.by_phase.get(p.id, 0.0) * (1 if p.kind != PhaseKind.RESYNC else
                                                                                  (p.block_s / p.seconds if p.seconds else 0))
    gpu_lanes = {l: b for l, b in busy.items() if spec.lanes.get(l)}
    resource = max(gpu_lanes.values(), default=0.0)
    cycle = _cycle_latency(spec, res)
    return {"resource_s": round(resource, 6), "recurrence_s": round(cycle / max(st.staleness, 1), 6),
            "cycle_s": round(cycle, 6)}


def _cycle_latency(spec: SimSpec, res) -> float:
    """Longest path (average phase times) from a generate through to the resync that feeds it."""
    longest: dict[str, float] = {}
    start = {p.id for p in spec.phases if p.kind == PhaseKind.GENERATE}
    best = 0.0
    for p in spec.phases:
        base = max((longest[d] for d in p.deps if d in longest), default=None)
        if p.id in start:
            base = max(base or 0.0, 0.0)
        if base is None:
            continue
        longest[p.id] = base + res.by_phase.get(p.id, 0.0)
        if p.kind == PhaseKind.RESYNC:
            best = max(best, longest[p.id])
    return best


__all__ = ["estimate", "build_sim", "lanes_of", "engine_lanes", "producer_ops", "pool_memory", "SIM_STEPS"]
