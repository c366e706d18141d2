"""Rank workers for :class:`flowrl.engines.ranks.RankGroup` tests: no torch.distributed group; they
report their process ids (and sleep or refuse when asked)."""

from __future__ import annotations

import os


class PidWorker:
    def __init__(self, rank: int, world: int, init_method: str, options: object):
        self.coords = {"rank": rank, "pid": os.getpid()}

    def shutdown(self) -> None:
        pass


class SleepWorker(PidWorker):
    """A rank that sleeps when asked (a call in progress, for a test to kill a rank under)."""

    def sleep(self, seconds: float) -> None:
        import time

        time.sleep(seconds)

    def refuse(self) -> None:
        """A user-facing error on every rank (the group stays usable)."""
        from flowrl.engines.base import EngineConfigError

        raise EngineConfigError(f"rank {self.coords['rank']} refuses")
