"""``broadcast``: packed checksummed buckets broadcast over a torch.distributed group.

The group spans the trainer (rank 0, the sender) and every rollout replica (ranks
1..N). It is a *standalone* group built on its own ``TCPStore``, never torch's
default group: a rollout replica hosting vLLM in-process already has a default
group (vLLM creates a gloo world of 1; measured here), and a Megatron or FSDP
trainer has its own, so ``init_process_group`` would fail in exactly the processes
that sync. The same choice is made by vLLM's ``StatelessProcessGroup`` and by veRL.
:meth:`BroadcastSync.close` shuts the group and its store down and leaves any
default group as it found it (the pitfall of ``ray.util.collective``, which leaves
a default group behind, cannot arise).

Backend: NCCL when CUDA is available, else gloo; the code is the same, only the
device of the wire buffers differs. Checksums are CRC-32 on CPU bytes (the bucket
format of :mod:`flowrl.runtime.weight_sync`), so on GPUs a bucket is packed on the
CPU, sent from the GPU and verified on the CPU again.

Rendezvous: the sender opens the store on ``port`` (0 = any free port, race-free)
and exposes ``sender.rendezvous``; the driver passes that record to each receiver.
The group itself forms lazily at the first :meth:`~BroadcastSync.send` /
:meth:`~BroadcastSync.receive`, which all ranks enter together anyway.

Wire format, per bucket: a header ``int64[5] = (kind, version, index, data bytes,
metadata bytes)``, the metadata (JSON: bucket CRC and each tensor's name, dtype,
shape, offset, bytes, CRC), then the bucket's bytes. A sync ends with an ``END``
header, or an ``ABORT`` header carrying the sender's error if packing failed, so
receivers never wait for buckets that will not come.

Overlap: with ``overlap=True`` a background thread packs bucket i+1 (copy + CRC,
both release the GIL) while bucket i is on the wire, and on the receiver a thread
receives bucket i+1 while bucket i is verified and loaded. Buffers are reused
(:mod:`flowrl.runtime.sync.packing`): the sender keeps about three buckets, a
receiver one model's worth, between syncs.
"""

from __future__ import annotations

import datetime
import json
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from flowrl.runtime.sync.base import NamedTensors, ProtocolStats, Timer, check_role, check_version
from flowrl.runtime.sync.packing import BucketPacker, BufferPool
from flowrl.runtime.weight_sync import Bucket, TensorMeta, WeightSyncError, unpack_bucket

BUCKET, END, ABORT = 1, 2, 3
"""Frame kinds in the header's first field."""

HEADER_LEN = 5
"""int64 fields of a frame header: kind, version, index, data bytes, metadata bytes."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the receivers find the sender's store; plain data the driver passes to rollout actors."""

    host: str
    """Address of the sender's node, reachable from every receiver (e.g. ``ray.util.get_node_ip_address()``)."""
    port: int
    """TCP port of the sender's store."""
    world_size: int
    """1 sender + the number of receivers."""


class _Frame(NamedTuple):
    kind: int
    version: int
    payload: Any
    """A :class:`Bucket` (BUCKET), the sender's message (ABORT), or None (END)."""


def default_backend() -> str:
    """``"nccl"`` when CUDA and NCCL are available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _gloo_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta):
    return dist.ProcessGroupGloo(store, rank, world, timeout), torch.device("cpu")


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return dist.ProcessGroupNCCL(store, rank, world, options), device


BACKENDS: dict[str, Callable] = {"gloo": _gloo_group, "nccl": _nccl_group}
"""Backend name -> ``(store, rank, world, timeout) -> (process group backend, wire device)``."""


class _Prefetch:
    """Runs an iterator in a background thread, ``depth`` items ahead; re-raises its error in the consumer."""

    _DONE = object()

    def __init__(self, iterator: Iterable, depth: int = 1):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True, name="flowrl-sync-prefetch")
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, iterator: Iterable) -> None:
        try:
            for item in iterator:
                if not self._put(item):
                    return
        except BaseException as error:  # forwarded to the consumer, which raises it
            self._put(_Failure(error))
            return
        self._put(self._DONE)

    def __iter__(self) -> Iterator:
        # Iterating again after the end (a drain in a ``finally``) must not wait for a thread that is gone.
        while not self._ended:
            item = self._queue.get()
            if item is self._DONE:
                self._ended = True
                return
            if isinstance(item, _Failure):
                self._ended = True
                raise item.error
            yield item

    def close(self) -> None:
        """Stop the producer (it exits at its next item) and wait for it."""
        self._stop.set()
        self._thread.join()


class _Failure(NamedTuple):
    error: BaseException


class BroadcastSync:
    """One rank of a bucket broadcast; rank 0 sends, ranks 1..N receive (see the module docstring).

    Sender (train worker)::

        sync = BroadcastSync("sender", world_size=1 + replicas, bucket_bytes=512 << 20)
        rdzv = sync.rendezvous                         # -> driver -> each receiver
        stats = sync.send(engine.named_weights(), version)   # concurrently with the receivers

    Receiver ``i`` (rollout worker, ``rank = i + 1``)::

        sync = BroadcastSync("receiver", rendezvous=rdzv, rank=i + 1)
        engine.update_weights(sync.receive())
    """

    name: ClassVar[str] = "broadcast"
    collective: ClassVar[bool] = True

    def __init__(self, role: str, *, rendezvous: Rendezvous | None = None, rank: int | None = None,
                 world_size: int | None = None, bucket_bytes: int = 512 << 20, overlap: bool = True,
                 backend: str | None = None, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0,
                 tamper: Callable[[Bucket], Bucket] | None = None):
        """Args:
            role: ``"sender"`` (rank 0, opens the store) or ``"receiver"``.
            rendezvous: receivers: the sender's :attr:`rendezvous`.
            rank: receivers: 1..world_size-1 (the sender is always rank 0).
            world_size: sender: 1 + number of receivers (>= 2).
            bucket_bytes: largest bucket, bytes (the plan's ``bucket``).
            overlap: pack (sender) / receive (receiver) the next bucket in a background thread.
            backend: ``"gloo"`` or ``"nccl"``; default :func:`default_backend`. All ranks must agree.
            host: sender: the address receivers connect to.
            port: sender: the store's TCP port; 0 picks a free one.
            timeout_s: how long a collective (and the rendezvous) may wait, seconds.
            tamper: fault injection for tests: applied to each checksummed bucket before it is sent.
        """
        check_role(self.name, role, None)
        self.role = role
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise WeightSyncError(f"broadcast: backend={self.backend!r}; hint: use one of {sorted(BACKENDS)}")
        if self.backend == "nccl" and default_backend() != "nccl":
            raise WeightSyncError("broadcast: backend='nccl' needs CUDA and a torch build with NCCL, this process "
                                  "has neither; hint: use backend='gloo' (protocol `gloo`) on CPU")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.tamper = tamper
        self.stats = ProtocolStats(protocol=self.name)
        self.version = -1
        self._group = None
        self._device = torch.device("cpu")
        self._broken: str | None = None
        self._packer = BucketPacker(bucket_bytes) if role == "sender" else None
        self._pool = BufferPool()
        if role == "sender":
            self._open_sender(world_size, host, port)
        else:
            self._open_receiver(rendezvous, rank)

    # ---- set-up and tear-down ------------------------------------------------------------
    def _open_sender(self, world_size: int | None, host: str, port: int) -> None:
        if not isinstance(world_size, int) or world_size < 2:
            raise WeightSyncError(f"broadcast: world_size={world_size!r}; hint: the sender needs "
                                  "world_size = 1 + the number of rollout replicas (>= 2)")
        self.rank = 0
        self._store = dist.TCPStore(host, port, world_size, True, self.timeout, wait_for_workers=False)
        self.rendezvous = Rendezvous(host, int(self._store.port), world_size)

    def _open_receiver(self, rendezvous: Rendezvous | None, rank: int | None) -> None:
        if not isinstance(rendezvous, Rendezvous):
            raise WeightSyncError(f"broadcast: a receiver needs the sender's Rendezvous, got {rendezvous!r}; "
                                  "hint: pass rendezvous=sender.rendezvous (forwarded by the driver)")
        if not isinstance(rank, int) or not 1 <= rank < rendezvous.world_size:
            raise WeightSyncError(f"broadcast: receiver rank={rank!r}; hint: ranks 1..{rendezvous.world_size - 1}, "
                                  "rank 0 is the sender")
        self.rank = rank
        self.rendezvous = rendezvous
        try:
            self._store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, False, self.timeout)
        except RuntimeError as error:
            raise WeightSyncError(f"broadcast: cannot reach the sender's store at {rendezvous.host}:"
                                  f"{rendezvous.port}: {error}; hint: is the sender alive and the address "
                                  "reachable from this node?") from None

    def _connect(self) -> None:
        """Form the group (collective: every rank enters its first send/receive)."""
        if self._broken:
            raise WeightSyncError(f"broadcast: the group is unusable ({self._broken}); hint: close() every rank "
                                  "and set up a new rendezvous")
        if self._group is None:
            store = dist.PrefixStore("flowrl-weight-sync", self._store)
            self._group, self._device = BACKENDS[self.backend](store, self.rank, self.rendezvous.world_size,
                                                               self.timeout)

    def close(self) -> None:
        """Shut the group and the store down (idempotent); torch's default group is left untouched."""
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except RuntimeError:  # a peer already left: nothing left to flush
                pass
        self._store = None
        self._broken = self._broken or "closed"

    # ---- the wire ----------------------------------------------------------------------------
    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from rank 0 in place; a transport failure breaks the group for good."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            self._group.broadcast([tensor], options).wait()
        except RuntimeError as error:
            self._broken = f"broadcast failed: {str(error).splitlines()[0]}"
            raise WeightSyncError(f"broadcast: transport failed on rank {self.rank}: {self._broken}; hint: a peer "
                                  "died or timed out; close() every rank and set up a new rendezvous") from None
        return tensor

    def _send_header(self, kind: int, version: int, index: int, data_bytes: int, meta_bytes: int) -> None:
        header = [kind, version, index, data_bytes, meta_bytes]
        self._bcast(torch.tensor(header, dtype=torch.int64, device=self._device))

    def _send_blob(self, blob: torch.Tensor) -> None:
        self._bcast(blob.to(self._device, non_blocking=True) if self._device.type != "cpu" else blob)

    def _send_frame(self, kind: int, version: int, index: int, meta: bytes, data: np.ndarray | None) -> int:
        """Header, metadata, data (each a broadcast); returns the bytes sent."""
        nbytes = 0 if data is None else int(data.nbytes)
        self._send_header(kind, version, index, nbytes, len(meta))
        if meta:
            self._send_blob(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if nbytes:
            self._send_blob(torch.from_numpy(data))
        return HEADER_LEN * 8 + len(meta) + nbytes

    def _recv_frame(self) -> tuple[_Frame, int]:
        header = self._bcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=self._device)).tolist()
        kind, version, index, data_bytes, meta_bytes = header
        meta = self._recv_blob(meta_bytes) if meta_bytes else np.empty(0, np.uint8)
        data = self._recv_blob(data_bytes, pooled=True) if data_bytes else np.empty(0, np.uint8)
        wire = HEADER_LEN * 8 + meta_bytes + data_bytes
        if kind == BUCKET:
            return _Frame(kind, version, _bucket_from(index, meta, data)), wire
        if kind == ABORT:
            return _Frame(kind, version, bytes(meta).decode(errors="replace")), wire
        if kind == END:
            return _Frame(kind, version, None), wire
        self._broken = f"unknown frame kind {kind}"
        raise WeightSyncError(f"broadcast: rank {self.rank} got a frame of unknown kind {kind} (header {header}); "
                              "hint: every rank must run the same flowrl version")

    def _recv_blob(self, nbytes: int, pooled: bool = False) -> np.ndarray:
        if self._device.type == "cpu":
            # Straight into numpy memory (no copy); bucket data into pooled buffers, already
            # touched: fresh ones page-fault on every 4 KiB page, slower than the wire.
            out = self._pool.take(nbytes) if pooled else np.empty(nbytes, dtype=np.uint8)
            self._bcast(torch.from_numpy(out))
            return out
        return self._bcast(torch.empty(nbytes, dtype=torch.uint8, device=self._device)).cpu().numpy()

    # ---- sender ------------------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Pack and broadcast every tensor; blocks until the receivers have taken every bucket."""
        check_role(self.name, self.role, "sender")
        version = check_version(self.name, version)
        self._connect()
        self.stats = stats = ProtocolStats(protocol=self.name, version=version)
        with Timer(stats):
            buckets = self._packer.pack(named_tensors, stats)
            source = _Prefetch(buckets) if self.overlap else None
            try:
                for bucket in source if source is not None else buckets:
                    sent = self.tamper(bucket) if self.tamper else bucket
                    try:
                        stats.wire_bytes += self._send_frame(BUCKET, version, sent.index, _meta_of(sent), sent.data)
                    finally:
                        self._packer.release(bucket)  # its buffer packs a later bucket
            except WeightSyncError:
                if self._broken:  # the wire itself failed: nobody can be told
                    raise
                self._abort(version, stats)
                raise
            except Exception as error:
                self._abort(version, stats, error)
                raise
            finally:
                if source is not None:
                    source.close()
            stats.wire_bytes += self._send_frame(END, version, -1, b"", None)
        self.version = version
        return stats

    def _abort(self, version: int, stats: ProtocolStats, error: BaseException | None = None) -> None:
        """Tell the receivers this sync will not complete, so they raise instead of waiting."""
        import sys

        error = error or sys.exc_info()[1]
        message = f"{type(error).__name__}: {error}".encode()[:4096]
        stats.wire_bytes += self._send_frame(ABORT, version, -1, message, None)

    def handoff(self) -> None:
        """Nothing: the weights travel over the group, not through the driver."""
        check_role(self.name, self.role, "sender")
        return None

    # ---- receiver ----------------------------------------------------------------------------
    def receive(self, handoff: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the next sync's verified tensors (CPU); run it while the sender runs :meth:`send`.

        The iterator always takes every frame of the sync off the wire, even when it
        raises (corrupted bucket) or is abandoned, so the group stays in step for the
        next sync. The tensors are views of receive buffers that the next ``receive()``
        reuses: load (copy) them before the next sync, as ``update_weights`` does.
        """
        check_role(self.name, self.role, "receiver")
        return self._receive()

    def _frames(self, stats: ProtocolStats) -> Iterator[_Frame]:
        while True:
            try:
                frame, wire = self._recv_frame()
            except Exception as error:  # the rest of this sync is still on the wire: the group is out of step
                self._broken = self._broken or f"rank {self.rank} stopped receiving: {type(error).__name__}: {error}"
                raise
            stats.wire_bytes += wire
            yield frame
            if frame.kind != BUCKET:
                return

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._connect()
        self._pool.new_sync()
        self.stats = stats = ProtocolStats(protocol=self.name)
        with Timer(stats):
            frames = self._frames(stats)
            source = _Prefetch(frames) if self.overlap else frames
            finished = False
            try:
                for frame in source:
                    stats.version = frame.version
                    if frame.kind == END:
                        finished = True
                        break
                    if frame.kind == ABORT:
                        finished = True
                        raise WeightSyncError(f"broadcast: the sender aborted version {frame.version}: "
                                              f"{frame.payload}; hint: fix the sender's error, the receiver kept "
                                              "its old weights only if it had not loaded any tensor yet")
                    if isinstance(frame.payload, WeightSyncError):
                        raise frame.payload
                    pairs = unpack_bucket(frame.payload, stats)  # WeightSyncError names the bad tensor
                    stats.buckets += 1
                    stats.tensors += len(pairs)
                    stats.bytes += int(frame.payload.data.nbytes)
                    yield from pairs
            finally:
                if not finished and not self._broken:
                    for frame in source:  # drain: take the rest of this sync off the wire
                        if frame.kind != BUCKET:
                            break
                if isinstance(source, _Prefetch):
                    source.close()
        self.version = stats.version


def _meta_of(bucket: Bucket) -> bytes:
    """The bucket's metadata as JSON bytes (no pickle: a receiver must not execute what it is sent)."""
    return json.dumps({"checksum": bucket.checksum, "tensors": [list(m) for m in bucket.tensors]}).encode()


def _bucket_from(index: int, meta: np.ndarray, data: np.ndarray) -> Bucket | WeightSyncError:
    """Rebuild a :class:`Bucket` from a frame; :func:`unpack_bucket` then verifies it.

    Unreadable metadata yields the error instead of raising it, so the frame reader
    keeps taking this sync off the wire and the consumer raises it.
    """
    try:
        parsed = json.loads(bytes(meta).decode())
        tensors = tuple(TensorMeta(n, d, tuple(s), int(o), int(b), int(c)) for n, d, s, o, b, c in parsed["tensors"])
        checksum = int(parsed["checksum"])
    except (ValueError, KeyError, TypeError) as error:
        return WeightSyncError(f"broadcast: metadata of bucket {index} is unreadable ({error}); "
                               "hint: the metadata frame was damaged in transit")
    return Bucket(index, data, tensors, checksum)
