"""A broadcast's bucket frames kept on the wire's device: packed, checksummed and verified there.

Over NCCL the wire is GPU memory. Packing there (each tensor copied into a device buffer,
checksummed on the device) sends the trainer's GPU weights without a trip through host
memory, and a receiver verifies and hands its engine device tensors: where host frames
(CRC-32, :mod:`flowrl.runtime.weight_sync`) would copy every byte to the host and back on
both ends. The checksum is :func:`~flowrl.runtime.sync.cuda_ipc.word_checksum` (the int64
sums of a tensor's int32 words, plain and position-weighted: the same values on any device
whatever the reduction order), the one ``cuda_ipc`` verifies on the GPU.

Frame format (:class:`~flowrl.runtime.sync.broadcast.BroadcastSync`, ``frames="device"``): the
bucket's data with its padding zeroed, rounded up to 8 bytes, then the trailer ``int64[6 + 2 x
tensors] = (kind, version, index, bucket s1, message bytes, bucket s2, s1, s2 of each
tensor...)``; the header and the layout are as for host frames. The bucket's sums cover every
byte of its data room, padding included, and follow from the tensors' without a second pass
(the sums are linear: a tensor ``k`` words in adds ``s1`` and ``s2 + k s1``), so a receiver
checks one pair per bucket and the tensors' only to name a damaged one. The same code runs on
the CPU (over gloo), which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from flowrl.runtime.sync.base import ProtocolStats
from flowrl.runtime.sync.cuda_ipc import word_bytes, word_checksum
from flowrl.runtime.weight_sync import DTYPES, Bucket, CorruptedWeights, PlannedBucket, TensorMeta

TRAILER_HEAD = 6
"""int64 fields of a trailer before the tensors' checksums: a host frame's five, then the bucket's s2."""


class DeviceBucket(NamedTuple):
    """One bucket packed on the wire's device."""

    index: int
    frame: torch.Tensor
    """``[data room + trailer]`` uint8 on the device: the data, then room for the trailer."""
    tensors: tuple[TensorMeta, ...]
    """Where each tensor lies in the frame (``checksum`` unused: 0)."""
    sums: tuple[tuple[int, int], ...]
    """Each tensor's :func:`word_checksum`, in order."""
    checksum: tuple[int, int]
    """The :func:`word_checksum` of the whole data room."""


def data_room(nbytes: int) -> int:
    """Bytes a frame keeps for ``nbytes`` of data: rounded up to 8, so the trailer's int64s are aligned
    and the last tensor's checksum words stay inside the data."""
    return -(-nbytes // 8) * 8


def trailer_bytes(tensors: int) -> int:
    """Bytes of the trailer after the data of a bucket of ``tensors`` tensors."""
    return 8 * (TRAILER_HEAD + 2 * tensors)


def frame_bytes(nbytes: int, tensors: int) -> int:
    """Bytes of a bucket's message: its data room and its trailer."""
    return data_room(nbytes) + trailer_bytes(tensors)


def pack(planned: PlannedBucket, device: torch.device, stats: ProtocolStats) -> DeviceBucket:
    """Copy ``planned``'s tensors into one zeroed buffer on ``device`` and checksum each there."""
    started = time.perf_counter()
    frame = torch.zeros(frame_bytes(planned.nbytes, len(planned.tensors)), dtype=torch.uint8, device=device)
    sums = []
    for meta, source in zip(planned.tensors, planned.sources):
        flat = source.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        frame[meta.offset: meta.offset + meta.nbytes].copy_(flat)
        sums.append(word_checksum(frame[meta.offset: meta.offset + word_bytes(meta.nbytes)]))
        stats.copied_bytes += meta.nbytes
    stats.pack_seconds += time.perf_counter() - started
    stats.bytes += planned.nbytes
    stats.buckets += 1
    stats.tensors += len(planned.tensors)
    return DeviceBucket(planned.index, frame, planned.tensors, tuple(sums), bucket_sums(planned.tensors, sums))


def bucket_sums(tensors: tuple[TensorMeta, ...], sums) -> tuple[int, int]:
    """The data room's :func:`word_checksum` from its tensors' (padding zero): ``s1`` adds up, and a
    tensor ``k`` words into the room adds ``s2 + k s1`` (mod 2^64, as signed int64s)."""
    s1 = sum(a for a, _ in sums)
    s2 = sum(b + (m.offset // 4) * a for m, (a, b) in zip(tensors, sums))
    return _int64(s1), _int64(s2)


def _int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def write_trailer(bucket: DeviceBucket, kind: int, version: int) -> torch.Tensor:
    """The bucket's frame with its trailer written after the data room (the message to send)."""
    trailer = [kind, version, bucket.index, bucket.checksum[0], 0, bucket.checksum[1]]
    trailer += [s for pair in bucket.sums for s in pair]
    room = data_room(data_bytes(bucket.tensors))
    bucket.frame[room:].copy_(torch.tensor(trailer, dtype=torch.int64).view(torch.uint8))
    return bucket.frame


def data_bytes(tensors: tuple[TensorMeta, ...]) -> int:
    """Bytes of a bucket's data, its padding included: where its last tensor ends."""
    last = tensors[-1]
    return last.offset + last.nbytes


def as_host_bucket(bucket: DeviceBucket) -> Bucket:
    """A host copy of the bucket's data (for a fault-injection hook written against host buckets)."""
    return Bucket(bucket.index, bucket.frame[: data_bytes(bucket.tensors)].cpu().numpy().copy(), bucket.tensors, 0)


def with_data(bucket: DeviceBucket, data: np.ndarray) -> DeviceBucket:
    """A copy of ``bucket`` whose data is ``data`` (never written into the original frame)."""
    frame = bucket.frame.clone()
    frame[: data.nbytes].copy_(torch.from_numpy(np.ascontiguousarray(data)).to(frame.device))
    return bucket._replace(frame=frame)


def trailer_of(frame: torch.Tensor, nbytes: int) -> list[int]:
    """The int64 fields after a received frame's data room."""
    return frame[data_room(nbytes):].cpu().clone().view(torch.int64).tolist()


def received(frame: torch.Tensor, tensors: tuple[TensorMeta, ...], trailer: list[int]) -> DeviceBucket:
    """The bucket a received frame holds, its checksums read from its ``trailer`` (:func:`trailer_of`):
    the bucket's ``s1`` in the head's checksum field, its ``s2`` after the head, then each tensor's pair."""
    sums = trailer[TRAILER_HEAD:]
    return DeviceBucket(trailer[2], frame, tensors, tuple(zip(sums[0::2], sums[1::2])),
                        (trailer[3], trailer[TRAILER_HEAD - 1]))


def unpack(bucket: DeviceBucket, stats: ProtocolStats) -> list[tuple[str, torch.Tensor]]:
    """Verify the bucket's checksum on the device (one pass over its data room); ``(name, tensor)``
    views of the frame, in order.

    Raises:
        CorruptedWeights: naming the first tensor whose checksum differs, or the padding.
    """
    started = time.perf_counter()
    got = word_checksum(bucket.frame[: data_room(data_bytes(bucket.tensors))])
    if got != tuple(bucket.checksum):
        _raise_corruption(bucket, got)
    pairs = []
    for meta in bucket.tensors:
        data = bucket.frame[meta.offset: meta.offset + meta.nbytes]
        pairs.append((meta.name, data.view(DTYPES[meta.dtype]).reshape(meta.shape)))
    stats.unpack_seconds += time.perf_counter() - started
    return pairs


def _raise_corruption(bucket: DeviceBucket, got: tuple[int, int]) -> None:
    for meta, sent in zip(bucket.tensors, bucket.sums):
        mine = word_checksum(bucket.frame[meta.offset: meta.offset + word_bytes(meta.nbytes)])
        if mine != tuple(sent):
            raise CorruptedWeights(f"weight sync: tensor {meta.name!r} in bucket {bucket.index} is corrupted: word "
                                   f"sums {mine}, expected {tuple(sent)}; hint: the transfer damaged the frame, "
                                   "resend the bucket")
    raise CorruptedWeights(f"weight sync: bucket {bucket.index} word sums {got}, expected {tuple(bucket.checksum)}, "
                           "but every tensor's match; hint: the padding bytes or the bucket checksum itself were "
                           "damaged")


__all__ = ["DeviceBucket", "data_room", "data_bytes", "trailer_bytes", "frame_bytes", "pack", "bucket_sums",
           "write_trailer", "as_host_bucket", "with_data", "trailer_of", "received", "unpack"]
