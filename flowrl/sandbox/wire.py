"""Messages between a sandbox pool and its workers: a length-prefixed pickle each.

Both ends are flowrl's own code (programs never see these pipes), so pickle is safe here.
"""

from __future__ import annotations

import pickle
import struct

_HEADER = struct.Struct("<Q")


def send(f, obj) -> None:
    """Write one message to the binary file ``f`` and flush it."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _read_exact(f, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(f):
    """The next message from the binary file ``f``, or None at EOF."""
    head = _read_exact(f, _HEADER.size)
    if head is None:
        return None
    body = _read_exact(f, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)
