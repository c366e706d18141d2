"""Weight sync: the route weights take, the protocol that moves them, buckets and resharding.

Everything about a protocol is its record's (:class:`~flowrl.catalog.protocols.ProtocolSpec`):
the placements it connects (``routes``), what carries its bytes on each platform
(``transport``), whether it streams while the rollout engine generates (``streaming``),
whether it needs a shared directory across nodes, the platforms it runs on, and which
route it is chosen for when a schedule names none (``chosen_for``). From these:

* the route: ``local`` (the rollout engine sits on the trainer's GPUs), ``intra-node``,
  ``inter-node``;
* the chosen protocol: the record chosen for the route on a ``cpu`` or ``gpu`` cluster
  (colocated engines -> ``inplace``; disaggregated -> ``nccl`` on GPUs, ``gloo`` on CPU),
  overlapped with the next generation when it streams over a link;
* what makes a written protocol impossible: a route it cannot connect (E432: only
  colocated engines; E433: not across nodes), ``overlap`` between engines that take turns
  on the same GPUs (E434), a disk protocol across nodes without a shared ``dir`` (E435), a
  platform it does not run on (E443), a transport the platform lacks (E445: what it sends over
  there is not among :data:`~flowrl.catalog.platforms.TRANSPORTS`).

>>> from flowrl.catalog.hardware import PROFILES
>>> choose_protocol("inter-node", PROFILES["H100"])[0]
'nccl'
"""

from __future__ import annotations

import math

from flowrl.catalog.adapters import ADAPTER_BYTES, lora_params, lora_tensors
from flowrl.catalog.models import ModelFacts
from flowrl.catalog.platforms import PLATFORMS, TRANSPORTS
from flowrl.catalog.protocols import PROTOCOLS, ROUTES, chosen_protocol
from flowrl.compiler.reshard import reshard_plan
from flowrl.compiler.sched import ResyncSpec, SchedState
from flowrl.compiler.schedule.placement import ranges
from flowrl.cost.model import gather_s, transfer_s
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Diagnostic, Span
from flowrl.plan import EnginePlan, ResyncPlan

CHECKPOINT_SHARD_BYTES = 5 * 10**9
"""A disk protocol writes safetensors files of at most this size (the transformers default)."""


def route_of(train: EnginePlan, rollout: EnginePlan, per_node: int) -> str:
    """How far weights travel: ``local`` (same GPUs), ``intra-node`` or ``inter-node``."""
    if set(rollout.gpus) <= set(train.gpus):
        return "local"
    if {g // per_node for g in rollout.gpus} <= {g // per_node for g in train.gpus}:
        return "intra-node"
    return "inter-node"


def platform_kind(hw: Profile) -> str:
    """``cpu`` or ``gpu``: the kind of cluster :attr:`ProtocolSpec.chosen_for` distinguishes."""
    return "cpu" if hw.kind == "cpu" else "gpu"


def choose_protocol(route: str, hw: Profile) -> tuple[str, str]:
    """The protocol the compiler picks for a route, and why (from the record chosen for it)."""
    p = chosen_protocol(route, platform_kind(hw))
    where = "the rollout engine shares the trainer's GPUs" if route == "local" else f"disaggregated engines ({route})"
    return p.name, f"{where}: {p.doc}"


def sync_plan(rid: str, model: str, after: str, st: SchedState, origin: str,
              lora: tuple | None = None) -> tuple[ResyncPlan, list[Diagnostic]]:
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
    problems = protocol_problems(protocol, opts, route, train, rollout, spec.cluster, model, span, st.hw)
    p = PROTOCOLS[protocol]
    defaults = p.options
    bucket = int(opts.pop("bucket", defaults["bucket"].default if "bucket" in defaults else 0))
    overlap = bool(opts.pop("overlap", route != "local")) if p.streaming else False
    transport = p.transport.get(st.hw.platform, "")
    if written is not None and transport != protocol and protocol in p.transport.values():
        # named after a transport it does not use here (`nccl` on a CPU cluster)
        reason = f"as written; on this {st.hw.name} cluster `{protocol}` runs over {transport}"
    facts: ModelFacts | None = st.facts.get(model)
    total = largest = 0
    largest_name = ""
    seconds = 0.0
    reshard = None
    if facts is not None and lora is not None:  # LoRA (r, targets): the adapters only, unsharded, in fp32
        tensors = lora_tensors(facts, *lora)  # none for targets the model lacks: check_adapters says so (E613)
        total = lora_params(facts, *lora) * ADAPTER_BYTES
        largest_name, shape, _ = max(tensors, key=lambda t: math.prod(t[1]), default=("", (0,), 0))
        largest = math.prod(shape) * ADAPTER_BYTES
    elif facts is not None:
        total = facts.params * st.hw.weight_bytes
        largest_name, shape = max(facts.tensors(), key=lambda t: math.prod(t[1]))
        largest = math.prod(shape) * st.hw.weight_bytes
        if rollout.kind and train.kind:
            reshard = reshard_plan(facts, train.kind, train.tp, train.pp, rollout.kind, rollout.tp)
    unit = CHECKPOINT_SHARD_BYTES if p.shared_dir_across_nodes else bucket
    buckets = max(1, math.ceil(total / unit)) if unit else 1
    if facts is not None:
        # tensor/pipeline shards are gathered into full tensors first (engines without those axes have 1)
        seconds = gather_s(facts, st.hw, shards=train.tp * train.pp) + \
            transfer_s(total, st.hw, protocol=protocol, route=route, buckets=buckets)
    plan = ResyncPlan(rid, model, after, protocol, bucket, every, origin, options=opts, reason=reason, route=route,
                      transport=transport, overlap=overlap, total_bytes=int(total), buckets=buckets,
                      largest_tensor=largest_name, largest_bytes=int(largest), seconds=round(seconds, 6),
                      reshard=reshard)
    return plan, problems


def protocol_problems(protocol: str, opts: dict, route: str, train: EnginePlan, rollout: EnginePlan,
                      cluster: dict, model: str, span: Span, hw: Profile) -> list[Diagnostic]:
    """What makes ``protocol`` impossible for this placement and platform (see the module docstring)."""
    p = PROTOCOLS[protocol]
    sup = p.support(hw.platform)
    if not sup.ok:
        instead = chosen_protocol(route, platform_kind(hw)).name
        return [Diagnostic("E443", f"`{protocol}` resync of `{model}` does not run on {hw.platform} "
                                   f"(cluster gpu = \"{hw.name}\")", span,
                           (sup.why or f"`{protocol}` runs on {', '.join(sorted(p.platforms))}")
                           + f"; for this placement ({route}) the compiler would choose `{instead}`")]
    if p.transport_on(hw.platform) is None:
        return [_transport_lacking(p, model, route, span, hw)]
    where = f"`{model}.rollout` is on pool `{rollout.pool}` (GPUs {ranges(rollout.gpus)}) and `{model}.train` " \
            f"on pool `{train.pool}` (GPUs {ranges(train.gpus)})"
    if route not in p.routes:
        instead = chosen_protocol(route, platform_kind(hw)).name
        reach = max(p.routes, key=ROUTES.index)
        if reach == "local":
            return [Diagnostic("E432", f"`{protocol}` resync of `{model}` needs its rollout engine on the trainer's "
                                       f"GPUs, but {where}", span,
                               f"use `{instead}` (or `broadcast`) between separate pools, or colocate the engines")]
        return [Diagnostic("E433", f"`{protocol}` resync of `{model}` reaches engines on the same node(s) only "
                                   f"({p.doc}), but {where}, on different nodes", span,
                           f"use `{instead}` across nodes, or put both pools on the same node(s)")]
    if opts.get("overlap") is True and route == "local":
        return [Diagnostic("E434", f"`overlap = true` sends `{model}`'s weights while its rollout engine generates, "
                                   f"which needs separate GPUs, but `{model}.train` and `{model}.rollout` share "
                                   f"GPUs {ranges(set(train.gpus) & set(rollout.gpus))} and take turns", span,
                           "remove `overlap = true`, or place the engines on separate pools")]
    nodes = len({g // int(cluster["gpus_per_node"]) for g in train.gpus + rollout.gpus})
    if p.shared_dir_across_nodes and not opts.get("dir") and nodes > 1:
        return [Diagnostic("E435", f"`{protocol}` resync of `{model}` crosses {nodes} nodes, so it needs a directory "
                                   f"every node sees, but `dir` is empty", span,
                           f'give a shared directory: `{protocol}(dir = "/shared/ckpt")`')]
    return []


def _transport_lacking(p, model: str, route: str, span: Span, hw: Profile) -> Diagnostic:
    """E445: ``p`` runs on the platform, but what it sends over there is not a transport the platform has."""
    sent = p.transport.get(hw.platform)
    instead = chosen_protocol(route, platform_kind(hw)).name
    elsewhere = [pl for pl in PLATFORMS if p.transport_on(pl)]
    other = 'declare `gpu = "cpu"`' if "cpu" in elsewhere else f"target a cluster of {' or '.join(elsewhere)} GPUs"
    what = f"sends over {sent}" if sent else "names no transport"
    return Diagnostic("E445", f"`{p.name}` resync of `{model}` {what} on {hw.platform} (cluster gpu = \"{hw.name}\"), "
                              f"which has only {', '.join(sorted(TRANSPORTS[hw.platform]))}", span,
                      f"schedule `resync {model} via {instead}()` (what the compiler chooses for this placement, "
                      f"{route})" + (f", or {other}" if elsewhere else ""))


__all__ = ["sync_plan", "route_of", "choose_protocol", "protocol_problems", "platform_kind", "CHECKPOINT_SHARD_BYTES"]
