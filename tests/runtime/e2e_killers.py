"""A reward and an environment that SIGKILL their own worker process once, at the first call after
the file ``armed`` appears next to this module's copy (as the OOM killer or an operator would kill
it): what ``tests/runtime/test_worker_kill.py`` injects."""

import os
import signal
from pathlib import Path

from flowrl.envs.calculator import Calculator

HERE = Path(__file__).resolve().parent


def _fire() -> None:
    if (HERE / "armed").exists() and not (HERE / "fired").exists():
        (HERE / "fired").touch()
        os.kill(os.getpid(), signal.SIGKILL)


def sevens(completions, answers):
    """Fraction of the completion's characters that are '7' (as ``e2e_rewards.sevens``)."""
    _fire()
    return [c.count("7") / max(len(c), 1) for c in completions]


class Calc(Calculator):
    """The calculator tool."""

    def step(self, turn):
        _fire()
        return super().step(turn)
