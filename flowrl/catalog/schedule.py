"""The rest of the schedule vocabulary: clusters, pools, schedule statements, engine roles.

Engines are :mod:`flowrl.catalog.engines`, weight-sync protocols :mod:`flowrl.catalog.protocols`.

>>> CLUSTER["gpu"].choices[:3]
('cpu', 'A100', 'A10G')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.catalog.hardware import PROFILES
from flowrl.catalog.platforms import PLATFORMS
from flowrl.catalog.spec import RUNS, KwSpec, Support

CLUSTER = {"nodes": KwSpec("int", 1, min=1, doc="nodes of the cluster"),
           "gpus_per_node": KwSpec("int", 1, min=1, doc="GPUs per node (logical GPUs on a CPU cluster)"),
           "gpu": KwSpec("str", "cpu", choices=("cpu",) + tuple(sorted(PROFILES)),
                         doc="the hardware profile: `cpu` (logical GPUs on CPU machines) or a GPU kind"),
           "address": KwSpec("str", "", doc="a running Ray cluster to join (`ray://...`); empty: start one")}

MAX_GPUS = 2**17
"""The most GPUs a cluster may have (131,072, 16,384 nodes of 8). The plan holds a record
per GPU, so ``flowrl check`` refuses a larger cluster (E446) rather than plan it."""
AUTO_MAX_GPUS = 1024
"""The most GPUs ``schedule ... auto`` searches: the search lays out and places each of a few
hundred candidates on every GPU, so its time grows with the cluster (E446 above this)."""
MAX_STALENESS = 64
"""The largest ``staleness`` (and ``resync ... every N``) a schedule may give: rollouts that lag
the trainer by more steps are a typo, and the simulator keeps that many steps in flight (E408)."""

POOL = {"gpus": KwSpec("int", 1, min=1, required=True, doc="GPUs in the pool"),
        "nodes": KwSpec("int", 1, min=1, doc="nodes the pool spans")}

SCHED_CALLS: dict[str, dict[str, KwSpec]] = {
    "partial_rollout": {"over_provision": KwSpec("float", 1.25, min=1.0, max=16.0,
                                                 doc="requests sent per sample needed"),
                        "recycle": KwSpec("bool", True)},
}

AUTO = {"max_staleness": KwSpec("int", 1, min=1)}

ROLES = ("train", "rollout")
"""Engine roles of a trainable model in a schedule target: ``policy.train``, ``policy.rollout``."""


@dataclass(frozen=True)
class StatementSpec:
    """A statement of the language that is neither an op nor a resource: the schedule's statements
    and the flow's ``repeat`` loop. What they name has records of its own (an engine layout's
    engine, a resync's protocol); this record says where the statement itself runs."""

    name: str
    written: str
    """How it is written."""
    block: str
    """``schedule`` or ``flow``: the block it is written in."""
    doc: str
    platforms: dict = field(default_factory=lambda: dict.fromkeys(PLATFORMS, RUNS))
    """Platform -> :class:`Support`: every platform unless the record says otherwise. ``flowrl check``
    refuses the statement on a platform it does not run on (E444, at the statement)."""

    def support(self, platform: str) -> Support:
        return self.platforms.get(platform, Support(False, {}, f"`{self.name}` does not run on {platform}"))


STATEMENTS: dict[str, StatementSpec] = {s.name: s for s in (
    StatementSpec("pool", "pool NAME = gpus(gpus = N, nodes = M)", "schedule",
                  "names a set of GPUs that engines are placed on"),
    StatementSpec("place", "place TARGET, ... on POOL", "schedule", "puts engines on a pool"),
    StatementSpec("colocate", "colocate TARGET, ... [on POOL]", "schedule",
                  "puts engines on the same GPUs"),
    StatementSpec("staleness", "staleness [<=] K", "schedule",
                  "lets generation run up to K steps ahead of training (`<=`: a bound for `auto`)"),
    StatementSpec("resync", "resync MODEL via PROTOCOL(...) [every K]", "schedule",
                  "how (and how often) a model's weights reach its rollout engine; the protocol has its own platforms"),
    StatementSpec("partial_rollout", "partial_rollout(...)", "schedule",
                  "over-provisions generation requests, stops at the target count, recycles unfinished ones "
                  "into the next step"),
    StatementSpec("repeat", "repeat COUNT [until FIELD] { ... }", "flow",
                  "a multi-turn loop inside one step"),
)}
"""Statements by keyword (``partial_rollout``'s options: :data:`SCHED_CALLS`)."""

__all__ = ["CLUSTER", "POOL", "SCHED_CALLS", "AUTO", "ROLES", "StatementSpec", "STATEMENTS"]
