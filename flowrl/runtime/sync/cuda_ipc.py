"""``cuda_ipc``: the trainer's weights shared with a colocated rollout engine through CUDA IPC handles.

The way veRL's and NeMo-RL's colocated weight updates (and vLLM's own ``ipc`` weight-transfer
engine) do it: the sender packs its weights into a few device buffers, exports each buffer with
``torch.multiprocessing.reductions.reduce_tensor`` (a ``cudaIpcMemHandle`` and the arguments of
``rebuild_cuda_tensor``), and hands those small records over; each receiver, another process on
the same GPU, maps the buffer into its own address space (``rebuild_cuda_tensor``) and copies
its tensors out. No weight byte crosses host memory or a socket.

    sender = CudaIpcSync("sender", bucket_bytes=256 << 20)   # train worker (GPU tensors)
    stats = sender.send(engine.named_weights(), version=3)
    handoff = sender.handoff()                                # -> driver -> every receiver
    receiver = CudaIpcSync("receiver")                        # rollout worker, same GPU
    engine.update_weights(receiver.receive(handoff))          # raises WeightSyncError on corruption

Handles are keyed by the GPU's UUID, as vLLM keys them: a Ray actor sees its GPU as device 0
whatever its index on the node, so the receiver finds the sender's GPU by UUID and rebuilds
the buffer on its own index for it. A receiver on another GPU finds no handle and says so.

Verification: CRC-32 runs on host bytes, which would bring every weight back to the host. The
checksum here is computed where the bytes are, on the GPU: for a tensor's bytes read as int32
words ``w_0 .. w_{n-1}`` (tensors are packed at 64-byte offsets, the last word zero-padded),
``(sum w_i, sum (i + 1) w_i)`` in int64 arithmetic modulo 2^64. Addition modulo 2^64 is
associative, so the GPU's reduction order gives exactly the CPU's value (:func:`word_checksum`
runs on either); a flipped bit changes the first sum, two swapped words the second. The
sender sums each tensor after packing it, the receiver the same bytes in the shared buffer
before loading anything, and a mismatch names the tensor (:class:`CorruptedWeights`).

Lifetime: a handle does not keep the sender's memory alive; the sender holds its buffers (one
packed copy of the weights on its GPU) until :meth:`~CudaIpcSync.release`, which the train worker
calls when it offloads for the colocated rollout engine's turn (every receiver has loaded by then:
the driver's resync waits for them), or the next :meth:`~CudaIpcSync.send` or
:meth:`~CudaIpcSync.close`. Receivers copy their tensors out (``clone``) before returning them.

On a CPU machine the same class shares host buffers by shared-memory file handles
(``UntypedStorage._share_filename_cpu_``, what ``torch.multiprocessing`` uses with its
``file_system`` strategy): the packing, the checksums and the fault paths are tested across
processes there (``tests/runtime/test_cuda_ipc_sync.py``); the catalogue offers ``cuda_ipc`` on
CUDA only (colocated engines on CPU use ``inplace``).
"""

from __future__ import annotations

import time
from typing import ClassVar, Iterator, NamedTuple

import torch

from flowrl.runtime.sync.base import NamedTensors, ProtocolStats, check_role, check_version
from flowrl.runtime.weight_sync import ALIGN, DTYPES, CorruptedWeights, LostWeights, WeightSyncError, dtype_name_of

CHUNK_WORDS = 1 << 24
"""int32 words summed per kernel (64 MiB of bytes): bounds the int64 temporaries to 256 MiB."""


def word_checksum(data: torch.Tensor) -> tuple[int, int]:
    """``(sum w_i, sum (i + 1) w_i)`` mod 2^64 (as signed int64) of ``data``'s int32 words.

    Args:
        data: ``[nbytes]`` uint8 on any device, ``nbytes`` a multiple of 4.

    >>> word_checksum(torch.tensor([1, 0, 0, 0, 2, 0, 0, 0], dtype=torch.uint8))
    (3, 5)
    """
    words = data.view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=data.device)
    s2 = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        w = words[start:start + CHUNK_WORDS].to(torch.int64)
        idx = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=data.device)
        s1 += w.sum()
        s2 += (w * idx).sum()
    return int(s1), int(s2)


class IpcTensor(NamedTuple):
    """Where one tensor lives in a shared buffer, and its checksum."""

    name: str
    dtype: str
    """Key of :data:`~flowrl.runtime.weight_sync.DTYPES`."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer (a multiple of :data:`~flowrl.runtime.weight_sync.ALIGN`)."""
    nbytes: int
    checksum: tuple[int, int]
    """:func:`word_checksum` of the tensor's bytes (zero-padded to whole words)."""


class IpcBucket(NamedTuple):
    """One shared buffer: its handle and what it holds (plain picklable data)."""

    index: int
    handle: tuple
    """``("cuda", {gpu uuid: rebuild_cuda_tensor args})`` or ``("cpu", (manager, name, bytes))``."""
    nbytes: int
    tensors: tuple[IpcTensor, ...]


class IpcHandoff(NamedTuple):
    """What the driver forwards from the sender to every receiver."""

    version: int
    buckets: list[IpcBucket]
    count: int
    """Buckets sent: a receiver that finds fewer (or others) loads nothing (``LostWeights``)."""


def word_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to whole int32 words."""
    return -(-nbytes // 4) * 4


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _export_cuda(buf: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(buf)
    uuid = str(torch.cuda.get_device_properties(buf.device).uuid)
    return ("cuda", {uuid: tuple(args)})


def _import_cuda(handle) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    if uuid not in handle:
        raise WeightSyncError(f"cuda_ipc: the sender's buffer is on GPU {', '.join(handle)}, not on this process's GPU "
                              f"({uuid}); hint: CUDA IPC reaches engines on the trainer's GPUs (colocated): use "
                              "`nccl` between separate GPUs")
    args = list(handle[uuid])
    args[6] = index  # storage_device: the receiver's index for that GPU (vLLM's ipc engine does the same)
    return rebuild_cuda_tensor(*args)


def _export_cpu(buf: torch.Tensor) -> tuple:
    return ("cpu", tuple(buf.untyped_storage()._share_filename_cpu_()))


def _import_cpu(handle) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_filename_cpu(*handle)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


SHARING: dict[str, tuple] = {"cuda": (_export_cuda, _import_cuda), "cpu": (_export_cpu, _import_cpu)}
"""Device type of the buffers -> (export a buffer as a handle, map a handle in this process)."""


class CudaIpcSync:
    """Sender packs device buffers and exports their handles; receivers map, verify and copy out
    (see the module docstring)."""

    name: ClassVar[str] = "cuda_ipc"
    collective: ClassVar[bool] = False

    def __init__(self, role: str, *, bucket_bytes: int = 256 << 20, device: str | None = None):
        """Args:
            role: ``"sender"`` (train worker) or ``"receiver"`` (rollout worker).
            bucket_bytes: largest buffer, bytes (the plan's ``bucket``; a larger tensor gets one of its own).
            device: where the sender's buffers live (default: this process's GPU, else ``cpu``).
        """
        check_role(self.name, role)
        self.role = role
        self.bucket_bytes = int(bucket_bytes)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type not in SHARING:
            raise WeightSyncError(f"cuda_ipc: cannot share buffers on {self.device.type}; hint: devices: "
                                  f"{', '.join(SHARING)}")
        self.stats = ProtocolStats(protocol=self.name)
        self.version = -1
        self._held: list[torch.Tensor] = []
        self._outbox: IpcHandoff | None = None

    # ---- sender ----------------------------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Pack every tensor into shared buffers of at most ``bucket_bytes``; :meth:`handoff` returns their handles."""
        check_role(self.name, self.role, "sender")
        version = check_version(self.name, version)
        self.stats = stats = ProtocolStats(protocol=self.name, version=version)
        t0 = time.perf_counter()
        self._held = []  # the previous sync's buffers: every receiver has loaded them by now
        export = SHARING[self.device.type][0]
        buckets = []
        for group in self._groups(named_tensors):
            buckets.append(self._pack(len(buckets), group, export, stats))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are done before any receiver reads
        stats.buckets, stats.wire_bytes = len(buckets), sum(b.nbytes for b in buckets)
        stats.seconds = time.perf_counter() - t0
        self._outbox = IpcHandoff(version, buckets, len(buckets))
        self.version = version
        return stats

    def _groups(self, named_tensors: NamedTensors) -> Iterator[list[tuple[str, torch.Tensor, str, int]]]:
        """``(name, tensor, dtype name, offset)`` groups that fill one buffer each."""
        group, used = [], 0
        for name, tensor in named_tensors:
            dtype = dtype_name_of(name, tensor)
            size = _aligned(tensor.numel() * tensor.element_size())
            if group and used + size > self.bucket_bytes:
                yield group
                group, used = [], 0
            group.append((name, tensor, dtype, used))
            used += size
        if group:
            yield group

    def _pack(self, index: int, group: list, export, stats: ProtocolStats) -> IpcBucket:
        name, tensor, _d, offset = group[-1]
        total = _aligned(offset + tensor.numel() * tensor.element_size())
        buf = torch.zeros(total, dtype=torch.uint8, device=self.device)
        handle = export(buf)  # before filling: on CPU the storage moves into shared memory here
        metas = []
        for name, tensor, dtype, offset in group:
            flat = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
            buf[offset:offset + flat.numel()].copy_(flat)
            metas.append(IpcTensor(name, dtype, tuple(tensor.shape), offset, flat.numel(),
                                   word_checksum(buf[offset:offset + word_bytes(flat.numel())])))
            stats.tensors += 1
            stats.bytes += flat.numel()
            stats.copied_bytes += flat.numel()
        self._held.append(buf)
        return IpcBucket(index, handle, total, tuple(metas))

    def handoff(self) -> IpcHandoff:
        """The handles of the last :meth:`send` (handed out once; the buffers stay held until the next send)."""
        check_role(self.name, self.role, "sender")
        if self._outbox is None:
            raise WeightSyncError("cuda_ipc: handoff() before send(); hint: call send(named_tensors, version) first")
        out, self._outbox = self._outbox, None
        return out

    # ---- receiver --------------------------------------------------------------------------------------
    def receive(self, handoff: IpcHandoff | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Map each buffer of ``handoff``, verify every tensor's checksum, yield copies on this process's device."""
        check_role(self.name, self.role, "receiver")
        if not isinstance(handoff, IpcHandoff):
            raise WeightSyncError(f"cuda_ipc: receive() got {type(handoff).__name__}, expected the sender's "
                                  "IpcHandoff; hint: forward sender.handoff() to every receiver")
        return self._receive(handoff)

    def _receive(self, handoff: IpcHandoff) -> Iterator[tuple[str, torch.Tensor]]:
        self.stats = stats = ProtocolStats(protocol=self.name, version=handoff.version)
        got = [b.index for b in handoff.buckets]
        if got != list(range(handoff.count)):
            missing = sorted(set(range(handoff.count)) - set(got))
            raise LostWeights(f"cuda_ipc: buffer(s) {', '.join(map(str, missing)) or '?'} of the {handoff.count} "
                              f"shared for version {handoff.version} never arrived (got {got}); hint: resend the sync")
        t0 = time.perf_counter()
        for bucket in handoff.buckets:
            kind, handle = bucket.handle
            if kind not in SHARING:
                raise WeightSyncError(f"cuda_ipc: buffer {bucket.index} is shared as {kind!r}; hint: kinds: "
                                      f"{', '.join(SHARING)}")
            buf = SHARING[kind][1](handle)
            if buf.numel() < bucket.nbytes:
                raise CorruptedWeights(f"cuda_ipc: buffer {bucket.index} maps {buf.numel()} bytes, {bucket.nbytes} "
                                       "were shared; hint: resend the sync")
            pairs = []
            for t in bucket.tensors:
                got_sum = word_checksum(buf[t.offset:t.offset + word_bytes(t.nbytes)])
                if got_sum != t.checksum:
                    raise CorruptedWeights(f"cuda_ipc: tensor {t.name!r} (buffer {bucket.index}) arrived with checksum "
                                           f"{got_sum}, {t.checksum} was sent; hint: the shared memory was changed "
                                           "after the sender packed it: resend the sync")
                data = buf[t.offset:t.offset + t.nbytes].clone()
                pairs.append((t.name, data.view(DTYPES[t.dtype]).reshape(t.shape)))
            del buf  # unmap before the next buffer
            stats.buckets += 1
            stats.tensors += len(pairs)
            stats.bytes += sum(t.nbytes for t in bucket.tensors)
            yield from pairs
        stats.wire_bytes = stats.bytes
        stats.seconds = time.perf_counter() - t0
        self.version = handoff.version

    def release(self) -> None:
        """Free the shared buffers once every receiver has loaded them (the train worker calls it when it
        gives its GPU to the colocated rollout engine); the next :meth:`send` packs new ones."""
        self._held = []
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free what receivers have unmapped

    def close(self) -> None:
        """Release the shared buffers and a handoff not yet taken."""
        self.release()
        self._outbox = None


__all__ = ["CudaIpcSync", "IpcBucket", "IpcHandoff", "IpcTensor", "SHARING", "word_checksum"]
