"""The rest of the schedule vocabulary: clusters, pools, schedule statements, engine roles.

Engines are :mod:`flowrl.catalog.engines`, weight-sync protocols :mod:`flowrl.catalog.protocols`.

>>> CLUSTER["gpu"].choices[:3]
('cpu', 'A100', 'A10G')
"""

from __future__ import annotations

from flowrl.catalog.hardware import PROFILES
from flowrl.catalog.spec import KwSpec

CLUSTER = {"nodes": KwSpec("int", 1, min=1, doc="nodes of the cluster"),
           "gpus_per_node": KwSpec("int", 1, min=1, doc="GPUs per node (logical GPUs on a CPU cluster)"),
           "gpu": KwSpec("str", "cpu", choices=("cpu",) + tuple(sorted(PROFILES)),
                         doc="the hardware profile: `cpu` (logical GPUs on CPU machines) or a GPU kind"),
           "address": KwSpec("str", "", doc="a running Ray cluster to join (`ray://...`); empty: start one")}

POOL = {"gpus": KwSpec("int", 1, min=1, required=True, doc="GPUs in the pool"),
        "nodes": KwSpec("int", 1, min=1, doc="nodes the pool spans")}

SCHED_CALLS: dict[str, dict[str, KwSpec]] = {
    "partial_rollout": {"over_provision": KwSpec("float", 1.25, min=1.0,
                                                 doc="requests sent per sample needed"),
                        "recycle": KwSpec("bool", True)},
}

AUTO = {"max_staleness": KwSpec("int", 1, min=1)}

ROLES = ("train", "rollout")
"""Engine roles of a trainable model in a schedule target: ``policy.train``, ``policy.rollout``."""

__all__ = ["CLUSTER", "POOL", "SCHED_CALLS", "AUTO", "ROLES"]
