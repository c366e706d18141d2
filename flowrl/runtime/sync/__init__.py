"""Weight-sync protocols as components: trainer weights -> rollout replicas, verified.

:data:`PROTOCOLS` maps the protocol names of a schedule (``resync policy via NAME``)
to classes implementing :class:`~flowrl.runtime.sync.base.WeightSync`; build one end
with :func:`make_sync`. The driver needs only ``cls.collective`` to know whether
sender and receivers run together (a collective) or one after the other (the
driver forwards ``sender.handoff()``).

| name | class | transport |
|---|---|---|
| ``inplace`` / ``ipc`` | :class:`InPlaceSync` | checksummed buckets through the driver / Ray object store |
| ``broadcast`` / ``gloo`` / ``nccl`` | :class:`BroadcastSync` | packed buckets over a standalone torch.distributed group |
| ``checkpoint`` | :class:`CheckpointSync` | safetensors + manifest in a shared directory, published atomically |
| ``delta`` | :class:`DeltaSync` | only changed tensors, over one of the above |

How a run uses them: :mod:`flowrl.runtime.sync.from_plan` turns a plan's ``ResyncPlan``
into options (and says what this machine cannot run); :mod:`flowrl.runtime.sync.endpoint`
is what the train and rollout workers call to open an end, send, receive and (in tests)
inject a corrupted byte.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable

from flowrl.runtime.sync.base import ProtocolStats, WeightSync
from flowrl.runtime.sync.broadcast import BroadcastSync, Rendezvous
from flowrl.runtime.sync.checkpoint import CheckpointHandoff, CheckpointSync
from flowrl.runtime.sync.delta import DeltaSync
from flowrl.runtime.sync.inplace import InPlaceHandoff, InPlaceSync
from flowrl.runtime.weight_sync import WeightSyncError

PROTOCOLS: dict[str, Callable[..., WeightSync]] = {
    "inplace": InPlaceSync,
    # CUDA IPC handles need CUDA; between colocated processes on one node the object
    # store already moves buckets through shared memory, which is what IPC buys.
    "ipc": InPlaceSync,
    "broadcast": BroadcastSync,
    "gloo": functools.partial(BroadcastSync, backend="gloo"),
    "nccl": functools.partial(BroadcastSync, backend="nccl"),
    "checkpoint": CheckpointSync,
    "delta": DeltaSync,
}
"""Schedule protocol name -> class (or class with a fixed backend); call it as ``cls(role, **options)``."""


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


def protocol_class(name: str) -> type:
    """The class behind ``PROTOCOLS[name]`` (for ``collective``), or :class:`WeightSyncError` with a suggestion."""
    factory = _lookup(name)
    return factory.func if isinstance(factory, functools.partial) else factory


def is_collective(name: str, **options: Any) -> bool:
    """Whether sender and receivers of protocol ``name`` run together (``delta``: as its ``inner`` does)."""
    cls = protocol_class(name)
    if cls is DeltaSync:
        return is_collective(options.get("inner", "inplace"))
    return bool(cls.collective)


def make_sync(name: str, role: str, **options: Any) -> WeightSync:
    """Build one end of protocol ``name``.

    Args:
        name: a key of :data:`PROTOCOLS`.
        role: ``"sender"`` (train worker) or ``"receiver"`` (rollout worker).
        options: the class's keyword arguments (``bucket_bytes``, ``rendezvous``, ``directory``, ...).

    Raises:
        WeightSyncError: unknown protocol or option, naming it with a hint.
    """
    factory = _lookup(name)
    cls = protocol_class(name)
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [p for p in params if p not in ("self", "role")]
        for key in options:
            if key not in allowed:
                raise WeightSyncError(f"protocol `{name}` has no option {key!r}; hint: its options are "
                                      f"{', '.join(allowed)}")
    return factory(role, **options)


def _lookup(name: str) -> Callable[..., WeightSync]:
    factory = PROTOCOLS.get(name)
    if factory is None:
        close = difflib.get_close_matches(str(name), PROTOCOLS, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"protocols: {', '.join(sorted(PROTOCOLS))}"
        raise WeightSyncError(f"unknown weight-sync protocol {name!r}; hint: {hint}")
    return factory


__all__ = [
    "PROTOCOLS", "BroadcastSync", "CheckpointHandoff", "CheckpointSync", "DeltaSync", "InPlaceHandoff",
    "InPlaceSync", "ProtocolStats", "Rendezvous", "SCHEDULE_OPTIONS", "WeightSync", "WeightSyncError",
    "is_collective", "make_sync", "options_from_schedule", "protocol_class",
]
