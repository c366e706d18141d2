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

import torch.distributed as dist

from flowrl.runtime.sync import options_from_schedule
from flowrl.runtime.sync.broadcast import BroadcastSync, default_backend
from flowrl.runtime.sync.checkpoint import CheckpointSync
from flowrl.runtime.sync.delta import DeltaSync
from flowrl.runtime.sync.inplace import InPlaceSync
from flowrl.runtime.sync.registry import delta_carrier, is_collective, protocol_class, sync_kwargs
from flowrl.runtime.weight_sync import WeightSyncError


def _inplace(plan, run_dir: Path) -> dict:
    return {}


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

    ``nccl_elsewhere``: the ends run on another cluster's nodes, which may have NCCL even if this
    machine has not (they say so themselves when they open their ends)."""
    try:
        options = sync_options(plan, Path("."))
        backends = [sync_kwargs(plan.protocol, options).get("backend")]
        if options.get("inner"):
            backends.append(sync_kwargs(options["inner"], {k: v for k, v in options.items()
                                                           if k not in ("inner", "threshold")}).get("backend"))
    except WeightSyncError as error:
        return str(error)
    if dist.Backend.NCCL in backends and default_backend() != dist.Backend.NCCL and not nccl_elsewhere:
        return (f"resync of `{plan.model}` via `{plan.protocol}` sends over NCCL, which needs CUDA GPUs; this "
                "machine has none; hint: schedule `resync ... via gloo()` (or declare the cluster's "
                "`gpu = \"cpu\"`, so `broadcast` runs over gloo)")
    return None


def sync_metrics(protocol: str, sent: dict, received: list[dict], seconds: float) -> dict:
    """One resync's ``sync/*`` metrics from the sender's and each receiver's ProtocolStats dicts.

    ``sync/bytes``: bucket bytes the sender packed (a ``delta``: of the changed tensors
    only); ``sync/wire_bytes``: what crossed the transport (headers, metadata, files);
    ``sync/buckets``, ``sync/tensors``, ``sync/skipped`` (unchanged, not sent); seconds:
    ``sync/seconds`` (the driver's wall time, send to last load; the timeline has the
    sender's and each receiver's own span), ``sync/unpack_seconds`` (the slowest
    replica's verification); ``sync/protocol/NAME`` = 1 names the protocol (metrics
    are numbers).
    """
    out = {"sync/bytes": int(sent["bytes"]), "sync/wire_bytes": int(sent["wire_bytes"]),
           "sync/buckets": int(sent["buckets"]), "sync/tensors": int(sent["tensors"]),
           "sync/seconds": float(seconds),
           "sync/unpack_seconds": max((float(r["unpack_seconds"]) for r in received), default=0.0),
           f"sync/protocol/{protocol}": 1}
    if sent.get("skipped"):
        out["sync/skipped"] = int(sent["skipped"])
    return out


__all__ = ["sync_options", "collective", "sync_problem", "sync_metrics", "OPTIONS"]
