"""Weight-sync protocols as components: trainer weights -> rollout replicas, verified.

:data:`PROTOCOLS` maps the protocol names of a schedule (``resync policy via NAME``)
to classes implementing :class:`~flowrl.runtime.sync.base.WeightSync`, built from the
catalogue's records (:mod:`flowrl.runtime.sync.registry`); build one end with
:func:`make_sync`. The driver needs only ``cls.collective`` to know whether
sender and receivers run together (a collective) or one after the other (the
driver forwards ``sender.handoff()``).

| name | class | transport |
|---|---|---|
| ``inplace`` / ``ipc`` | :class:`InPlaceSync` | checksummed buckets through the Ray object store |
| ``cuda_ipc`` | :class:`CudaIpcSync` | device buffers shared through CUDA IPC handles, checksummed on the GPU |
| ``broadcast`` / ``gloo`` / ``nccl`` | :class:`BroadcastSync` | packed buckets over a standalone torch.distributed group (the record's transport: gloo or NCCL) |
| ``checkpoint`` | :class:`CheckpointSync` | safetensors + manifest in a shared directory, published atomically |
| ``delta`` | :class:`DeltaSync` | only changed tensors, over one of the above |

How a run uses them: :mod:`flowrl.runtime.sync.from_plan` turns a plan's ``ResyncPlan``
into options (and says what this machine cannot run); :mod:`flowrl.runtime.sync.endpoint`
is what the train and rollout workers call to open an end, send, receive and (in tests)
inject a corrupted byte.
"""

from __future__ import annotations

from typing import Any

from flowrl.runtime.sync.base import ProtocolStats, WeightSync
from flowrl.runtime.sync.broadcast import BroadcastSync, Rendezvous
from flowrl.runtime.sync.checkpoint import CheckpointHandoff, CheckpointSync
from flowrl.runtime.sync.cuda_ipc import CudaIpcSync, IpcHandoff
from flowrl.runtime.sync.delta import DeltaSync
from flowrl.runtime.sync.inplace import InPlaceHandoff, InPlaceSync
from flowrl.runtime.sync.registry import PROTOCOLS, is_collective, make_sync, protocol_class
from flowrl.runtime.weight_sync import WeightSyncError

SCHEDULE_OPTIONS: dict[str, str] = {"bucket": "bucket_bytes", "overlap": "overlap", "dir": "directory",
                                    "keep": "keep", "threshold": "threshold"}
"""Keyword of ``resync policy via PROTOCOL(...)`` in a flow -> constructor argument of the component."""


def options_from_schedule(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A schedule's protocol keywords (``bucket = 512MB``, ``dir``, ``keep``, ...) as :func:`make_sync` options.

    An empty ``dir`` (the schedule's default) is dropped: the driver then picks a
    directory under the run directory.
    """
    out = {}
    for key, value in kwargs.items():
        if key not in SCHEDULE_OPTIONS:
            raise WeightSyncError(f"schedule protocol option {key!r} has no component argument; hint: known "
                                  f"options are {', '.join(sorted(SCHEDULE_OPTIONS))}")
        if key == "dir" and not value:
            continue
        out[SCHEDULE_OPTIONS[key]] = value
    return out


__all__ = [
    "PROTOCOLS", "BroadcastSync", "CheckpointHandoff", "CheckpointSync", "CudaIpcSync", "DeltaSync", "IpcHandoff", "InPlaceHandoff",
    "InPlaceSync", "ProtocolStats", "Rendezvous", "SCHEDULE_OPTIONS", "WeightSync", "WeightSyncError",
    "is_collective", "make_sync", "options_from_schedule", "protocol_class",
]
