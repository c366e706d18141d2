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
device of the wire buffers differs. Over gloo, frames are host memory checksummed with
CRC-32 (the bucket format of :mod:`flowrl.runtime.weight_sync`); over NCCL they are packed,
checksummed and verified on the GPU (:mod:`~flowrl.runtime.sync.device_frames`: word sums,
as ``cuda_ipc``'s), so GPU weights never pass through host memory (``frames`` chooses).

Rendezvous: the sender opens the store on ``port`` (0 = any free port, race-free)
and exposes ``sender.rendezvous``; the driver passes that record to each receiver.
The group itself forms lazily at the first :meth:`~BroadcastSync.send` /
:meth:`~BroadcastSync.receive`, which all ranks enter together anyway.

Wire format: a sync opens with a header ``int64[4] = (START, version, buckets, layout
bytes)`` and the layout (JSON: each bucket's data bytes and each tensor's name, dtype,
shape, offset, bytes; known from shapes alone, before any byte is packed). Then each
bucket is **one** message of exactly the size the layout announced: its data followed by
a trailer ``int64[5 + tensors] = (BUCKET, version, index, bucket CRC, 0, tensor CRCs...)``.
One message per bucket instead of header + metadata + data: on a machine whose cores the
wire already keeps busy, every extra round trip waited for a core (measured: 3 ms per
bucket on 2 cores). Each end keeps the next bucket's message on the wire while it waits for
one (:data:`IN_FLIGHT`). If packing fails before the layout is sent, the header is ``(ABORT,
version, 0, message bytes)`` followed by the sender's error; if it fails later, the next
bucket's message carries an ``ABORT`` trailer whose fifth field is the length of the
error message, which travels in the messages receivers already posted (at their announced
sizes) or, after the last bucket, in one of its own: receivers never wait for buckets that
will not come. (Device frames, over NCCL: the same with word sums,
:mod:`~flowrl.runtime.sync.device_frames`.)

Homed weights: :meth:`BroadcastSync.home` lays a CPU trainer's weights out as the frames
(:class:`~flowrl.runtime.weight_sync.WeightHome`); the trainer's parameters then live there and
each frame is checksummed and sent from that memory, with no copy (the trailer's room is kept
after each bucket).

Overlap: with ``overlap=True`` a background thread packs bucket i+1 (copy + CRC,
both release the GIL) while bucket i is on the wire, and on the receiver a thread
receives bucket i+1 while bucket i is verified and loaded. Buffers are reused
(:mod:`flowrl.runtime.sync.packing`): the sender keeps about four buckets (one packing, one
queued, two on the wire), a receiver one model's worth, between syncs.
"""

from __future__ import annotations

import datetime
import json
import re
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from flowrl.runtime.sync import device_frames
from flowrl.runtime.sync.base import NamedTensors, ProtocolStats, Timer, check_role, check_version
from flowrl.runtime.sync.packing import BucketPacker, BufferPool
from flowrl.runtime.weight_sync import Bucket, PlannedBucket, TensorMeta, TransportBroken, WeightHome, \
    WeightSyncError, plan_buckets, unpack_bucket

START, BUCKET, ABORT = 1, 2, 3
"""Kinds in the first field of the sync header (START, ABORT) and of a bucket trailer (BUCKET, ABORT)."""

HEADER_LEN = 4
"""int64 fields of the sync header: kind, version, buckets, layout (or error message) bytes."""

TRAILER_LEN = 5
"""int64 fields of a bucket trailer before the tensor CRCs: kind, version, index, bucket CRC, message bytes."""


def trailer_bytes(tensors: int) -> int:
    """Bytes of the trailer after a bucket of ``tensors`` tensors."""
    return 8 * (TRAILER_LEN + tensors)


@dataclass(frozen=True)
class Rendezvous:
    """Where the receivers find the sender's store; plain data the driver passes to rollout actors."""

    host: str
    """Address of the sender's node, reachable from every receiver (e.g. ``ray.util.get_node_ip_address()``)."""
    port: int
    """TCP port of the sender's store."""
    world_size: int
    """1 sender + the number of receivers."""


FRAMES = ("auto", "host", "device")
"""Where a broadcast's frames are packed and verified (see :class:`BroadcastSync`'s ``frames``)."""

IN_FLIGHT = 1
"""Frames each rank keeps on the wire beyond the one it waits for. Waiting for each frame before
starting the next left the wire idle between frames while the receiver drained the socket and
told the sender it was ready (gloo; measured here: 258 MB in 32 MB frames took 77-94 ms one at a
time, 66-70 ms with one more in flight, against 67 ms as one message)."""


class _Posted(NamedTuple):
    """A receive on the wire: its work, and where the bytes land."""

    work: Any
    host: np.ndarray | None
    """The bytes in host memory (a CPU wire), else None."""
    wire: torch.Tensor
    """The bytes as the wire's tensor (on the wire's device)."""


class _Frame(NamedTuple):
    kind: int
    version: int
    payload: Any
    """A :class:`Bucket` (BUCKET) or the sender's error message (ABORT)."""


def default_backend() -> str:
    """``"nccl"`` when CUDA and NCCL are available, else ``"gloo"``."""
    return dist.Backend.NCCL if torch.cuda.is_available() and dist.is_nccl_available() else dist.Backend.GLOO


def _gloo_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta):
    return dist.ProcessGroupGloo(store, rank, world, timeout), torch.device("cpu")


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return dist.ProcessGroupNCCL(store, rank, world, options), device


BACKENDS: dict[str, Callable] = {dist.Backend.GLOO: _gloo_group, dist.Backend.NCCL: _nccl_group}

DEVICE_WIRE: dict[str, bool] = {dist.Backend.GLOO: False, dist.Backend.NCCL: True}
"""Backend -> whether its wire is the accelerator's memory (then ``frames="auto"`` means device frames)."""
"""Backend name -> ``(store, rank, world, timeout) -> (process group backend, wire device)``."""


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ")
"""gloo's and c10d's ``[/path/to/pair.cc:537] `` before their messages."""


def transport_reason(error: BaseException) -> str:
    """A transport error's own words, in one line: its first line without the C++ source location and
    gloo's advice after the reason.

    >>> transport_reason(RuntimeError("[/w/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    ...                               "[127.0.0.1]:3298. This is typically caused by a remote worker crashing."))
    'Connection closed by peer [127.0.0.1]:3298'
    """
    lines = str(error).strip().splitlines()
    text = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(error).__name__
    return text.split(". This is typically caused", 1)[0].rstrip(".") or type(error).__name__


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
                 tamper: Callable[[Bucket], Bucket] | None = None, frames: str = "auto"):
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
            frames: ``"host"`` (CRC-32s, packed in host memory), ``"device"`` (packed and verified on the
                wire's device, :mod:`~flowrl.runtime.sync.device_frames`) or ``"auto"``: device frames
                over NCCL, host frames over gloo. All ranks must agree.
        """
        check_role(self.name, role, None)
        self.role = role
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise WeightSyncError(f"broadcast: backend={self.backend!r}; hint: use one of {sorted(BACKENDS)}")
        if self.backend == dist.Backend.NCCL and default_backend() != dist.Backend.NCCL:
            raise WeightSyncError("broadcast: backend='nccl' needs CUDA and a torch build with NCCL, this process "
                                  "has neither; hint: use backend='gloo' (protocol `gloo`) on CPU")
        if frames not in FRAMES:
            raise WeightSyncError(f"broadcast: frames={frames!r}; hint: one of {', '.join(FRAMES)}")
        self.on_device = frames == "device" or (frames == "auto" and DEVICE_WIRE[self.backend])
        """Whether frames are packed, sent and verified on the wire's device (else in host memory)."""
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
            raise TransportBroken(f"broadcast: the group is unusable on rank {self.rank} ({self._broken}); hint: "
                                  "close() every rank and set up a new rendezvous")
        if self._group is None:
            store = dist.PrefixStore("flowrl-weight-sync", self._store)
            try:
                self._group, self._device = BACKENDS[self.backend](store, self.rank, self.rendezvous.world_size,
                                                                   self.timeout)
            except RuntimeError as error:  # a rank never joined (dead or unreachable): DistStoreError, a timeout
                self._broken = f"the group did not form: {transport_reason(error)}"
                raise TransportBroken(f"broadcast: rank {self.rank}: {self._broken}; hint: every rank must reach the "
                                      "sender's store and each other within the timeout") from None

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
        self._wait(self._post(tensor))
        return tensor

    def _post(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 (in place); :meth:`_wait` for the returned work."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            return self._group.broadcast([tensor], options)
        except RuntimeError as error:
            self._fail(error)

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            self._fail(error)

    def _fail(self, error: RuntimeError) -> None:
        self._broken = f"broadcast failed: {transport_reason(error)}"
        raise TransportBroken(f"broadcast: transport failed on rank {self.rank}: {self._broken}; hint: a peer "
                              "died or timed out; close() every rank and set up a new rendezvous") from None

    @property
    def wire_device(self) -> torch.device:
        """Where the group's messages live (the CPU for gloo, this process's GPU for NCCL); known once
        the group formed (the first send or receive)."""
        return self._device

    def _post_blob(self, blob: np.ndarray) -> tuple[Any, torch.Tensor]:
        """Start sending ``blob``; returns (work, the tensor on the wire, kept alive until the work is done)."""
        tensor = torch.from_numpy(blob)
        tensor = tensor.to(self._device, non_blocking=True) if self._device.type != "cpu" else tensor
        return self._post(tensor), tensor

    def _send_ints(self, fields: list[int]) -> int:
        self._bcast(torch.tensor(fields, dtype=torch.int64, device=self._device))
        return 8 * len(fields)

    def _send_blob(self, blob: np.ndarray) -> int:
        self._wait(self._post_blob(blob)[0])
        return int(blob.nbytes)

    def _recv_blob(self, nbytes: int, pooled: bool = False) -> np.ndarray:
        return self._take(self._post_recv(nbytes, pooled))

    def _post_recv(self, nbytes: int, pooled: bool = False) -> "_Posted":
        """Start receiving a message of ``nbytes``; :meth:`_take` its bytes."""
        if self._device.type == "cpu":
            # Straight into numpy memory (no copy); bucket frames into pooled buffers, already
            # touched: fresh ones page-fault on every 4 KiB page, slower than the wire.
            out = self._pool.take(nbytes) if pooled else np.empty(nbytes, dtype=np.uint8)
            wire = torch.from_numpy(out)
            return _Posted(self._post(wire), out, wire)
        wire = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return _Posted(self._post(wire), None, wire)

    def _take(self, posted: "_Posted") -> np.ndarray:
        """A received message's bytes in host memory."""
        self._wait(posted.work)
        return posted.host if posted.host is not None else posted.wire.cpu().numpy()

    def _take_frame(self, posted: "_Posted") -> np.ndarray | torch.Tensor:
        """A received bucket frame: on the wire's device for device frames, else in host memory."""
        if self.on_device:
            self._wait(posted.work)
            return posted.wire
        return self._take(posted)

    def _room(self, nbytes: int) -> int:
        """Bytes a frame keeps for ``nbytes`` of bucket data (the trailer follows)."""
        return device_frames.data_room(nbytes) if self.on_device else nbytes

    def _trailer_bytes(self, tensors: int) -> int:
        return device_frames.trailer_bytes(tensors) if self.on_device else trailer_bytes(tensors)

    def _frame_bytes(self, planned: PlannedBucket) -> int:
        """Bytes of a bucket's message: data room and trailer."""
        return self._room(planned.nbytes) + self._trailer_bytes(len(planned.tensors))

    # ---- sender ------------------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Pack and broadcast every tensor; blocks until the receivers have taken every bucket."""
        check_role(self.name, self.role, "sender")
        version = check_version(self.name, version)
        self._connect()
        self.stats = stats = ProtocolStats(protocol=self.name, version=version)
        with Timer(stats):
            try:
                planned = list(plan_buckets(named_tensors, self.bucket_bytes))  # shapes only: nothing is read yet
            except Exception as error:
                stats.wire_bytes += self._abort_header(version, error)
                raise
            filled = (device_frames.pack(p, self._device, stats) if self.on_device
                      else self._packer.fill(p, stats, trailer_bytes(len(p.tensors))) for p in planned)
            source = _Prefetch(filled) if self.overlap else None  # bucket i+1 is packed while i is on the wire
            sent = 0
            flight: list[tuple] = []  # (work, wire tensor, bucket) of each frame on the wire, oldest first
            try:
                layout = _layout_of(planned)
                stats.wire_bytes += self._send_ints([START, version, len(planned), len(layout)])
                stats.wire_bytes += self._send_blob(np.frombuffer(bytearray(layout), np.uint8))
                for bucket in source if source is not None else filled:
                    try:
                        frame = self._frame(bucket, version)
                        work, wire = self._post_blob(frame) if isinstance(frame, np.ndarray) else \
                            (self._post(frame), frame)
                    except Exception:
                        self._release(bucket)
                        raise
                    flight.append((work, wire, bucket))
                    stats.wire_bytes += int(frame.nbytes)
                    sent += 1
                    if len(flight) > IN_FLIGHT:
                        self._land(flight.pop(0))
                while flight:
                    self._land(flight.pop(0))
            except Exception as error:
                self._settle(flight)
                if not self._broken and sent < len(planned):  # else the wire itself failed: nobody can be told
                    stats.wire_bytes += self._abort_bucket(planned, sent, version, error)
                raise
            finally:
                if source is not None:
                    source.close()
        self.version = version
        return stats

    def _land(self, flying: tuple) -> None:
        """Wait until a frame is sent, then give its buffer back to the packer."""
        try:
            self._wait(flying[0])
        finally:
            self._release(flying[2])  # its buffer packs a later bucket

    def _release(self, bucket: Bucket | device_frames.DeviceBucket) -> None:
        if isinstance(bucket, Bucket):  # a device frame is simply dropped
            self._packer.release(bucket)

    def _settle(self, flight: list[tuple]) -> None:
        """After an error: let the frames already on the wire finish (a broken wire ends them too)."""
        while flight:
            try:
                self._land(flight.pop(0))
            except TransportBroken:
                pass

    def _frame(self, bucket: Bucket | device_frames.DeviceBucket, version: int) -> np.ndarray | torch.Tensor:
        """``bucket``'s data and trailer, one contiguous buffer (the packer reserved the trailer's room)."""
        if isinstance(bucket, device_frames.DeviceBucket):
            return self._device_frame(bucket, version)
        sent = self.tamper(bucket) if self.tamper else bucket
        tail = trailer_bytes(len(sent.tensors))
        frame = self._packer.frame(bucket, tail)
        if sent.data is not bucket.data:  # a tamper hook replaced the data (tests)
            if sent.data.shape != bucket.data.shape or len(sent.tensors) != len(bucket.tensors):
                raise WeightSyncError(f"broadcast: the tamper hook changed bucket {bucket.index}'s size; "
                                      "hint: flip bytes, keep the length and the tensors")
            frame = np.empty_like(frame)  # never in the packer's buffer: that may be the trainer's weights
            frame[: bucket.data.nbytes] = sent.data
        trailer = [BUCKET, version, sent.index, sent.checksum, 0] + [m.checksum for m in sent.tensors]
        frame[bucket.data.nbytes:] = np.array(trailer, np.int64).view(np.uint8)
        return frame

    def home(self, named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
        """Lay the sender's CPU weights out as this sync's frames (:class:`WeightHome`) and return each
        weight's tensor there: a trainer whose parameters become these tensors is sent without a copy.

        Call again to re-home (a new layout replaces the old one). Weights off the CPU, and any
        weights of a sync with device frames, are not homed (``{}``).
        """
        check_role(self.name, self.role, "sender")
        named_tensors = list(named_tensors)
        if self.on_device or not named_tensors or any(t.device.type != "cpu" for _, t in named_tensors):
            self._packer.home = None
            return {}
        self._packer.home = WeightHome(named_tensors, self.bucket_bytes, trailer_bytes)
        return dict(self._packer.home.views)

    def _device_frame(self, bucket: device_frames.DeviceBucket, version: int) -> torch.Tensor:
        """A device bucket's frame with its trailer; a tamper hook (tests) sees and damages a host copy."""
        if self.tamper:
            host = device_frames.as_host_bucket(bucket)
            sent = self.tamper(host)
            if sent.data is not host.data:
                if sent.data.shape != host.data.shape:
                    raise WeightSyncError(f"broadcast: the tamper hook changed bucket {bucket.index}'s size; "
                                          "hint: flip bytes, keep the length and the tensors")
                bucket = device_frames.with_data(bucket, sent.data)
        return device_frames.write_trailer(bucket, BUCKET, version)

    @staticmethod
    def _message(error: BaseException) -> bytes:
        """The sender's error as the text receivers raise (never empty, at most 4 KiB)."""
        return f"{type(error).__name__}: {error}".encode()[:4096]

    def _abort_header(self, version: int, error: BaseException) -> int:
        """Packing failed before the layout went out: the header itself says ABORT, then the message."""
        message = self._message(error)
        return (self._send_ints([ABORT, version, 0, len(message)])
                + self._send_blob(np.frombuffer(bytearray(message), np.uint8)))

    def _abort_bucket(self, planned: list[PlannedBucket], index: int, version: int, error: BaseException) -> int:
        """Packing failed after the layout went out: bucket ``index``'s message (its announced size)
        carries an ABORT trailer, then the error message follows, so receivers raise instead of waiting.

        A receiver has already posted the receives of the :data:`IN_FLIGHT` frames after it, so
        those messages go out at their announced sizes, the first carrying the error message (cut
        to it); after the last frame, the message goes in one of its own length.
        """
        message = self._message(error)
        frame = np.zeros(self._frame_bytes(planned[index]), np.uint8)
        room = self._room(planned[index].nbytes)
        head = np.array([ABORT, version, index, 0, len(message)], np.int64)
        frame[room: room + head.nbytes] = head.view(np.uint8)
        carriers = [np.zeros(self._frame_bytes(p), np.uint8) for p in planned[index + 1: index + 1 + IN_FLIGHT]]
        if carriers:
            text = message[: carriers[0].nbytes]
            carriers[0][: len(text)] = np.frombuffer(text, np.uint8)
        else:
            carriers = [np.frombuffer(bytearray(message), np.uint8)]
        return self._send_blob(frame) + sum(self._send_blob(c) for c in carriers)

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
        """The sync's frames: its buckets in order, or an ABORT frame (then nothing more)."""
        try:
            yield from self._read_sync(stats)
        except Exception as error:  # the rest of this sync is still on the wire: the group is out of step
            self._broken = self._broken or f"rank {self.rank} stopped receiving: {type(error).__name__}: {error}"
            raise

    def _read_sync(self, stats: ProtocolStats) -> Iterator[_Frame]:
        header = self._recv_ints(HEADER_LEN, stats)
        kind, version, buckets, nbytes = header
        stats.version = version
        if kind == ABORT:
            yield _Frame(ABORT, version, self._recv_text(nbytes, stats))
            return
        if kind != START:
            raise WeightSyncError(f"broadcast: rank {self.rank} got a sync header of unknown kind {kind} (header "
                                  f"{header}); hint: every rank must run the same flowrl version")
        layout = _layout_from(self._recv_blob(nbytes), buckets)
        stats.wire_bytes += nbytes
        sizes = [self._room(data_bytes) + self._trailer_bytes(len(metas)) for data_bytes, metas in layout]
        posted = [self._post_recv(size, pooled=True) for size in sizes[:IN_FLIGHT]]
        for index, (data_bytes, metas) in enumerate(layout):
            if index + IN_FLIGHT < len(sizes):  # the next frame's receive is posted before this one is waited for
                posted.append(self._post_recv(sizes[index + IN_FLIGHT], pooled=True))
            frame = self._take_frame(posted.pop(0))
            stats.wire_bytes += frame.nbytes
            trailer = device_frames.trailer_of(frame, data_bytes) if self.on_device else \
                np.frombuffer(frame[data_bytes:].tobytes(), np.int64).tolist()
            kind, sent_version, sent_index, checksum, message_bytes = trailer[:TRAILER_LEN]
            if kind == ABORT:  # the message comes in the frames already posted, or on its own after the last
                carried = [self._take(p) for p in posted]
                text = bytes(carried[0][:message_bytes]) if carried else \
                    bytes(self._recv_blob(message_bytes)) if message_bytes else b""
                stats.wire_bytes += sum(c.nbytes for c in carried) if carried else message_bytes
                yield _Frame(ABORT, version, text.decode(errors="replace"))
                return
            if kind != BUCKET or sent_version != version or sent_index != index:
                raise WeightSyncError(f"broadcast: rank {self.rank} expected bucket {index} of version {version}, "
                                      f"got trailer {trailer[:TRAILER_LEN]}; hint: the ranks are out of step, "
                                      "close() every rank and set up a new rendezvous")
            if self.on_device:
                yield _Frame(BUCKET, version, device_frames.received(frame, metas, trailer))
                continue
            tensors = tuple(m._replace(checksum=c) for m, c in zip(metas, trailer[TRAILER_LEN:]))
            yield _Frame(BUCKET, version, Bucket(index, frame[:data_bytes], tensors, checksum))

    @staticmethod
    def _unpack(payload: Bucket | device_frames.DeviceBucket, stats: ProtocolStats) -> list[tuple[str, torch.Tensor]]:
        if isinstance(payload, device_frames.DeviceBucket):
            return device_frames.unpack(payload, stats)
        return unpack_bucket(payload, stats)

    def _recv_ints(self, count: int, stats: ProtocolStats) -> list[int]:
        stats.wire_bytes += 8 * count
        return self._bcast(torch.empty(count, dtype=torch.int64, device=self._device)).tolist()

    def _recv_text(self, nbytes: int, stats: ProtocolStats) -> str:
        stats.wire_bytes += nbytes
        return bytes(self._recv_blob(nbytes)).decode(errors="replace") if nbytes else ""

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
                    if frame.kind == ABORT:
                        finished = True
                        raise WeightSyncError(f"broadcast: the sender aborted version {frame.version}: "
                                              f"{frame.payload}; hint: fix the sender's error, the receiver kept "
                                              "its old weights only if it had not loaded any tensor yet")
                    pairs = self._unpack(frame.payload, stats)  # WeightSyncError names the bad tensor
                    stats.buckets += 1
                    stats.tensors += len(pairs)
                    stats.bytes += device_frames.data_bytes(frame.payload.tensors)  # padding included
                    yield from pairs
                finished = True
            finally:
                if not finished and not self._broken:
                    for frame in source:  # drain: take the rest of this sync off the wire
                        if frame.kind != BUCKET:
                            break
                if isinstance(source, _Prefetch):
                    source.close()
        self.version = stats.version


def _layout_of(planned: list[PlannedBucket]) -> bytes:
    """The sync's layout as JSON bytes (no pickle: a receiver must not execute what it is sent)."""
    return json.dumps([[p.nbytes, [list(m[:5]) for m in p.tensors]] for p in planned]).encode()


def _layout_from(blob: np.ndarray, buckets: int) -> list[tuple[int, tuple[TensorMeta, ...]]]:
    """Parse :func:`_layout_of`'s bytes: ``(data bytes, tensors without CRCs)`` per bucket.

    Unreadable: the receiver cannot know the sizes of the messages still coming, so
    the group is out of step and the error is raised (and the group marked broken).
    """
    try:
        parsed = json.loads(bytes(blob).decode())
        layout = [(int(n), tuple(TensorMeta(name, d, tuple(shape), int(o), int(b), 0)
                                 for name, d, shape, o, b in tensors)) for n, tensors in parsed]
    except (ValueError, TypeError) as error:
        raise WeightSyncError(f"broadcast: the sync's layout is unreadable ({error}); hint: the layout message "
                              "was damaged in transit; close() every rank and set up a new rendezvous") from None
    if len(layout) != buckets:
        raise WeightSyncError(f"broadcast: the layout lists {len(layout)} buckets, the header {buckets}; "
                              "hint: the layout message was damaged in transit")
    return layout
