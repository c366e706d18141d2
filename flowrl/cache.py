"""Where flowrl keeps what it builds once per machine: warm starts, reward models, cost profiles.

One rule, read on every call (a test or a command may set the variable after import):
``$FLOWRL_CACHE`` if set, else ``~/.cache/flowrl``. Each user of the cache takes a folder of its own
below this root (``warmstart/``, ``profiles/``, ``profile.json``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$FLOWRL_CACHE`` if set, else ``~/.cache/flowrl``."""
    root = os.environ.get("FLOWRL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "flowrl"


__all__ = ["cache_root"]
