"""From a plan's :class:`~flowrl.plan.ResyncPlan` to the options of :func:`~flowrl.runtime.sync.make_sync`.

The compiler decided the protocol, the bucket size, the overlap and the transport
(``gloo`` for a broadcast on a CPU cluster, ``nccl`` on GPUs, ``ray`` for in-place,
``disk`` for checkpoints); this module only translates those decisions, one small
function per protocol class in :data:`OPTIONS` (a ``delta`` goes over the protocol the
catalogue marks as carrying deltas on its transport), and says what this machine cannot run.

>>> from flowrl.plan import ResyncPlan
>>> r = ResyncPlan("resync.policy", "policy", "update", "broadcast", 1 << 20, 1, "f.flow:3:1",
...                transport="gloo", overlap=True)
>>> sorted(sync_options(r, Path("/run")).items())
[('backend', 'gloo'), ('bucket_bytes', 1048576), ('overlap', True)]
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from flowrl.catalog.platforms import TRANSPORTS
from flowrl.runtime.sync import options_from_schedule
from flowrl.runtime.sync.broadcast import BroadcastSync
from flowrl.runtime.sync.checkpoint import CheckpointSync
from flowrl.runtime.sync.cuda_ipc import CudaIpcSync
from flowrl.runtime.sync.delta import DeltaSync
from flowrl.runtime.sync.inplace import InPlaceSync
from flowrl.runtime.sync.registry import delta_carrier, is_collective, machine_platform, protocol_class, \
    sync_kwargs
from flowrl.runtime.weight_sync import WeightSyncError


def _inplace(plan, run_dir: Path) -> dict:
    return {}


def _cuda_ipc(plan, run_dir: Path) -> dict:
    return {}  # the sender's buffers go on its own GPU; the receiver maps them by the GPU's UUID


def _broadcast(plan, run_dir: Path) -> dict:
    # The plan's transport is the torch.distributed backend the compiler chose (gloo or NCCL);
    # without one (a plan of an older version) the protocol's record decides on this machine.
    return {"backend": plan.transport or None, "overlap": bool(plan.overlap)}


def _checkpoint(plan, run_dir: Path) -> dict:
    # A schedule without `dir`: the run directory, which every process of a one-node run sees.
    return {} if plan.options.get("dir") else {"directory": str(run_dir / "sync" / plan.model)}


def _delta(plan, run_dir: Path) -> dict:
    inner = delta_carrier(plan.transport)
    return {"inner": inner, **OPTIONS[protocol_class(inner)](plan, run_dir)}


OPTIONS: dict[type, Callable[..., dict]] = {
    InPlaceSync: _inplace, BroadcastSync: _broadcast, CheckpointSync: _checkpoint, DeltaSync: _delta,
    CudaIpcSync: _cuda_ipc,
}
"""Protocol class -> ``(ResyncPlan, run directory) -> options`` the schedule's keywords do not give."""


def sync_options(plan, run_dir: Path) -> dict:
    """Options of both ends of ``plan``'s protocol (the driver adds rendezvous, rank and world size).

    Args:
        plan: a :class:`~flowrl.plan.ResyncPlan`.
        run_dir: the run directory (default home of ``checkpoint`` versions).
    """
    options = options_from_schedule(dict(plan.options))
    if plan.bucket_bytes > 0:  # `checkpoint` has no bucket keyword: its files keep their default size
        options["bucket_bytes"] = int(plan.bucket_bytes)
    options.update(OPTIONS[protocol_class(plan.protocol)](plan, run_dir))
    return {k: v for k, v in options.items() if v is not None}


def collective(plan, options: dict) -> bool:
    """Whether ``plan``'s sender and receivers must run together (a torch.distributed group)."""
    return is_collective(plan.protocol, **options)


def sync_problem(plan, nccl_elsewhere: bool = False) -> str | None:
    """Why this machine cannot run ``plan``'s protocol (one line with a hint), or None.

    The compiler checked the protocol, its options and its transport against the schedule's
    platform (E432-E435, E443, E445); what it cannot know is the machine the run starts on. A
    plan for GPUs sends over ``nccl``, which a CPU machine lacks: the plan's transport must be one
    of this machine's platform's :data:`~flowrl.catalog.platforms.TRANSPORTS`.
    ``nccl_elsewhere``: the ends run on another cluster's nodes (``--ray``/``RAY_ADDRESS``), whose
    processes say whether they have it when they open their ends. Options are checked again here
    for a plan that was written by hand (a compiled plan's options are the catalogue's)."""
    try:
        options = sync_options(plan, Path("."))
        sync_kwargs(plan.protocol, options)
        if options.get("inner"):  # a delta hands the rest of its options to the protocol carrying it
            sync_kwargs(options["inner"], {k: v for k, v in options.items() if k not in ("inner", "threshold")})
    except WeightSyncError as error:
        return str(error)
    machine = machine_platform()
    if plan.transport and plan.transport not in TRANSPORTS[machine] and not nccl_elsewhere:
        having = [p for p in TRANSPORTS if plan.transport in TRANSPORTS[p]]
        made_for = f"a {' or '.join(having)} cluster" if having else "no platform flowrl knows"
        return (f"resync of `{plan.model}` via `{plan.protocol}` sends over {plan.transport}, which this machine "
                f"(platform {machine}) lacks: the plan was made for {made_for}; hint: run it "
                f"on such a cluster (or join one with --ray), or schedule `resync ... via gloo()`, or declare the "
                f"cluster's `gpu = \"{machine}\"` so the compiler plans for this machine")
    return None


def sync_metrics(protocol: str, sent: dict, received: list[dict], seconds: float) -> dict:
    """One resync's ``sync/*`` metrics from the sender's and each receiver's ProtocolStats dicts.

    ``sync/bytes``: bucket bytes the sender packed (a ``delta``: of the changed tensors
    only); ``sync/copied_bytes``: of the weights' bytes, those the sender copied to pack them
    (0 where they live in the protocol's messages, a ``broadcast`` from a CPU ``torch`` trainer);
    ``sync/wire_bytes``: what crossed the transport (headers, metadata, files);
    ``sync/buckets``, ``sync/tensors``, ``sync/skipped`` (unchanged, not sent); seconds:
    ``sync/seconds`` (the driver's wall time, send to last load; the timeline has the
    sender's and each receiver's own span), ``sync/unpack_seconds`` (the slowest
    replica's verification); ``sync/protocol/NAME`` = 1 names the protocol (metrics
    are numbers); ``sync/rank_bytes/R/K``: bytes rank K of rollout replica R was given (a
    tensor-parallel vLLM worker: only its shards, the executed reshard plan) and
    ``sync/delivered_bytes`` their sum.
    """
    out = {"sync/bytes": int(sent["bytes"]), "sync/copied_bytes": int(sent["copied_bytes"]),
           "sync/wire_bytes": int(sent["wire_bytes"]),
           "sync/buckets": int(sent["buckets"]), "sync/tensors": int(sent["tensors"]),
           "sync/seconds": float(seconds),
           "sync/unpack_seconds": max((float(r["unpack_seconds"]) for r in received), default=0.0),
           f"sync/protocol/{protocol}": 1}
    for replica, r in enumerate(received):
        for rank, n in enumerate(r.get("rank_bytes", ())):
            out[f"sync/rank_bytes/{replica}/{rank}"] = int(n)
    if any("rank_bytes" in r for r in received):
        out["sync/delivered_bytes"] = sum(int(n) for r in received for n in r.get("rank_bytes", ()))
    if sent.get("skipped"):
        out["sync/skipped"] = int(sent["skipped"])
    return out


__all__ = ["sync_options", "collective", "sync_problem", "sync_metrics", "OPTIONS"]
