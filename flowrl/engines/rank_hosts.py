"""Where an engine's ranks run: the one choice between forked processes and Ray actors.

:func:`start_ranks` starts a :class:`~flowrl.engines.ranks.RankGroup` by the engine's ``placement``
argument: None (an engine built outside Ray: tests, notebooks) forks the ranks on this machine
(:class:`~flowrl.engines.ranks.ForkedRanks`); a :class:`~flowrl.engines.ranks.RankPlacement` (the
Ray runtime's, :func:`~flowrl.runtime.placement.rank_placement`) starts one Ray actor per rank in
its bundle (:class:`~flowrl.engines.rank_actors.ActorRanks`).
"""

from __future__ import annotations

from typing import Any

from flowrl.engines.base import EngineConfigError
from flowrl.engines.rank_actors import ActorRanks
from flowrl.engines.ranks import ForkedRanks, RankGroup, RankPlacement, RankProcessError


def start_ranks(worker_cls: type, options: Any, world: int, start_timeout_s: float, *, name: str = "engine",
                preload: tuple[str, ...] = (), error_cls: type[RankProcessError] = RankProcessError,
                placement: RankPlacement | None = None) -> RankGroup:
    """Start ``world`` ranks of ``worker_cls``: forked here without a ``placement`` (``preload``: what
    their fork server imports), else one Ray actor per rank where it says."""
    if placement is None:
        return ForkedRanks(worker_cls, options, world, start_timeout_s, name=name, preload=preload,
                           error_cls=error_cls)
    if len(placement.groups) != world:
        raise EngineConfigError(f"{name}: {world} ranks but a placement for {len(placement.groups)}; "
                                "the runtime places every rank of the engine's layout")
    return ActorRanks(worker_cls, options, placement, start_timeout_s, name=name, error_cls=error_cls)


__all__ = ["start_ranks"]
