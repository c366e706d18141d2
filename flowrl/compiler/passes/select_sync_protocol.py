"""Choose how each resync moves weights, plan its buckets and its resharding.

Requires: resolve_staleness (engines placed and laid out).

Guarantees: ``graph.sched.resyncs`` has one :class:`~flowrl.plan.ResyncPlan` per
``resync`` node: the protocol (as written, else chosen from the placement), why, the
route the bytes take (``local``: the rollout engine sits on the trainer's GPUs;
``intra-node``; ``inter-node``), the transport, whether sending overlaps generation,
the bucket plan (bytes of one copy, buckets, the largest tensor), an estimated time,
and the resharding plan from the train layout to the rollout layout.

Chosen protocols: colocated engines -> ``inplace``; disaggregated -> ``nccl`` on GPUs
(``gloo`` on a CPU cluster), overlapped with the next generation.

Checked (the schedule's ``resync`` line):

* ``inplace`` needs the rollout engine on the trainer's GPUs (E432);
* ``ipc`` (CUDA IPC handles) needs both engines on the same node(s) (E433);
* ``overlap = true`` sends while the rollout engine generates, which needs separate
  GPUs: colocated engines take turns (E434);
* ``checkpoint`` across nodes needs a shared ``dir`` (E435).

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... reward v = verifier("exact")
... flow f(d: dataset) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r)
...   update(m, r, group_advantage(v(r), group = 2), lp)
... }''', "doc.flow", until="select_sync_protocol", allow_missing=True)
>>> r = g.sched.resyncs["resync.m"]
>>> (r.protocol, r.route, r.buckets)
('inplace', 'local', 1)
"""

from __future__ import annotations

import math
from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.catalog.models import ModelFacts
from flowrl.compiler.passes.assign_placement import ranges
from flowrl.plan import EnginePlan, ResyncPlan
from flowrl.compiler.reshard import reshard_plan
from flowrl.compiler.sched import ResyncSpec, SchedState
from flowrl.cost.model import gather_s, transfer_s
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Collector, Diagnostic, Span
from flowrl.ir.graph import EdgeKind, FlowGraph
from flowrl.catalog.ops import OpKind
from flowrl.catalog.protocols import PROTOCOLS

CHECKPOINT_SHARD_BYTES = 5 * 10**9
"""``checkpoint`` writes safetensors files of at most this size (the transformers default)."""
TRANSPORT = {
    "inplace": {"gpu": "cuda", "cpu": "ray"}, "ipc": {"gpu": "cuda-ipc", "cpu": "shm"},
    "nccl": {"gpu": "nccl", "cpu": "gloo"}, "gloo": {"gpu": "gloo", "cpu": "gloo"},
    "broadcast": {"gpu": "nccl", "cpu": "gloo"}, "checkpoint": {"gpu": "disk", "cpu": "disk"},
    "delta": {"gpu": "nccl", "cpu": "gloo"},
}
"""protocol -> device kind -> what moves the bytes (NCCL needs GPUs: on CPU it is gloo)."""
STREAMING = {"nccl", "gloo", "broadcast", "delta"}
"""Protocols with an ``overlap`` of packing/sending with generation."""


def select_sync_protocol(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    errors = Collector(ctx.sources)
    plans = {}
    for n in graph.nodes():
        if n.kind != OpKind.RESYNC:
            continue
        after = next((u for u, e in graph.in_edges(n.id) if e.kind == EdgeKind.WEIGHTS), "")
        plan, problems = sync_plan(n.id, n.model, after, st, str(n.span))
        errors.items.extend(problems)
        plans[n.id] = plan
    errors.raise_if_any()
    return replace(graph, sched=replace(st, resyncs=plans))


def route_of(train: EnginePlan, rollout: EnginePlan, per_node: int) -> str:
    """How far weights travel: ``local`` (same GPUs), ``intra-node`` or ``inter-node``."""
    if set(rollout.gpus) <= set(train.gpus):
        return "local"
    if {g // per_node for g in rollout.gpus} <= {g // per_node for g in train.gpus}:
        return "intra-node"
    return "inter-node"


def choose_protocol(route: str, hw: Profile) -> tuple[str, str]:
    """The protocol the compiler picks for a route, and why."""
    if route == "local":
        return "inplace", "the rollout engine shares the trainer's GPUs: weights are loaded in place"
    link = "NVLink" if route == "intra-node" else "InfiniBand"
    if hw.kind == "cpu":
        return "gloo", f"disaggregated engines ({route}): packed bucket broadcast over gloo (CPU cluster)"
    return "nccl", f"disaggregated engines ({route}): packed NCCL bucket broadcast over {link}"


def sync_plan(rid: str, model: str, after: str, st: SchedState, origin: str) -> tuple[ResyncPlan, list[Diagnostic]]:
    """The ResyncPlan of resync node ``rid`` of ``model``, and what is wrong with the written protocol."""
    spec = st.spec
    per_node = int(spec.cluster["gpus_per_node"])
    train, rollout = st.engines[f"{model}.train"], st.engines[f"{model}.rollout"]
    route = route_of(train, rollout, per_node)
    written: ResyncSpec | None = spec.resyncs.get(model)
    if written is not None:
        protocol, reason, opts, every, span = written.protocol, written.chosen or "as written", \
            dict(written.options), written.every, written.span
    else:
        protocol, reason = choose_protocol(route, st.hw)
        opts, every, span = {}, 1, spec.span
    problems = protocol_problems(protocol, opts, route, train, rollout, spec.cluster, model, span)
    defaults = PROTOCOLS[protocol].options
    bucket = int(opts.pop("bucket", defaults["bucket"].default if "bucket" in defaults else 0))
    overlap = bool(opts.pop("overlap", route != "local")) if protocol in STREAMING else False
    transport = TRANSPORT[protocol][st.hw.kind]
    if written is not None and transport != protocol and protocol in ("nccl",):
        reason = f"as written; NCCL needs GPUs, so on this {st.hw.name} cluster it runs over gloo"
    facts: ModelFacts | None = st.facts.get(model)
    total = largest = 0
    largest_name = ""
    seconds = 0.0
    reshard = None
    if facts is not None:
        total = facts.params * st.hw.weight_bytes
        largest_name, shape = max(facts.tensors(), key=lambda t: math.prod(t[1]))
        largest = math.prod(shape) * st.hw.weight_bytes
        if rollout.kind and train.kind:
            reshard = reshard_plan(facts, train.kind, train.tp, train.pp, rollout.kind, rollout.tp)
    unit = CHECKPOINT_SHARD_BYTES if protocol == "checkpoint" else bucket
    buckets = max(1, math.ceil(total / unit)) if unit else 1
    if facts is not None:
        shards = train.tp * train.pp if train.kind == "megatron" else 1
        seconds = gather_s(facts, st.hw, shards=shards) + \
            transfer_s(total, st.hw, protocol=protocol, route=route, buckets=buckets)
    plan = ResyncPlan(rid, model, after, protocol, bucket, every, origin, options=opts, reason=reason, route=route,
                      transport=transport, overlap=overlap, total_bytes=int(total), buckets=buckets,
                      largest_tensor=largest_name, largest_bytes=int(largest), seconds=round(seconds, 6),
                      reshard=reshard)
    return plan, problems


def protocol_problems(protocol: str, opts: dict, route: str, train: EnginePlan, rollout: EnginePlan,
                      cluster: dict, model: str, span: Span) -> list[Diagnostic]:
    """What makes ``protocol`` impossible for this placement (see the module docstring)."""
    where = f"`{model}.rollout` is on pool `{rollout.pool}` (GPUs {ranges(rollout.gpus)}) and `{model}.train` " \
            f"on pool `{train.pool}` (GPUs {ranges(train.gpus)})"
    if protocol == "inplace" and route != "local":
        return [Diagnostic("E432", f"`inplace` resync of `{model}` needs its rollout engine on the trainer's GPUs, "
                                   f"but {where}", span,
                           "use `nccl` (or `broadcast`) between separate pools, or colocate the engines")]
    if protocol == "ipc" and route == "inter-node":
        return [Diagnostic("E433", f"`ipc` resync of `{model}` shares memory handles within a node, but {where}, "
                                   f"on different nodes", span,
                           "use `nccl` across nodes, or put both pools on the same node(s)")]
    if opts.get("overlap") is True and route == "local":
        return [Diagnostic("E434", f"`overlap = true` sends `{model}`'s weights while its rollout engine generates, "
                                   f"which needs separate GPUs, but `{model}.train` and `{model}.rollout` share "
                                   f"GPUs {ranges(set(train.gpus) & set(rollout.gpus))} and take turns", span,
                           "remove `overlap = true`, or place the engines on separate pools")]
    if protocol == "checkpoint" and not opts.get("dir") and len({g // int(cluster["gpus_per_node"]) for g in
                                                                 train.gpus + rollout.gpus}) > 1:
        nodes = len({g // int(cluster["gpus_per_node"]) for g in train.gpus + rollout.gpus})
        return [Diagnostic("E435", f"`checkpoint` resync of `{model}` crosses {nodes} nodes, so it needs a directory "
                                   f"every node sees, but `dir` is empty", span,
                           'give a shared directory: `checkpoint(dir = "/shared/ckpt")`')]
    return []


__all__ = ["select_sync_protocol", "sync_plan", "route_of", "choose_protocol", "protocol_problems", "TRANSPORT"]
