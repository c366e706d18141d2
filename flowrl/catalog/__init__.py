"""The catalogue: one record per engine, weight-sync protocol, op and loss.

This package is the single source of truth about what flowrl can run. It is plain data
(no torch, Ray or engine imports), at the bottom of the import graph: the syntax checks,
the IR, the compiler's passes, the cost model, ``schedule auto``, the runtime's dispatch
tables and the generated docs all read it, and no other module compares an engine,
protocol, op or loss name (``tests/catalog`` enforces it and pairs every record with the
runtime component that serves it).

* :mod:`.ops` — op kinds and built-in ops (fields needed and produced, options, handler)
* :mod:`.losses` — losses, KL estimators, aggregations
* :mod:`.engines` — train and rollout engines (axes, options, memory model, platforms, adapter)
* :mod:`.protocols` — weight-sync protocols (transport, routes, platforms, runtime class)
* :mod:`.schedule` — clusters, pools, schedule statements
* :mod:`.hardware` — hardware profiles; :mod:`.platforms` — what a profile runs on
* :mod:`.models` — model facts read from configs and presets
"""

from __future__ import annotations

from flowrl.catalog.engines import ENGINES
from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OPS
from flowrl.catalog.protocols import PROTOCOLS

NAMES: dict[str, frozenset[str]] = {
    "engine": frozenset(ENGINES), "protocol": frozenset(PROTOCOLS), "op": frozenset(OPS),
    "loss": frozenset(LOSSES),
}
"""Every catalogue name, by kind."""

__all__ = ["ENGINES", "LOSSES", "OPS", "PROTOCOLS", "NAMES"]
