"""The ``WeightSync`` protocol every weight-sync component implements, and shared helpers.

A weight sync moves a trainer's weights, as ``(hf_name, tensor)`` pairs, to one or
more rollout replicas. Each protocol is one class with two roles:

* the **sender** (the trainer's process) calls :meth:`WeightSync.send` with the
  weights and a policy version, and returns :class:`ProtocolStats`;
* each **receiver** (a rollout replica's process) iterates
  :meth:`WeightSync.receive`, which yields verified ``(name, tensor)`` pairs (pass
  them straight to ``RolloutEngine.update_weights``); its ``stats`` are complete
  once the iterator is exhausted.

How the two meet differs, and the driver needs to know only two things:

* ``collective = True`` (``broadcast``): sender and receivers run *at the same
  time* (a torch.distributed collective); nothing is handed over by the driver.
* ``collective = False`` (``inplace``, ``checkpoint``): the sender finishes first;
  the driver forwards ``sender.handoff()`` (a picklable record: the buckets, or the
  checkpoint's path) to every receiver's ``receive(handoff)``.

Every protocol verifies what arrived against the CRC-32 checksums of
:mod:`flowrl.runtime.weight_sync` and raises
:class:`~flowrl.runtime.weight_sync.WeightSyncError` naming the tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Protocol, runtime_checkable

import torch

from flowrl.runtime.weight_sync import SyncStats, WeightSyncError, crc32, raw_bytes

NamedTensors = Iterable[tuple[str, torch.Tensor]]
"""``(hf_name, tensor)`` pairs: any shape, a :data:`~flowrl.runtime.weight_sync.DTYPES` dtype."""

ROLES = ("sender", "receiver")
"""The two ends of a weight sync: the trainer sends, each rollout replica receives."""


@dataclass
class ProtocolStats(SyncStats):
    """:class:`~flowrl.runtime.weight_sync.SyncStats` of one send or receive, plus what every protocol reports."""

    protocol: str = ""
    """Name of the protocol in :data:`flowrl.runtime.sync.PROTOCOLS`."""
    version: int = -1
    """Policy version that was sent or received (-1: none yet)."""
    seconds: float = 0.0
    """Wall time of the whole send (or receive, until its iterator was exhausted), seconds."""
    wire_bytes: int = 0
    """Bytes that crossed the transport (bucket buffers, metadata, files), bytes."""
    skipped: int = 0
    """Tensors not sent because they did not change (``delta`` only)."""


@runtime_checkable
class WeightSync(Protocol):
    """One end (``role``) of a weight-sync protocol; see the module docstring for the call order."""

    name: ClassVar[str]
    """Key in :data:`flowrl.runtime.sync.PROTOCOLS`."""
    collective: ClassVar[bool]
    """True: sender and receivers must run concurrently; False: receive after send, with the handoff."""
    role: str
    """``"sender"`` or ``"receiver"``."""
    stats: ProtocolStats
    """Counters of the last send / receive."""

    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Sender: ship every ``(name, tensor)`` pair as policy ``version`` (an int >= 0)."""
        ...

    def handoff(self) -> Any:
        """Sender: the picklable record the driver forwards to each receiver (None for collectives)."""
        ...

    def receive(self, handoff: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: verified ``(name, tensor)`` CPU pairs of the next sync, in sending order."""
        ...

    def close(self) -> None:
        """Release the transport (process group, files held open); the object is unusable afterwards."""
        ...


def check_role(protocol: str, role: str, allowed: str | None = None) -> None:
    """Raise :class:`WeightSyncError` if ``role`` is not a role, or (given ``allowed``) is not ``allowed``."""
    if role not in ROLES:
        raise WeightSyncError(f"{protocol}: role={role!r}; hint: use one of {ROLES}")
    if allowed is not None and role != allowed:
        action = "send" if allowed == "sender" else "receive"
        raise WeightSyncError(f"{protocol}: a {role} cannot {action}; hint: create the object with role={allowed!r}")


def check_version(protocol: str, version: Any) -> int:
    """``version`` as an int >= 0, or :class:`WeightSyncError`."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightSyncError(f"{protocol}: version={version!r}; hint: pass the policy version, an int >= 0")
    return version


def tensor_crc32(name: str, tensor: torch.Tensor) -> int:
    """``zlib.crc32`` of the tensor's bytes: the same per-tensor checksum the buckets carry."""
    return crc32(raw_bytes(name, tensor)[1])


def json_tensor(obj: Any) -> torch.Tensor:
    """A JSON-able object as a ``[nbytes]`` uint8 tensor (metadata that travels like a weight)."""
    import json

    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def from_json_tensor(tensor: torch.Tensor) -> Any:
    """Inverse of :func:`json_tensor`."""
    import json

    return json.loads(bytes(tensor.contiguous().numpy()).decode())


class Timer:
    """Adds the wall time of a ``with`` block to ``stats.seconds``."""

    def __init__(self, stats: ProtocolStats):
        self.stats = stats

    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.stats.seconds += time.perf_counter() - self.t0
