"""Reading the files a flow or a command line names: regular files only, never blocking, bounded.

A flow checked in CI may come from anyone, and it names files (datasets, model directories,
run directories for ``--measured``). Whatever it names, the compiler must not hang on a FIFO,
read ``/dev/zero`` forever, or load a huge file whole: :func:`open_regular` opens without
blocking and refuses anything that is not a regular file once it is open (so a file swapped
for a FIFO meanwhile is refused too), and :func:`read_bounded` reads at most a given number of
bytes. Their errors are :class:`OSError` naming what is wrong, never the file's content.

>>> import os, tempfile
>>> d = tempfile.mkdtemp(); os.mkfifo(os.path.join(d, "pipe"))
>>> try:
...     open_regular(os.path.join(d, "pipe"))
... except OSError as e:
...     print(e.strerror)
not a regular file (a pipe, a device, a socket or a directory)
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

NOT_REGULAR = "not a regular file (a pipe, a device, a socket or a directory)"


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file; else :class:`OSError`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, NOT_REGULAR, str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; :class:`OSError` (EFBIG) if larger."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", str(path))
    return data


__all__ = ["open_regular", "read_bounded", "NOT_REGULAR"]
