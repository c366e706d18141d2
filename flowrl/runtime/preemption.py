"""Preemption: SIGTERM, as Slurm, Kubernetes and spot-instance reclaimers send it before they kill.

The first SIGTERM asks the run to stop at the next step boundary: the step in flight finishes, a
checkpoint of it is written (with the rollouts already generated for later steps, as every
checkpoint holds them), and the run ends with :class:`Preempted`, which ``flowrl run`` reports
with the command that continues it and exit status 0. A second SIGTERM (or Ctrl-C) abandons the
step at once: the run stops as after Ctrl-C, and the last checkpoint written stays the one to
resume from. Without this, Python's default for SIGTERM ends the process on the spot: no
checkpoint, no summary, and a local Ray instance left running.

Only the process's main thread can install signal handlers; elsewhere (a run started from a
thread) the guard installs nothing and SIGTERM keeps its previous meaning.

>>> import os, signal
>>> with SigtermGuard(note=print) as guard:
...     os.kill(os.getpid(), signal.SIGTERM)
...     guard.requested
SIGTERM: finishing the step in flight, then writing a checkpoint and stopping (SIGTERM again: stop at once)
True
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


class Preempted(Exception):
    """The run stopped at a step boundary after SIGTERM; ``step`` is the last step done (0: none)."""

    def __init__(self, out, step: int, steps: int, checkpoint: bool):
        self.out, self.step, self.steps, self.checkpoint = out, int(step), int(steps), bool(checkpoint)
        if checkpoint:
            how = f"its checkpoint of step {step} is written; `flowrl run --resume {out}` continues it"
        elif step:
            how = f"`flowrl run --resume {out}` continues it from its last checkpoint"
        else:
            how = "no step had finished, so there is nothing to resume: run it again"
        super().__init__(f"preempted (SIGTERM) after step {step} of {steps}; {how}")


class SigtermGuard:
    """A context manager: while inside, SIGTERM sets :attr:`requested` (the first) or raises
    ``KeyboardInterrupt`` (the second); the previous handler is restored on exit."""

    def __init__(self, note: Callable[[str], None]):
        self.note = note
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> SigtermGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def reclaim(self) -> None:
        """Take SIGTERM back from whoever replaced the handler since :meth:`__enter__` (``ray.init``
        installs one that exits at once); on exit the handler from before :meth:`__enter__` returns."""
        if self._installed and signal.getsignal(signal.SIGTERM) != self._on_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt("a second SIGTERM")
        self.requested = True
        self.note("SIGTERM: finishing the step in flight, then writing a checkpoint and stopping "
                  "(SIGTERM again: stop at once)")


__all__ = ["Preempted", "SigtermGuard"]
