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
* a worker process dies (killed from outside, out of memory, a segfault, ``os._exit``): it is
  replaced, and each episode it hosted is replayed on the fresh worker (``reset`` from its row,
  then ``step`` with each of its earlier turns, outputs discarded: environments are assumed to
  answer the same turns the same way) and its call made again, once per episode; the outcome
  says so (``recovered``). An episode whose replay fails, or whose call kills the fresh worker
  too, ends with an error.

What an environment prints (``print``, ``sys.stderr``) during a call is kept for that call (the
worker's ``sys.stdout`` and ``sys.stderr`` route each thread's writes to the call it runs, its
first ``OUTPUT_KEEP`` characters) and returned in :attr:`EnvOutcome.output`; the runtime writes it
to ``events.log``, secrets redacted, never to the terminal.

:data:`ENV_KINDS` maps an environment op's ``OpSpec.handler`` (``python_env``) to its builder.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from flowrl.catalog.ops import ENV_CALLS_PER_WORKER, OpKind
from flowrl.plan import EnvPlan, ExecutionPlan
from flowrl.runtime.agents import agent
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
    recovered: str | None = None
    """Set when the episode's worker died during this call and the episode was replayed on a fresh
    worker, which then answered the call: what happened (reported, nothing lost)."""
    output: str = ""
    """What the environment printed during this call (see the module docstring)."""
    messages: tuple = ()
    """The observation as chat messages (:attr:`flowrl.envs.StepResult.messages`), when the environment gave them."""


OUTPUT_KEEP = 4096
"""Characters kept of what an environment prints during one call (the rest is counted)."""


_CALLS = threading.local()
"""The output buffer of the call each thread of an environment worker runs (``buf``; None between calls)."""


class _CallOutput(io.TextIOBase):
    """An environment worker's ``sys.stdout`` / ``sys.stderr``: a thread running a call writes into that
    call's buffer (:meth:`EnvWorker._capture`); any other write goes where it went before."""

    def __init__(self, before, calls: threading.local):
        self._before, self._calls = before, calls

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self._before, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._before.fileno()

    def write(self, text: str) -> int:
        buf = getattr(self._calls, "buf", None)
        if buf is None:
            return self._before.write(text) if self._before is not None else len(text)
        room = OUTPUT_KEEP - buf[1]
        buf[0].append(text[:room])
        buf[1] += min(len(text), max(room, 0))
        buf[2] += max(0, len(text) - max(room, 0))
        return len(text)

    def flush(self) -> None:
        if self._before is not None and getattr(self._calls, "buf", None) is None:
            self._before.flush()


class EnvWorker:
    """A Ray actor hosting environment instances by episode key (one class per pool)."""

    def __init__(self, target: str, folder: str | None, config: dict | None = None):
        """``config``: a library environment's options (its adapter class is built with them); None: a
        ``python_env`` class, built with no arguments."""
        from flowrl.pyrefs import import_module_from, split_ref

        self._calls = _CALLS
        if not isinstance(sys.stdout, _CallOutput):  # once per process
            sys.stdout, sys.stderr = _CallOutput(sys.stdout, _CALLS), _CallOutput(sys.stderr, _CALLS)
        module, attr = split_ref(target)
        cls = getattr(import_module_from(module, folder), attr)
        self.cls = cls if config is None else (lambda: cls(dict(config)))
        self.envs: dict[str, object] = {}

    def _capture(self) -> None:
        self._calls.buf = [[], 0, 0]  # pieces, characters kept, characters dropped

    def _captured(self) -> str:
        pieces, _, dropped = self._calls.buf
        self._calls.buf = None
        return "".join(pieces) + (f"\n[... {dropped} more characters]" if dropped else "")

    def ready(self) -> bool:
        return True

    def step(self, key: str, row: dict | None, turn: str) -> dict:
        """``reset(row)`` when ``key`` is new (``row`` given), then ``step(turn)``; never raises."""
        from flowrl.envs import coerce_result

        t0 = time.time()
        self._capture()
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
                    "messages": r.messages, "seconds": time.time() - t0, "output": self._captured()}
        except Exception as e:  # noqa: BLE001 - user code may raise anything: it ends this episode only
            self._close(key)
            return {"error": f"{type(e).__name__}: {e}"[:500], "seconds": time.time() - t0,
                    "output": self._captured()}

    def replay(self, key: str, row: dict, turns: list[str]) -> str | None:
        """Rebuild episode ``key`` here after its worker died: ``reset(row)``, then ``step`` with each
        earlier turn (outputs discarded); None, or why it could not."""
        try:
            env = self.cls()
            env.reset(dict(row))
            for turn in turns:
                env.step(turn)
        except Exception as e:  # noqa: BLE001 - user code may raise anything: that episode ends
            return f"{type(e).__name__}: {e}"[:500]
        self.envs[key] = env
        return None

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

    def __init__(self, env: EnvPlan, *, start: bool = True, adapter: str | None = None):
        """``adapter``: a library environment's adapter class (``module:Class``), built with the
        environment's options (:mod:`flowrl.catalog.env_libraries`); None: ``python_env``'s class."""
        from flowrl.pyrefs import folder_of

        self.plan = env
        self.config = {**env.options, "flow_folder": folder_of(env.origin)} if adapter else None
        self.target = adapter or str(env.options["target"])
        self.folder = folder_of(env.origin)  # the flow file's folder first, as `flowrl check` looks
        self.timeout = float(env.options.get("timeout", 10.0)) or None
        self.size = int(env.options["workers"])
        self.workers: list = []
        self.hosted: list[set[str]] = []
        """Worker index -> keys of the episodes whose environments live there."""
        self.lost: dict[str, str] = {}
        """Episodes whose worker was replaced -> why; their next call ends them with that error."""
        self.restarts = 0
        self.history: dict[str, tuple[dict, list[str]]] = {}
        """Open episode -> (its row, the turns its environment has answered): what a replay needs."""
        self.retried: set[str] = set()
        """Episodes replayed once after their worker died (a second death ends them)."""
        if start:
            self.workers = [self._spawn() for _ in range(self.size)]
            self.hosted = [set() for _ in range(self.size)]
            self._wait_ready(list(range(self.size)))

    def _spawn(self):
        import ray

        from flowrl.runtime.environment import ACTOR_ENV

        actor = ray.remote(EnvWorker).options(
            num_cpus=0, max_concurrency=MAX_CONCURRENCY,
            runtime_env={"env_vars": {k: os.environ[k] for k in ACTOR_ENV if k in os.environ}})
        return actor.remote(self.target, self.folder, self.config)

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
        recovered: dict[int, str] = {}
        t0 = time.time()
        for i, (key, row, turn) in enumerate(calls):
            if key in self.lost:
                out[i] = EnvOutcome(error=self.lost.pop(key))
                continue
            if row is not None:  # an episode's first call: what a replay starts from
                self.history[key] = (dict(row), [])
            w = self.worker_of(key)
            self.hosted[w].add(key)
            pending[self.workers[w].step.remote(key, row, turn)] = (i, w, key, turn)
        while pending:
            left = None if self.timeout is None else max(0.0, t0 + self.timeout - time.time())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:  # the deadline passed: every call still running ends its episode
                self._give_up(pending, out, t0)
                break
            ref = ready[0]
            i, w, key, turn = pending.pop(ref)
            try:
                r = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the worker process died
                self._recover(w, (i, w, key, turn), type(e).__name__, pending, out, recovered, t0)
                continue
            if "error" in r:
                out[i] = EnvOutcome(error=r["error"], seconds=r["seconds"])
            else:
                out[i] = EnvOutcome(r["observation"], r["reward"], r["done"], r["info"], None, r["seconds"],
                                    messages=tuple(r.get("messages") or ()))
            out[i].recovered = recovered.get(i)
            out[i].output = r.get("output", "")
            if out[i].done or out[i].error is not None:
                self._forget(w, key)
            elif key in self.history:
                self.history[key][1].append(turn)
        return out

    def _recover(self, w: int, call: tuple, cause: str, pending: dict, out: list, recovered: dict,
                 t0: float) -> None:
        """Worker ``w`` died under ``call`` ``(i, w, key, turn)``: replace it, replay its episodes, and make
        its calls in flight again (into ``pending``, noted in ``recovered``), once per episode; a call
        whose episode was replayed before, or whose replay failed, ends in ``out`` with an error."""
        died = [call] + [c for c in pending.values() if c[1] == w]  # the others running on that worker
        for ref in [r for r, c in pending.items() if c[1] == w]:
            del pending[ref]
        why = f"its environment worker died ({cause})"
        replayed = self._replace(w, why, replay=True)
        for i, _, key, turn in died:
            if key in replayed and replayed[key] is None and key not in self.retried:
                self.retried.add(key)  # once: a second death is the episode's own doing
                recovered[i] = (f"{why} during this call; the episode was replayed on a fresh worker "
                                f"({len(self.history[key][1])} earlier turn(s)) and the call made again")
                pending[self.workers[w].step.remote(key, None, turn)] = (i, w, key, turn)
                continue
            failed = replayed.get(key)
            out[i] = EnvOutcome(error=f"the environment worker died during this call ({cause})"
                                + (f"; its replay failed: {failed}" if failed else ""), seconds=time.time() - t0)
            self.lost.pop(key, None)
            self._forget(w, key)

    def _forget(self, w: int, key: str) -> None:
        """Episode ``key`` is over: nothing to host or replay."""
        self.hosted[w].discard(key)
        self.history.pop(key, None)

    def _give_up(self, pending: dict, out: list, t0: float) -> None:
        stuck = sorted({w for _, w, _, _ in pending.values()})
        for i, w, key, _ in pending.values():
            out[i] = EnvOutcome(error=f"the environment call took longer than its timeout of {self.timeout:g}s",
                                seconds=time.time() - t0)
            self._forget(w, key)
        for w in stuck:
            self._replace(w, f"its environment worker was restarted after another episode's call "
                             f"exceeded the timeout of {self.timeout:g}s")
        for _, _, key, _ in pending.values():
            self.lost.pop(key, None)

    def _replace(self, w: int, why: str, replay: bool = False) -> dict[str, str | None]:
        """Kill worker ``w`` and start a fresh one. Without ``replay`` its episodes end with ``why`` at
        their next call; with it, each is replayed on the fresh worker (:meth:`EnvWorker.replay`):
        returns episode -> None (replayed) or why not (it then ends at its next call)."""
        import ray

        try:
            ray.kill(self.workers[w], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        hosted, self.hosted[w] = self.hosted[w], set()
        self.workers[w] = self._spawn()
        self.restarts += 1
        self._wait_ready([w])
        keys = sorted(k for k in hosted if replay and k in self.history)
        results = ray.get([self.workers[w].replay.remote(k, *self.history[k]) for k in keys]) if keys else []
        replayed = dict(zip(keys, results))
        for key in hosted:
            if replayed.get(key, why) is None:
                self.hosted[w].add(key)
            else:
                self.lost[key] = why if key not in replayed else f"{why}; its replay failed: {replayed[key]}"
                self.history.pop(key, None)
        return replayed

    def close_episodes(self, keys: list[str]) -> None:
        """End these episodes' environments (``close()``), wherever they live."""
        import ray

        by_worker: dict[int, list[str]] = {}
        for key in keys:
            self.lost.pop(key, None)
            self.history.pop(key, None)
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


def library_env(env: EnvPlan, plan: ExecutionPlan) -> EnvPool:
    """An environment of a library (``textarena(...)``, ``mcp(...)``...): a pool hosting the adapter its
    library's record names (:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`), built with its options."""
    from flowrl.catalog.env_libraries import ENV_LIBRARIES

    return EnvPool(env, adapter=ENV_LIBRARIES[env.kind].adapter)


ENV_KINDS: dict[str, Callable] = {f.__name__: f for f in (python_env, library_env, agent)}
"""``OpSpec.handler`` of an environment op -> ``builder(env plan, plan)``."""


def env_builder_of(env: EnvPlan) -> Callable:
    """The builder of ``env``'s kind (its op's ``OpSpec.handler``); a kind without one is an error."""
    return builder_for(env.kind, OpKind.ENV, ENV_KINDS, env.origin, noun="an environment kind", listing="kinds",
                       things="environments")


__all__ = ["EnvOutcome", "EnvWorker", "EnvPool", "ENV_KINDS", "env_builder_of", "python_env", "library_env",
           "MAX_CONCURRENCY"]
