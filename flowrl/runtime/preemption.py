"""Stopping a run by a signal: SIGTERM (as Slurm, Kubernetes, ``timeout`` and spot-instance reclaimers
send it before they kill) and SIGINT (Ctrl-C) mean the same, whether they reach flowrl alone or its
whole process group (a local Ray instance runs in a session of its own and never sees them:
:mod:`flowrl.runtime.environment`).

The first signal asks the run to stop at the next step boundary: the step in flight finishes, a
checkpoint of it is written (with or without ``--save-every``, with the rollouts already generated
for later steps, as every checkpoint holds them), and the run ends with :class:`Preempted`, which
``flowrl run`` reports with the command that continues it and exit status 0; summary.json,
curves.png and trace.json are written as after any stop. A second signal (either) abandons the
step at once: ``KeyboardInterrupt`` ends the run, ``flowrl run`` says "interrupted" and exits 130,
and the last checkpoint written stays the one to resume from. Without this, Python's defaults end
the process on the spot (SIGTERM) or raise ``KeyboardInterrupt`` wherever the main thread is
(SIGINT, inside a Ray call as likely as not): no checkpoint.

Only the process's main thread can install signal handlers; elsewhere (a run started from a
thread) the guard installs nothing and the signals keep their previous meaning.

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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run at a step boundary (the first) or at once (the second)."""


class Preempted(Exception):
    """The run stopped at a step boundary after a signal (``signal``: its name); ``step`` is the last
    step done (0: none)."""

    def __init__(self, out, step: int, steps: int, checkpoint: bool, signal: str = "SIGTERM"):
        self.out, self.step, self.steps, self.checkpoint = out, int(step), int(steps), bool(checkpoint)
        self.signal = signal
        if checkpoint:
            how = f"its checkpoint of step {step} is written; `flowrl run --resume {out}` continues it"
        elif step:
            how = f"`flowrl run --resume {out}` continues it from its last checkpoint"
        else:
            how = "no step had finished, so there is nothing to resume: run it again"
        super().__init__(f"preempted ({signal}) after step {step} of {steps}; {how}")


class SigtermGuard:
    """A context manager: while inside, SIGTERM and SIGINT set :attr:`requested` (the first; its name in
    :attr:`signal_name`) or raise ``KeyboardInterrupt`` (the second); the previous handlers are restored
    on exit."""

    def __init__(self, note: Callable[[str], None]):
        self.note = note
        self.requested = False
        self.signal_name = ""
        """The first signal's name (``SIGTERM``, ``SIGINT``), once :attr:`requested`."""
        self._previous: dict = {}
        self._installed = False

    def __enter__(self) -> SigtermGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
            self._installed = True
        return self

    def reclaim(self) -> None:
        """Take the signals back from whoever replaced a handler since :meth:`__enter__` (``ray.init``
        installs a SIGTERM handler that exits at once; engine libraries install SIGINT ones); on exit the
        handlers from before :meth:`__enter__` return."""
        if self._installed:
            for s in STOP_SIGNALS:
                if signal.getsignal(s) != self._on_signal:
                    signal.signal(s, self._on_signal)

    def __exit__(self, *exc) -> None:
        if self._installed:
            for s, previous in self._previous.items():
                signal.signal(s, previous)
            self._installed = False

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt(f"a second signal ({self.signal_name}, then {name})")
        self.requested, self.signal_name = True, name
        self.note(f"{name}: finishing the step in flight, then writing a checkpoint and stopping "
                  f"({name} again: stop at once)")


__all__ = ["STOP_SIGNALS", "Preempted", "SigtermGuard"]
