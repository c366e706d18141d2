"""``inplace``: checksummed buckets through Ray's object store, for colocated engines.

This is the path the driver has used since the first runtime: the train worker packs
its weights into buckets (:func:`~flowrl.runtime.weight_sync.pack_buckets`), the
driver forwards them (``ray.put`` once, so every replica reads one shared copy), and
each rollout replica verifies every bucket before its engine loads the tensors in
place. The component holds no transport of its own: the handoff *is* the buckets,
and whoever carries it (Ray, a pickle, a test) is the transport.

    sender = InPlaceSync("sender", bucket_bytes=256 << 20)       # train worker
    stats = sender.send(engine.named_weights(), version=3)
    handoff = sender.handoff()                                    # -> driver -> ray.put
    receiver = InPlaceSync("receiver")                            # each rollout worker
    engine.update_weights(receiver.receive(handoff))              # raises WeightSyncError on corruption
"""

from __future__ import annotations

from typing import ClassVar, Iterator, NamedTuple

import torch

from flowrl.runtime.sync.base import NamedTensors, ProtocolStats, Timer, check_role, check_version
from flowrl.runtime.weight_sync import Bucket, LostWeights, WeightSyncError, iter_buckets, unpack_bucket


class InPlaceHandoff(NamedTuple):
    """What the driver forwards from the sender to every receiver: the whole sync."""

    version: int
    """Policy version of the weights."""
    buckets: list[Bucket]
    """Checksummed buckets in packing order (numpy buffers: they cross Ray without pickling storages)."""
    count: int
    """How many buckets were sent: a receiver that finds fewer (or others) loads nothing (``LostWeights``)."""


class InPlaceSync:
    """Sender packs buckets into a handoff; receivers verify and unpack it (see the module docstring)."""

    name: ClassVar[str] = "inplace"
    collective: ClassVar[bool] = False

    def __init__(self, role: str, *, bucket_bytes: int = 256 << 20):
        """Args:
            role: ``"sender"`` (train worker) or ``"receiver"`` (rollout worker).
            bucket_bytes: largest bucket, bytes (the plan's ``bucket``); used by the sender.
        """
        check_role(self.name, role)
        self.role = role
        self.bucket_bytes = bucket_bytes
        self.stats = ProtocolStats(protocol=self.name)
        self.version = -1
        self._outbox: InPlaceHandoff | None = None

    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Pack every tensor into buckets of at most ``bucket_bytes``; :meth:`handoff` returns them."""
        check_role(self.name, self.role, "sender")
        version = check_version(self.name, version)
        self.stats = stats = ProtocolStats(protocol=self.name, version=version)
        with Timer(stats):
            buckets = list(iter_buckets(named_tensors, self.bucket_bytes, stats))
        stats.wire_bytes = stats.bytes
        self._outbox = InPlaceHandoff(version, buckets, len(buckets))
        self.version = version
        return stats

    def handoff(self) -> InPlaceHandoff:
        """The buckets of the last :meth:`send` (handed out once, so the sender does not pin them)."""
        check_role(self.name, self.role, "sender")
        if self._outbox is None:
            raise WeightSyncError("inplace: handoff() before send(); hint: call send(named_tensors, version) first")
        out, self._outbox = self._outbox, None
        return out

    def receive(self, handoff: InPlaceHandoff | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Verify each bucket of ``handoff`` (CRC-32 per bucket, per tensor on a mismatch) and yield its tensors."""
        check_role(self.name, self.role, "receiver")
        if not isinstance(handoff, InPlaceHandoff):
            raise WeightSyncError(f"inplace: receive() got {type(handoff).__name__}, expected the sender's "
                                  "InPlaceHandoff; hint: forward sender.handoff() to every receiver")
        return self._receive(handoff)

    def _receive(self, handoff: InPlaceHandoff) -> Iterator[tuple[str, torch.Tensor]]:
        self.stats = stats = ProtocolStats(protocol=self.name, version=handoff.version)
        got = [b.index for b in handoff.buckets]
        if got != list(range(handoff.count)):
            missing = sorted(set(range(handoff.count)) - set(got))
            raise LostWeights(f"inplace: bucket(s) {', '.join(map(str, missing)) or '?'} of the {handoff.count} sent "
                              f"for version {handoff.version} never arrived (got {got}); hint: the transport lost "
                              "them, resend the sync")
        with Timer(stats):
            for bucket in handoff.buckets:
                pairs = unpack_bucket(bucket, stats)  # raises WeightSyncError naming the bad tensor
                stats.buckets += 1
                stats.tensors += len(pairs)
                stats.bytes += int(bucket.data.nbytes)
                yield from pairs
        stats.wire_bytes = stats.bytes
        self.version = handoff.version

    def close(self) -> None:
        """Drop a handoff not yet taken; nothing else is held."""
        self._outbox = None
