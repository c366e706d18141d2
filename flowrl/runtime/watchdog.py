"""The watchdog: an engine call that never returns stops the run, named, instead of hanging it.

The driver waits on Ray for every engine call (a generate, a forward, a train step, a weight
sync, a memory hand-over, a checkpoint save). Each wait gets a deadline derived from what the
run measured so far for the same engine and call (``policy.rollout`` + ``generate``):

* while no such call has completed: ``first`` seconds (default 1800 s = 30 min: the first call
  warms the engine up: CUDA graphs, ``torch.compile``, NCCL communicators, a large model's
  first allocation);
* afterwards: ``max(floor, factor x the slowest completed call so far)`` (defaults 600 s and
  10x). The floor is torch.distributed's default collective timeout (10 min), the factor lets
  responses grow ten times longer than the longest yet before a generate counts as hung.

A call that passes its deadline raises :class:`EngineHung`: one line naming the engine (model,
role, replica), the call, the op (id and source position, added by the pipeline), the step, how
long the driver waited and the measured times, and the resume command. Finished steps keep their
metrics (the driver's clean-up runs as after any error).

The numbers are set by the environment variable ``FLOWRL_WATCHDOG`` (read once per run):
``first=1800,floor=600,factor=10`` (any subset), or ``off``.

>>> d = Deadlines(WatchdogSettings(first_s=60, floor_s=5, factor=4))
>>> d.deadline("policy.rollout", "generate")
60.0
>>> d.record("policy.rollout", "generate", 0.5); d.deadline("policy.rollout", "generate")
5.0
>>> d.record("policy.rollout", "generate", 3.0); d.record("policy.rollout", "generate", 2.0)
>>> d.deadline("policy.rollout", "generate"), d.measured("policy.rollout", "generate")
(12.0, '3 earlier call(s), the slowest 3.0 s')
>>> WatchdogSettings.parse("floor=2,factor=3")
WatchdogSettings(first_s=1800.0, floor_s=2.0, factor=3.0, enabled=True)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from flowrl.engines.base import EngineError
from flowrl.runtime.errors import EngineFault, RuntimeFlowError

ENV_VAR = "FLOWRL_WATCHDOG"
"""The environment variable that sets the watchdog's numbers (see the module docstring)."""


@dataclass(frozen=True)
class WatchdogSettings:
    """The deadline rule's numbers (seconds, and a factor)."""

    first_s: float = 1800.0
    """Deadline of an engine's first call of a kind (warm-up, compilation), seconds."""
    floor_s: float = 600.0
    """The shortest deadline once a call of that kind has completed, seconds."""
    factor: float = 10.0
    """Deadline = ``factor`` x the slowest completed call of the same engine and kind (at least ``floor_s``)."""
    enabled: bool = True
    """False (``FLOWRL_WATCHDOG=off``): waits have no deadline."""

    @classmethod
    def parse(cls, text: str | None) -> WatchdogSettings:
        """Settings from ``FLOWRL_WATCHDOG``'s value (None or empty: the defaults); a bad value is an error."""
        text = (text or "").strip()
        if not text:
            return cls()
        if text.lower() == "off":
            return cls(enabled=False)
        names = {"first": "first_s", "floor": "floor_s", "factor": "factor"}
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            try:
                number = float(value) if sep else -1.0
            except ValueError:
                number = -1.0
            if key not in names or not number > 0:
                raise RuntimeFlowError(f"{ENV_VAR}={text!r}: cannot read {part.strip()!r}; hint: write "
                                       f"`first=1800,floor=600,factor=10` (any of them, positive numbers) or `off`")
            values[names[key]] = number
        return cls(**values)

    @classmethod
    def from_env(cls) -> WatchdogSettings:
        return cls.parse(os.environ.get(ENV_VAR))

    def describe(self) -> str:
        return f"first={self.first_s:g},floor={self.floor_s:g},factor={self.factor:g}"


class Deadlines:
    """The measured times of each engine's calls, and the deadline of the next one (the module's rule)."""

    def __init__(self, settings: WatchdogSettings | None = None):
        self.settings = settings or WatchdogSettings()
        self.slowest: dict[tuple[str, str], float] = {}
        """(engine, call) -> the slowest completed call, seconds."""
        self.count: dict[tuple[str, str], int] = {}

    def deadline(self, engine: str, call: str) -> float | None:
        """Seconds the next ``call`` of ``engine`` may take; None: no deadline (the watchdog is off)."""
        s = self.settings
        if not s.enabled:
            return None
        slowest = self.slowest.get((engine, call))
        return float(s.first_s) if slowest is None else max(float(s.floor_s), s.factor * slowest)

    def record(self, engine: str, call: str, seconds: float) -> None:
        """A ``call`` of ``engine`` completed in ``seconds``."""
        key = (engine, call)
        self.slowest[key] = max(self.slowest.get(key, 0.0), float(seconds))
        self.count[key] = self.count.get(key, 0) + 1

    def measured(self, engine: str, call: str) -> str:
        """What the deadline was derived from, in words."""
        key = (engine, call)
        if key not in self.slowest:
            return "no earlier call (the first call's deadline)"
        return f"{self.count[key]} earlier call(s), the slowest {self.slowest[key]:.1f} s"


_RAY_PREAMBLE = "The actor died unexpectedly before finishing"
"""The first line of every ``ActorDiedError`` (Ray's ``BASE_ERROR_MSG``): the reason comes after it."""

RESTARTS_HINT = "`flowrl run --restarts N` restarts the engines from the last checkpoint by itself"


class EngineHung(EngineFault):
    """An engine call passed its deadline (see the module docstring)."""

    def __init__(self, engine: str, who: str, call: str, step: int, waited: float, rule: str, measured: str,
                 resume: str, op: str | None = None):
        self.fields = dict(engine=engine, who=who, call=call, step=step, waited=waited, rule=rule,
                           measured=measured, resume=resume, op=op)
        during = f" of op {op}" if op else ""
        super().__init__(
            f"watchdog: engine `{engine}` ({who}) did not finish `{call}`{during} at step {step + 1} within "
            f"{waited:.1f} s ({rule}; measured: {measured}); the engine hangs (a stuck collective, a deadlock, "
            f"a lost device), so the run stopped and the steps before it keep their metrics; {resume}; "
            f"hint: if the engine is only slow, raise the deadline with {ENV_VAR}=first=...,floor=...,factor=...; "
            f"{RESTARTS_HINT}")


class EngineDied(EngineFault):
    """An engine's actor process died during a call (killed, crashed, out of memory, its node lost).

    ``cause``: Ray's own reason, in one line; ``node``: where the actor ran and what else ran there,
    in words (added by the fleet, which knows the placement; None before the engines were placed).
    """

    def __init__(self, engine: str, who: str, call: str, step: int, cause: str, resume: str,
                 node: str | None = None, op: str | None = None):
        self.fields = dict(engine=engine, who=who, call=call, step=step, cause=cause, resume=resume, node=node,
                           op=op)
        during = f" of op {op}" if op else ""
        where = f" on {node}" if node else ""
        super().__init__(
            f"engine `{engine}` ({who}){where} died during `{call}`{during} at step {step + 1}: {cause}; the run "
            f"stopped and the steps before it keep their metrics; {resume}; {RESTARTS_HINT}")


class SyncBroken(EngineFault):
    """A collective weight sync's transport broke with every end alive (a connection dropped, a
    collective timed out, an end closed its group): the weights are intact, the group is not, and
    restarting the engines sets it up anew. An end that died is :class:`EngineDied` instead.

    ``ends``: what each end of the sync said, in one line (``the sender: ...; replica 0: ...``).
    """

    def __init__(self, model: str, protocol: str, step: int, ends: str, resume: str, op: str | None = None):
        self.fields = dict(model=model, protocol=protocol, step=step, ends=ends, resume=resume, op=op)
        during = f" of op {op}" if op else ""
        super().__init__(
            f"the `{protocol}` weight sync of `{model}`{during} broke at step {step + 1}, every end alive: {ends}; "
            f"the run stopped and the steps before it keep their metrics; {resume}; {RESTARTS_HINT}")


def died_cause(error: BaseException) -> str:
    """Ray's reason for an actor's death in one line (its attribute lines and final period dropped), at most
    300 characters.

    >>> died_cause(RuntimeError("The actor died unexpectedly before finishing this task.\\n\\tpid: 7\\n"
    ...                          "The actor died because its node has died. Node Id: ab12"))
    'The actor died because its node has died. Node Id: ab12'
    """
    lines = [line for line in str(error).splitlines() if line.strip()]
    reasons = [line.strip() for line in lines if not line.startswith("\t") and not line.startswith(_RAY_PREAMBLE)]
    text = (reasons or [line.strip() for line in lines] or [type(error).__name__])[0].rstrip(".")
    return text if len(text) <= 300 else text[:297] + "..."


class Watchdog:
    """Waits on Ray object refs with the deadline of :class:`Deadlines`; records the completed calls' times."""

    def __init__(self, settings: WatchdogSettings | None = None):
        self.deadlines = Deadlines(settings)

    def rule(self, engine: str, call: str) -> str:
        """The deadline's derivation, in words (for the message)."""
        s = self.deadlines.settings
        if (engine, call) not in self.deadlines.slowest:
            return f"the first call's deadline, first={s.first_s:g} s"
        return f"the deadline max(floor={s.floor_s:g} s, factor={s.factor:g} x the slowest earlier call)"

    def wait(self, refs: Sequence, engine: str, call: str, step: int, who: Sequence[str],
             resume: str) -> list:
        """``ray.get(refs)`` (in order), raising :class:`EngineHung` when the deadline passes first.

        ``who[i]`` names the actor of ``refs[i]`` (``replica 1``); an actor's own error is raised
        as soon as its call fails (not after the others). The wall time of the whole wait is
        recorded as one call of ``engine``'s ``call``.
        """
        import ray

        refs = list(refs)
        deadline = self.deadlines.deadline(engine, call)
        t0 = time.monotonic()
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - (time.monotonic() - t0))
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                names = ", ".join(who[refs.index(r)] for r in pending)
                raise EngineHung(engine, names, call, step, time.monotonic() - t0, self.rule(engine, call),
                                 self.deadlines.measured(engine, call), resume)
            self._get(ready, refs, engine, call, step, who, resume)  # an actor's error now, not after the slowest
        self.deadlines.record(engine, call, time.monotonic() - t0)
        return self._get(refs, refs, engine, call, step, who, resume)

    @staticmethod
    def _get(ready: list, refs: list, engine: str, call: str, step: int, who: Sequence[str], resume: str) -> list:
        """``ray.get(ready)``; an actor that died (not one whose constructor raised: that error is the
        user's, and stays as it is), or that Ray's memory monitor killed (``OutOfMemoryError``, not an
        actor error in Ray's classes), is :class:`EngineDied`, naming it from ``who``."""
        import ray

        try:
            return ray.get(ready)
        except ray.exceptions.RayTaskError as error:  # a rank process of the engine died: the engine's fault
            dead = getattr(error.cause, "dead_ranks", ()) if isinstance(error.cause, EngineError) else ()
            if not dead:
                raise
            failed = next((r for r in ready if _failed(r)), ready[0])
            raise EngineDied(engine, f"{who[refs.index(failed)]}: {', '.join(dead)}", call, step,
                             str(error.cause), resume) from error
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as error:
            if getattr(error, "actor_init_failed", False):
                raise
            dead = [r for r in ready if actor_died(r)] or ready
            cause = died_cause(error)
            if isinstance(error, ray.exceptions.OutOfMemoryError):  # Ray's memory monitor killed the process
                cause += (" (Ray's memory monitor killed it: this run's engines and the machine's other processes "
                          "needed more memory than the node has; a smaller cluster(...) or fewer engines need less)")
            raise EngineDied(engine, ", ".join(who[refs.index(r)] for r in dead), call, step, cause,
                             resume) from error


def _failed(ref) -> bool:
    """Whether ``ref`` (a finished call) raised."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - any failure: this is the call that raised
        return True
    return False


def actor_died(ref) -> bool:
    """Whether ``ref`` (a finished call) failed because its actor died."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError):
        return True
    except Exception:  # another failure (or not finished): not this actor's death
        return False
    return False


__all__ = ["ENV_VAR", "WatchdogSettings", "Deadlines", "EngineHung", "EngineDied", "SyncBroken", "Watchdog",
           "actor_died", "died_cause"]
