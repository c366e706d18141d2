"""Environments of a run: each ``python_env`` resource is a pool of Ray actors hosting its episodes.

An :class:`EnvPool` starts ``workers`` actors (:class:`EnvWorker`, ``num_cpus=0``: they wait on
tools, not compute), as many as the plan says: written on the ``python_env``, else sized by the
schedule (:mod:`flowrl.compiler.passes.size_env_pools`). Each episode (a key chosen by
:mod:`flowrl.runtime.episodes`) lives on one worker, ``hash(key) % workers``; a worker hosts many. :meth:`EnvPool.step` sends one call per
episode and collects them as they finish: calls run concurrently (threaded actors), so the slowest
tool call costs the batch its own time, not the sum.

Failures stay with their episode, as :class:`EnvOutcome` records with ``error`` set:

* the environment raises (in ``__init__``, ``reset``, ``step``), or returns something that is not
  a :class:`~flowrl.envs.StepResult`: that episode ends, its worker goes on;
* a call runs past ``timeout`` seconds: that episode ends; the worker (stuck in user code) is
  killed and replaced, and the other episodes it hosted end with an error naming the timeout;
* a worker process dies (a segfault, ``os._exit``): its episodes end with an error; it is replaced.

:data:`ENV_KINDS` maps an environment op's ``OpSpec.handler`` (``python_env``) to its builder.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from flowrl.catalog.ops import ENV_CALLS_PER_WORKER, OpKind
from flowrl.plan import EnvPlan, ExecutionPlan
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.kinds import builder_for

MAX_CONCURRENCY = ENV_CALLS_PER_WORKER
"""Calls one worker runs at a time (threads): episodes waiting on a slow tool do not block the others
(the catalogue's figure, by which the compiler sizes pools)."""


@dataclass
class EnvOutcome:
    """The result of one episode's call: the step's result, or why the episode ended in error."""

    observation: str = ""
    reward: float = 0.0
    done: bool = True
    info: dict = field(default_factory=dict)
    error: str | None = None
    """Set when the call failed (raised, timed out, its worker died): the episode is over."""
    seconds: float = 0.0
    """How long the call took in the worker (or until it was given up)."""


class EnvWorker:
    """A Ray actor hosting environment instances by episode key (one class per pool)."""

    def __init__(self, target: str, folder: str | None):
        from flowrl.pyrefs import import_module_from, split_ref

        module, attr = split_ref(target)
        self.cls = getattr(import_module_from(module, folder), attr)
        self.envs: dict[str, object] = {}

    def ready(self) -> bool:
        return True

    def step(self, key: str, row: dict | None, turn: str) -> dict:
        """``reset(row)`` when ``key`` is new (``row`` given), then ``step(turn)``; never raises."""
        from flowrl.envs import coerce_result

        t0 = time.time()
        try:
            env = self.envs.get(key)
            if env is None:
                if row is None:
                    raise RuntimeError("the episode's environment is gone (its worker was restarted)")
                env = self.cls()
                env.reset(dict(row))
                self.envs[key] = env
            r = coerce_result(env.step(turn))
            if r.done:
                self._close(key)
            return {"observation": r.observation, "reward": r.reward, "done": r.done, "info": r.info,
                    "seconds": time.time() - t0}
        except Exception as e:  # noqa: BLE001 - user code may raise anything: it ends this episode only
            self._close(key)
            return {"error": f"{type(e).__name__}: {e}"[:500], "seconds": time.time() - t0}

    def close(self, keys: list[str]) -> None:
        for key in keys:
            self._close(key)

    def _close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        closer = getattr(env, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:  # noqa: BLE001 - an episode that is over: its close() failing changes nothing
                pass


class EnvPool:
    """``workers`` :class:`EnvWorker` actors for one environment resource (see the module docstring)."""

    def __init__(self, env: EnvPlan, *, start: bool = True):
        from flowrl.pyrefs import folder_of

        self.plan = env
        self.target = str(env.options["target"])
        self.folder = folder_of(env.origin)  # the flow file's folder first, as `flowrl check` looks
        self.timeout = float(env.options.get("timeout", 10.0)) or None
        self.size = int(env.options["workers"])
        self.workers: list = []
        self.hosted: list[set[str]] = []
        """Worker index -> keys of the episodes whose environments live there."""
        self.lost: dict[str, str] = {}
        """Episodes whose worker was replaced -> why; their next call ends them with that error."""
        self.restarts = 0
        if start:
            self.workers = [self._spawn() for _ in range(self.size)]
            self.hosted = [set() for _ in range(self.size)]
            self._wait_ready(list(range(self.size)))

    def _spawn(self):
        import ray

        from flowrl.runtime.fleet import ACTOR_ENV

        actor = ray.remote(EnvWorker).options(
            num_cpus=0, max_concurrency=MAX_CONCURRENCY,
            runtime_env={"env_vars": {k: os.environ[k] for k in ACTOR_ENV if k in os.environ}})
        return actor.remote(self.target, self.folder)

    def _wait_ready(self, indices: list[int]) -> None:
        import ray

        try:
            ray.get([self.workers[i].ready.remote() for i in indices])
        except Exception as e:  # noqa: BLE001 - the class could not be imported or built: a user error
            cause = getattr(e, "cause", None) or e
            raise RuntimeFlowError(f"{self.plan.origin}: environment `{self.plan.id}` "
                                   f"(`{self.target}`) could not start: {type(cause).__name__}: {cause}") from None

    def worker_of(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.size

    def step(self, calls: list[tuple[str, dict | None, str]]) -> list[EnvOutcome]:
        """One call per episode ``(key, row on its first call else None, the model's turn)``, run
        concurrently; outcomes in the same order. Never raises for an environment's failure."""
        import ray

        out: list[EnvOutcome | None] = [None] * len(calls)
        pending: dict = {}
        t0 = time.time()
        for i, (key, row, turn) in enumerate(calls):
            if key in self.lost:
                out[i] = EnvOutcome(error=self.lost.pop(key))
                continue
            w = self.worker_of(key)
            self.hosted[w].add(key)
            pending[self.workers[w].step.remote(key, row, turn)] = (i, w, key)
        while pending:
            left = None if self.timeout is None else max(0.0, t0 + self.timeout - time.time())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:  # the deadline passed: every call still running ends its episode
                self._give_up(pending, out, t0)
                break
            ref = ready[0]
            i, w, key = pending.pop(ref)
            try:
                r = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the worker process died
                self._replace(w, f"its environment worker died ({type(e).__name__})")
                out[i] = EnvOutcome(error=f"the environment worker died during this call ({type(e).__name__})",
                                    seconds=time.time() - t0)
                for ref2, (j, w2, key2) in list(pending.items()):
                    if w2 == w:
                        pending.pop(ref2)
                        out[j] = EnvOutcome(error=f"the environment worker died during this call "
                                                  f"({type(e).__name__})", seconds=time.time() - t0)
                        self.lost.pop(key2, None)
                self.lost.pop(key, None)
                continue
            if "error" in r:
                out[i] = EnvOutcome(error=r["error"], seconds=r["seconds"])
            else:
                out[i] = EnvOutcome(r["observation"], r["reward"], r["done"], r["info"], None, r["seconds"])
            if out[i].done:
                self.hosted[w].discard(key)
        return out

    def _give_up(self, pending: dict, out: list, t0: float) -> None:
        stuck = sorted({w for _, w, _ in pending.values()})
        for i, w, key in pending.values():
            out[i] = EnvOutcome(error=f"the environment call took longer than its timeout of {self.timeout:g}s",
                                seconds=time.time() - t0)
        for w in stuck:
            self._replace(w, f"its environment worker was restarted after another episode's call "
                             f"exceeded the timeout of {self.timeout:g}s")
        for _, _, key in pending.values():
            self.lost.pop(key, None)

    def _replace(self, w: int, why: str) -> None:
        """Kill worker ``w`` and start a fresh one; its episodes end with ``why`` at their next call."""
        import ray

        try:
            ray.kill(self.workers[w], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        for key in self.hosted[w]:
            self.lost[key] = why
        self.hosted[w] = set()
        self.workers[w] = self._spawn()
        self.restarts += 1
        self._wait_ready([w])

    def close_episodes(self, keys: list[str]) -> None:
        """End these episodes' environments (``close()``), wherever they live."""
        import ray

        by_worker: dict[int, list[str]] = {}
        for key in keys:
            self.lost.pop(key, None)
            w = self.worker_of(key)
            if key in self.hosted[w]:
                self.hosted[w].discard(key)
                by_worker.setdefault(w, []).append(key)
        try:
            ray.get([self.workers[w].close.remote(ks) for w, ks in by_worker.items()], timeout=self.timeout)
        except Exception:  # noqa: BLE001 - closing what is over: a failure here changes no result
            pass

    def close(self) -> None:
        import ray

        for actor in self.workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self.workers = []


def python_env(env: EnvPlan, plan: ExecutionPlan) -> EnvPool:
    """A ``python_env("module:Class")``: its pool of workers."""
    return EnvPool(env)


ENV_KINDS: dict[str, Callable] = {f.__name__: f for f in (python_env,)}
"""``OpSpec.handler`` of an environment op -> ``builder(env plan, plan)``."""


def env_builder_of(env: EnvPlan) -> Callable:
    """The builder of ``env``'s kind (its op's ``OpSpec.handler``); a kind without one is an error."""
    return builder_for(env.kind, OpKind.ENV, ENV_KINDS, env.origin, noun="an environment kind", listing="kinds",
                       things="environments")


__all__ = ["EnvOutcome", "EnvWorker", "EnvPool", "ENV_KINDS", "env_builder_of", "python_env", "MAX_CONCURRENCY"]
