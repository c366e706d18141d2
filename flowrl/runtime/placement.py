"""Where a plan's engines run on Ray: checks of the cluster, per-node placement groups, CPU shares.

The driver (:mod:`flowrl.runtime.driver`) makes one STRICT_PACK placement group per node
of the plan's cluster, one ``{"GPU": 1}`` bundle per GPU, and puts the engine rank the
plan gave global GPU ``g`` into bundle ``g % gpus_per_node`` of node ``g //
gpus_per_node``'s group. This module holds what that needs besides the Ray calls
themselves: refusing a cluster that cannot hold the plan (with the nodes, pools and
engines that do not fit), pinning plan nodes to Ray nodes, waiting for the reservation
with a clear timeout, and the share of a node's CPU cores each engine process gets.
"""

from __future__ import annotations

import os

from flowrl.plan import ExecutionPlan
from flowrl.runtime.handlers import RuntimeFlowError
from flowrl.runtime.workers import MULTI_RANK_TRAIN, train_engine_kind


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


def check_cluster_fits(plan: ExecutionPlan, nodes: list[dict], address: str | None) -> None:
    """Refuse at once a Ray cluster whose nodes cannot hold the plan's nodes (one GPU group per node)."""
    need, per = int(plan.cluster["nodes"]), int(plan.cluster["gpus_per_node"])
    gpus = sorted((int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)), reverse=True)
    fits = sum(g // per for g in gpus)  # a Ray node with k * per GPUs can hold k of the plan's nodes
    if fits >= need:
        return
    where = f"the Ray cluster at {address}" if address else "the local Ray instance"
    missing = "; ".join(f"node {k}: {node_needs(plan, k)}" for k in range(fits, need))
    raise PlacementError(
        f"placement: the plan needs {need} node(s) with {per} GPU(s) each (cluster(nodes = {need}, gpus_per_node = "
        f"{per})), but {where} has {len(gpus)} node(s) with GPUs {gpus}, room for {fits}; nothing can hold {missing}; "
        f"hint: add Ray nodes with num_gpus >= {per}, or declare the cluster Ray really has in the schedule")


def node_targets(plan: ExecutionPlan, nodes: list[dict]) -> list[str | None]:
    """The Ray node id each plan node is pinned to, or None each (one plan node, or too few Ray nodes).

    Candidates are alive Ray nodes with at least ``gpus_per_node`` GPUs, the head first, then
    by node id (deterministic): plan node k goes to the k-th.
    """
    need, per = int(plan.cluster["nodes"]), int(plan.cluster["gpus_per_node"])
    fit = sorted((n for n in nodes if n.get("Alive", True) and n.get("Resources", {}).get("GPU", 0) >= per),
                 key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}), n["NodeID"]))
    if need < 2 or len(fit) < need:
        return [None] * need
    return [n["NodeID"] for n in fit[:need]]


def wait_placed(plan: ExecutionPlan, pgs: list, address: str | None) -> None:
    """Wait for every node's placement group; a timeout names the node, its pools and engines."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=PLACEMENT_TIMEOUT_S)
    if len(ready) == len(pgs):
        return
    stuck = [k for k, pg in enumerate(pgs) if not _is_ready(pg)]
    free = ray.available_resources().get("GPU", 0.0)
    for pg in pgs:  # an external cluster would keep the half-made reservation otherwise
        remove_placement_group(pg)
    per = int(plan.cluster["gpus_per_node"])
    raise PlacementError(
        f"placement: Ray could not reserve {per} GPU(s) on one node within {PLACEMENT_TIMEOUT_S:g} s for "
        + "; ".join(f"node {k}: {node_needs(plan, k)}" for k in stuck)
        + f" ({free:g} GPU(s) free in {'the Ray cluster at ' + address if address else 'the local Ray instance'}); "
        "hint: other jobs may hold the GPUs, or no single Ray node has that many free "
        "(FLOWRL_PLACEMENT_TIMEOUT sets the wait)")


def _is_ready(pg) -> bool:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pg).get("state") == "CREATED"


def actor_location(actor_self) -> tuple[str, list]:
    """Run inside an actor (``__ray_call__``): its Ray node id and the logical GPU ids it was given."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]


def node_of(plan: ExecutionPlan, engine, rank: int) -> int:
    """The node the plan put ``engine``'s ``rank`` on."""
    gpus = engine.gpus or engine.bundles or (0,)
    return int(gpus[rank]) // int(plan.cluster["gpus_per_node"])


def processes_per_node(plan: ExecutionPlan) -> dict[int, int]:
    """How many engine processes run on each node: the share of its CPU cores each gets.

    A rollout replica is one process per ``tp`` ranks (the engine runs its own TP
    workers); a train engine is one process per rank.
    """
    count: dict[int, int] = {n: 0 for n in range(int(plan.cluster["nodes"]))}
    for m in plan.models:
        if m.train_engine is not None:
            e = m.train_engine
            for r in range(e.world_size if train_engine_kind(e.kind, e.dp) in MULTI_RANK_TRAIN else 1):
                count[node_of(plan, e, r)] += 1
        if m.rollout_engine is not None:
            e = m.rollout_engine
            for r in range(e.dp):
                count[node_of(plan, e, r * e.tp)] += 1
    return {n: max(1, c) for n, c in count.items()}
