"""Buffers for streaming protocols: the sender's packer and the receiver's reusable receive buffers.

The one bucket packer is :class:`flowrl.runtime.weight_sync.BucketPacker` (re-exported
here): with ``ring=True`` it reuses a sent bucket's buffer and checksums each byte
once (the bucket CRC-32 follows from the tensors' by :func:`crc32_combine`), so a
streaming sender never page-faults fresh memory. Its buckets are bit-identical to
``iter_buckets``' (same layout, offsets, zero padding and checksums; a test compares
them), so :func:`~flowrl.runtime.weight_sync.unpack_bucket` verifies them.
:class:`BufferPool` is the receiver's side of the same idea.
"""

from __future__ import annotations

import threading

import numpy as np

from flowrl.runtime.weight_sync import BucketPacker, crc32_combine


class BufferPool:
    """Receive buffers reused across syncs: a sync's buffers return to the pool when the next sync starts.

    So a receiver's tensors (views into these buffers) stay valid until its next
    ``receive()`` begins, and steady-state syncs never page-fault fresh memory.
    """

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._used: list[np.ndarray] = []
        self._lock = threading.Lock()

    def new_sync(self) -> None:
        """Recycle every buffer handed out since the last call."""
        with self._lock:
            self._free += self._used
            self._used = []

    def take(self, nbytes: int) -> np.ndarray:
        """A ``[nbytes]`` uint8 array (a view of a pooled buffer at least that large)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:  # the smallest that fits; popped by position (list.remove compares arrays elementwise)
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            else:
                buf = np.empty(nbytes, np.uint8)
            self._used.append(buf)
        return buf[:nbytes]


__all__ = ["BucketPacker", "BufferPool", "crc32_combine"]
