"""Where a plan's engines run on Ray: checks of the cluster, per-node placement groups, CPU shares.

The driver (:mod:`flowrl.runtime.driver`) makes one STRICT_PACK placement group per node
of the plan's cluster, one bundle per GPU (``{"GPU": 1}``; on a CPU-only Ray cluster running a
plan for the ``cpu`` platform, ``{"CPU": 1}``: :func:`slot_resource`), and puts the engine rank the
plan gave global GPU ``g`` into bundle ``g % gpus_per_node`` of node ``g //
gpus_per_node``'s group. This module holds what that needs besides the Ray calls
themselves: refusing a cluster that cannot hold the plan (with the nodes, pools and
engines that do not fit), pinning plan nodes to Ray nodes, waiting for the reservation
with a clear timeout, each rank actor's bundle of a train engine with several ranks
(:func:`rank_placement`), and the share of a node's CPU cores each engine process gets.
"""

from __future__ import annotations

import os

from flowrl.catalog.hardware import PROFILES
from flowrl.engines.ranks import RankPlacement
from flowrl.engines.registry import runs_on
from flowrl.plan import ExecutionPlan
from flowrl.runtime.errors import RuntimeFlowError


class PlacementError(RuntimeFlowError):
    """Ray cannot place the plan's engines: the message names the node, pools and engines, and what is missing."""


PLACEMENT_TIMEOUT_S = float(os.environ.get("FLOWRL_PLACEMENT_TIMEOUT", "60"))
"""How long to wait for Ray to reserve a node's GPUs before giving up with a :class:`PlacementError`."""


def node_needs(plan: ExecutionPlan, node: int) -> str:
    """``pool gen (policy.rollout), GPUs 2-3``: what the plan put on ``node``."""
    per = int(plan.cluster["gpus_per_node"])
    parts = []
    for p in plan.pools:
        gpus = [g for g, n in zip(p.gpu_ids, p.nodes) if n == node] if p.nodes else []
        if gpus and p.engines:
            span = f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {gpus[0]}-{gpus[-1]}"
            parts.append(f"pool `{p.name}` ({', '.join(p.engines)}; {span})")
    return "; ".join(parts) or f"GPUs {node * per}-{node * per + per - 1}"


def on_gpus(plan: ExecutionPlan) -> bool:
    """Whether the plan's cluster is of a GPU kind (a profile of :data:`PROFILES` off the ``cpu``
    platform), not ``cpu`` (logical GPUs)."""
    gpu = str(plan.cluster.get("gpu", "cpu"))
    return gpu in PROFILES and PROFILES[gpu].platform != "cpu"


def slot_resource(plan: ExecutionPlan, nodes: list[dict]) -> str:
    """The Ray resource one of the plan's GPUs takes: ``"GPU"``; or ``"CPU"`` (one core per logical
    GPU) for a plan on the ``cpu`` platform over a Ray cluster none of whose nodes has GPUs, so a
    CPU-only cluster started with plain ``ray start`` runs it without pretending to have GPUs."""
    if on_gpus(plan):
        return "GPU"
    alive = [n for n in nodes if n.get("Alive", True)]
    return "GPU" if any(n.get("Resources", {}).get("GPU", 0) for n in alive) else "CPU"


def check_cluster_fits(plan: ExecutionPlan, nodes: list[dict], address: str | None) -> None:
    """Refuse at once a Ray cluster whose nodes cannot hold the plan's nodes (one group of GPU slots per node)."""
    need, per = int(plan.cluster["nodes"]), int(plan.cluster["gpus_per_node"])
    slot = slot_resource(plan, nodes)
    gpus = sorted((int(n.get("Resources", {}).get(slot, 0)) for n in nodes if n.get("Alive", True)), reverse=True)
    fits = sum(g // per for g in gpus)  # a Ray node with k * per GPUs can hold k of the plan's nodes
    if fits >= need:
        return
    where = f"the Ray cluster at {address}" if address else "the local Ray instance"
    missing = "; ".join(f"node {k}: {node_needs(plan, k)}" for k in range(fits, need))
    raise PlacementError(
        f"placement: the plan needs {need} node(s) with {per} GPU(s) each (cluster(nodes = {need}, gpus_per_node = "
        f"{per})), but {where} has {len(gpus)} node(s) with {slot}s {gpus}, room for {fits}; nothing can hold "
        f"{missing}; hint: add Ray nodes with num_{slot.lower()}s >= {per}, or declare the cluster Ray really has "
        "in the schedule")



def _gb(x: float) -> str:
    return f"{x:.1f} GB" if x >= 0.95 else f"{x * 1e3:.0f} MB"


ACTOR_GB = 0.21
"""Host memory (GB) of one engine actor's Ray worker process with torch imported, before its engine
starts (proportional set size, measured on 2 cores with Ray 2.x): a cost per actor, not per rank."""


def host_memory_need(plan: ExecutionPlan) -> list[tuple[str, int, float]]:
    """``(engine, ranks, GB per rank)`` of each engine of a plan for the ``cpu`` platform: the compiler's
    memory estimate (``flowrl plan``'s ``memory/GPU`` column: on ``cpu`` a logical GPU's memory is the
    host's RAM), plus what each rank's process holds beyond it (the record's ``cpu_rank_gb``) and its
    share of the actors' own (:data:`ACTOR_GB`: one per replica, or one per rank and their coordinator); empty for a
    plan for GPUs (device memory, which the compiler checks per GPU)."""
    if on_gpus(plan):
        return []
    rows = []
    for m in plan.models:
        for e in (m.train_engine, m.rollout_engine):
            if e is not None and e.memory is not None:
                spec = runs_on(e.kind, e.world_size)
                # replicas: an actor each; rank actors: an actor per rank and their coordinator
                actors = {"replicas": e.dp, "actors": e.world_size + 1, "single": 1}[spec.ranks]
                per_rank = float(e.memory.total_gb) + spec.cpu_rank_gb + ACTOR_GB * actors / e.world_size
                rows.append((f"{m.id}.{e.role} ({e.kind})", e.world_size, per_rank))
    return rows


def check_host_memory(plan: ExecutionPlan, available_gb: float | None) -> None:
    """Refuse at once a plan for the ``cpu`` platform whose engines cannot fit in this machine's memory.

    On a local Ray instance every logical GPU of every plan node is a process of this machine, so
    the plan's engines need the sum of their estimated memory per rank over all their ranks
    (:func:`host_memory_need`); ``available_gb`` is what the machine has free
    (:func:`available_memory_gb`; None: unknown, nothing is refused). A cluster the run joins
    (``RAY_ADDRESS``, ``--ray``) spreads the engines over its nodes: not checked here.
    """
    rows = host_memory_need(plan)
    need = sum(ranks * gb for _k, ranks, gb in rows)
    if available_gb is None or need <= available_gb:
        return
    c = plan.cluster
    parts = ", ".join(f"{ranks} x {key} {_gb(gb)}" for key, ranks, gb in sorted(rows, key=lambda r: -r[1] * r[2]))
    raise PlacementError(
        f"host memory: the plan's engines need {_gb(need)} of this machine's memory on a local Ray instance "
        f"({parts}: `flowrl plan`'s memory/GPU and each rank's process, times the ranks), but it has "
        f"{_gb(available_gb)} available; "
        f"nothing was started. hint: run it on a Ray cluster (RAY_ADDRESS=ADDRESS or `flowrl run --ray ADDRESS`), "
        f"or declare a smaller cluster in the schedule (this one: cluster(nodes = {c['nodes']}, gpus_per_node = "
        f"{c['gpus_per_node']}))")


def available_memory_gb() -> float | None:
    """This machine's available memory in GB (1e9 bytes): ``MemAvailable`` of ``/proc/meminfo``, else
    psutil's, else None (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available / 1e9

def node_targets(plan: ExecutionPlan, nodes: list[dict]) -> list[str | None]:
    """The Ray node id each plan node is pinned to, or None each (one plan node, or too few Ray nodes).

    Candidates are alive Ray nodes with at least ``gpus_per_node`` GPUs, the head first, then
    by node id (deterministic): plan node k goes to the k-th.
    """
    need, per = int(plan.cluster["nodes"]), int(plan.cluster["gpus_per_node"])
    slot = slot_resource(plan, nodes)
    fit = sorted((n for n in nodes if n.get("Alive", True) and n.get("Resources", {}).get(slot, 0) >= per),
                 key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}), n["NodeID"]))
    if need < 2 or len(fit) < need:
        return [None] * need
    return [n["NodeID"] for n in fit[:need]]


def wait_placed(plan: ExecutionPlan, pgs: list, address: str | None, slot: str = "GPU") -> None:
    """Wait for every node's placement group; a timeout names the node, its pools and engines."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=PLACEMENT_TIMEOUT_S)
    if len(ready) == len(pgs):
        return
    stuck = [k for k, pg in enumerate(pgs) if not _is_ready(pg)]
    free = ray.available_resources().get(slot, 0.0)
    for pg in pgs:  # an external cluster would keep the half-made reservation otherwise
        remove_placement_group(pg)
    per = int(plan.cluster["gpus_per_node"])
    raise PlacementError(
        f"placement: Ray could not reserve {per} {slot}(s) on one node within {PLACEMENT_TIMEOUT_S:g} s for "
        + "; ".join(f"node {k}: {node_needs(plan, k)}" for k in stuck)
        + f" ({free:g} {slot}(s) free in {'the Ray cluster at ' + address if address else 'the local Ray instance'}); "
        "hint: other jobs may hold the GPUs, or no single Ray node has that many free "
        "(FLOWRL_PLACEMENT_TIMEOUT sets the wait)")


def _is_ready(pg) -> bool:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pg).get("state") == "CREATED"


def actor_location(actor_self) -> tuple[str, list, int, str]:
    """Run inside an actor (``__ray_call__``): its Ray node id, the logical GPU ids it was given, its
    process id and the device its engines take (:func:`flowrl.engines.base.accelerator`)."""
    import os

    import ray

    from flowrl.engines.base import accelerator

    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])], os.getpid(), accelerator()


def no_gpu_warning(plan: ExecutionPlan, rows: list[dict]) -> str | None:
    """A plan on GPUs whose engine actors see none computes on the CPU: the warning naming them (the
    ``device`` of ``placement.json``'s rows), or None."""
    blind = [f"{r['engine']} rank {r['rank']}" for r in rows if r.get("device") == "cpu"]
    if not on_gpus(plan) or not blind:
        return None
    return (f"warning: the plan is for {plan.cluster['gpu']} GPUs, but {', '.join(blind)} see(s) no GPU (torch "
            "finds no CUDA device in the process Ray started): those engines compute on the CPU; hint: run on the "
            "GPU nodes with a CUDA build of torch, or plan for `gpu = \"cpu\"`")


def node_of(plan: ExecutionPlan, engine, rank: int) -> int:
    """The node the plan put ``engine``'s ``rank`` on."""
    gpus = engine.gpus or engine.bundles or (0,)
    return int(gpus[rank]) // int(plan.cluster["gpus_per_node"])


COORDINATOR_SHARE = 0.01
"""The part of rank 0's slot share an engine's coordinating actor takes when its ranks are actors
(:func:`rank_placement`); rank 0's actor takes the rest. The coordinator computes nothing, but holds a
sliver of the slot so that on GPUs Ray shows it rank 0's GPU (a collective resync sends from it)."""


def rank_actors(engine) -> bool:
    """Whether ``engine`` (an :class:`~flowrl.plan.EnginePlan`) runs one Ray actor per rank: its layout's
    record says ``ranks = "actors"`` and it has more than one rank."""
    return engine.world_size > 1 and runs_on(engine.kind, engine.world_size).ranks == "actors"


def rank_placement(plan: ExecutionPlan, engine, groups: list, slot: str) -> RankPlacement:
    """Where each rank actor of ``engine`` runs: rank ``r``, planned on global GPU ``g``, in bundle
    ``g % gpus_per_node`` of node ``g // gpus_per_node``'s placement group ``groups[node]``, taking the
    plan's GPUs per rank (rank 0 less the coordinator's :data:`COORDINATOR_SHARE`) of ``slot``."""
    per = int(plan.cluster["gpus_per_node"])
    gpus = [int(g) for g in (engine.gpus or engine.bundles)[:engine.world_size]]
    full = round(float(engine.gpus_per_rank), 4)
    shares = tuple(round(full - round(full * COORDINATOR_SHARE, 4), 4) if r == 0 else full for r in range(len(gpus)))
    return RankPlacement(groups=tuple(groups[g // per] for g in gpus), bundles=tuple(g % per for g in gpus),
                         shares=shares, resource=slot, nodes=tuple(g // per for g in gpus))


def processes_per_node(plan: ExecutionPlan) -> dict[int, int]:
    """How many computing engine processes run on each node: the share of its CPU cores each gets.

    A train engine whose ranks are actors (the record running its layout says ``actors``: megatron,
    fsdp, and ``torch(dp = 2)`` on fsdp's ranks) counts one per rank on its rank's node, else one;
    a rollout replica counts one per tensor-parallel rank (the engine runs a worker per rank).
    """
    count: dict[int, int] = {n: 0 for n in range(int(plan.cluster["nodes"]))}
    for m in plan.models:
        if m.train_engine is not None:
            e = m.train_engine
            for r in range(e.world_size if rank_actors(e) else 1):
                count[node_of(plan, e, r)] += 1
        if m.rollout_engine is not None:
            e = m.rollout_engine
            for r in range(e.dp):
                count[node_of(plan, e, r * e.tp)] += e.tp
    return {n: max(1, c) for n, c in count.items()}
