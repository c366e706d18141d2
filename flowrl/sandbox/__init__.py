"""A code sandbox: run untrusted programs (model-written code) under layered isolation.

``run_code(source, language="python", stdin="", timeout_s=5.0, memory_mb=256, files=None)``
returns a :class:`SandboxResult`; :class:`SandboxPool` is the worker pool behind it (use one
directly for other limits or pool sizes). ``python -m flowrl.sandbox`` prints which
isolation layers hold on this machine. See docs/rewards.md for what is and is not guaranteed.
"""

from flowrl.sandbox.pool import SandboxError, SandboxPool, default_pool, run_code, self_check
from flowrl.sandbox.types import LANGUAGES, Layer, Limits, SandboxResult

__all__ = ["LANGUAGES", "Layer", "Limits", "SandboxError", "SandboxPool", "SandboxResult",
           "default_pool", "run_code", "self_check"]
