"""Run a reward function over batches of completions in a worker pool, surviving its failures.

A reward is named by a spec string: a built-in verifier (``"exact"``, ``"math"``,
``"code"``) or a user function ``"package.module:function"`` with the signature

    fn(completions: list[str], answers: list[str], *, prompts=..., rows=...) -> list[float]

``prompts`` (the prompt texts) and ``rows`` (each sample's whole dataset row, a dict with
every field of the row) are passed only to a function that names them (or takes
``**kwargs``). The module is looked for in the flow file's ``folder`` first, then on
``PYTHONPATH``, then in installed packages, as ``flowrl check`` looks (:mod:`flowrl.pyrefs`).

Failure handling, per sample: with process workers (``workers >= 1``) every sample is
scored by its own call, under its own deadline (``timeout_s``: a flow's
``python_reward(..., timeout = S)``). A sample whose call raises, returns something other
than one finite number, runs past its deadline, or kills its worker (a segfault,
``os._exit``) gets ``error_reward`` and a :class:`RewardError` record (index, truncated
prompt and completion, message, traceback, what it printed); its worker is replaced if it
hung or died, and every other sample keeps its real reward. With ``workers=0`` (in the
calling process: cheapest for the built-in verifiers) a chunk is scored with one call,
then one sample at a time if that call fails; there is no deadline there (a function that
takes ``timeout_s`` is given ``fn_kwargs``' deadline to keep itself: the ``code`` verifier).

What a worker's reward function prints (``print``, stderr, a C library's or a subprocess's
writes to fds 1 and 2) never reaches the terminal: each sample's output is captured (its first
``OUTPUT_KEEP`` bytes) and returned with its result (:attr:`RewardResult.output`,
:attr:`RewardError.output`); the runtime writes it to ``events.log`` with secrets redacted.
While samples are pending past ``WAIT_REPORT_S``, ``on_wait(done, total)`` is called about once a
second (the runtime shows "waiting on rewards (n/N)" on the progress line).

Model-written code must never be ``exec``'d by a reward function itself (that runs it in
the trainer's process, as its user, unlimited): call :func:`flowrl.sandbox.run_code`.

Why processes (``multiprocessing`` "spawn") rather than threads:

* user reward code is usually pure Python or sympy (``math_verify``), which holds the
  GIL: threads would not run in parallel;
* ``math_verify`` guards parsing with ``signal.alarm``, which only works on a process's
  main thread (each worker's calls run there);
* a hung or crashing call can be stopped by killing its process; a thread cannot be killed;
* "spawn" rather than "fork": the parent has torch's thread pools (and maybe Ray and
  vLLM) running, and forking a multi-threaded process can deadlock.
"""

from __future__ import annotations

import inspect
import math
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

from flowrl.pyrefs import import_module_from, looked_in
from flowrl.rewards.verifiers import VERIFIERS

RewardFn = Callable[..., list[float]]

MAX_TEXT = 200
"""Characters of prompt / completion kept in a ``RewardError``."""
MAX_TRACEBACK = 8000
"""Characters of a failed call's traceback kept (its last ones: where it failed)."""
OUTPUT_KEEP = 4096
"""Bytes kept of what a reward function prints while scoring one sample (the rest is counted)."""
WAIT_REPORT_S = 2.0
"""How long a batch may be pending before ``on_wait`` is told how far it got (then about every second)."""


class RewardSpecError(ValueError):
    """A reward spec that does not name an importable function."""


@dataclass(frozen=True)
class RewardError:
    """One sample whose reward could not be computed (it got the pool's ``error_reward``)."""

    index: int
    """Position of the sample in the scored batch."""
    prompt: str
    """The prompt, truncated to ``MAX_TEXT`` characters."""
    completion: str
    """The completion, truncated to ``MAX_TEXT`` characters."""
    message: str
    """``"ExceptionType: message"`` raised by the reward function (or why its value was rejected)."""
    traceback: str = field(default="", compare=False)
    """The exception's traceback, as Python prints it (its last ``MAX_TRACEBACK`` characters); empty
    where there was no exception (a deadline, a dead worker, a rejected value)."""
    output: str = field(default="", compare=False)
    """What the reward function printed while scoring this sample (stdout and stderr)."""

    @classmethod
    def of(cls, index: int, prompt: str, completion: str, message: str, traceback: str = "",
           output: str = "") -> "RewardError":
        """The error of sample ``index``, its texts truncated to ``MAX_TEXT`` characters."""
        tb = traceback if len(traceback) <= MAX_TRACEBACK else "…" + traceback[-MAX_TRACEBACK + 1:]
        return cls(index, _truncate(prompt), _truncate(completion), message, tb, output)

    def __str__(self) -> str:
        return f"reward failed on sample {self.index} (prompt {self.prompt!r}, completion {self.completion!r}): {self.message}"


@dataclass
class RewardResult:
    """Rewards of one batch and the samples whose reward failed."""

    rewards: list[float]
    """Length N, one reward per completion (``error_reward`` where it failed)."""
    errors: list[RewardError] = field(default_factory=list)
    """Failed samples, in index order."""
    parts: dict[str, list[float]] = field(default_factory=dict)
    """A combined reward's (``weighted_sum``): each reward's own scores, by its name (unweighted)."""
    recovered: list[RewardError] = field(default_factory=list)
    """Samples whose worker process died while scoring them (killed from outside, out of memory)
    and that a fresh worker then scored: reported, not lost. A sample that kills the fresh worker
    too is its own fault: it scores the error reward and is in ``errors``."""
    output: list[tuple[int, str]] = field(default_factory=list)
    """``(index, text)`` of each sample scored without an error whose reward function printed
    something (process workers only; a failed sample's output is in its ``RewardError``)."""


def _truncate(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _shadowed(module, module_name: str, folder: str | None) -> str | None:
    """The file next to the flow that should have been imported, when an earlier import came from elsewhere."""
    if not folder:
        return None
    top = module_name.split(".")[0]
    origin = Path(getattr(module, "__file__", "") or "").resolve()
    folder_path = Path(folder).resolve()
    for candidate in (folder_path / f"{top}.py", folder_path / top / "__init__.py"):
        if candidate.exists():
            return None if folder_path in origin.parents else str(candidate)
    return None


def resolve_reward(spec: str, folder: str | None = None) -> RewardFn:
    """The function a spec names: a built-in verifier name, or ``"module:function"``.

    ``folder``: the flow file's folder, searched before ``PYTHONPATH`` and installed packages
    (as ``flowrl check`` looks, :mod:`flowrl.pyrefs`); it stays first on this process's ``sys.path``.
    """
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise RewardSpecError(
            f"reward {spec!r} is neither a built-in verifier {sorted(VERIFIERS)} nor of the form 'module:function'"
        )
    folder = str(Path(folder).resolve()) if folder else None
    try:
        module = import_module_from(module_name, folder)
    except ImportError as e:
        raise RewardSpecError(
            f"reward {spec!r}: cannot import module {module_name!r} ({e}); looked in {looked_in(folder)}; "
            "hint: put the module next to the flow file, or on PYTHONPATH"
        ) from None
    shadow = _shadowed(module, module_name, folder)
    if shadow is not None:
        raise RewardSpecError(
            f"reward {spec!r}: module {module_name!r} was already imported from {module.__file__}, "
            f"so {shadow} next to the flow cannot be; hint: give the flow's module a unique name"
        )
    fn = getattr(module, func_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardSpecError(f"reward {spec!r}: module {module_name!r} has no function {func_name!r}; it has {public}")
    if not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {module_name}.{func_name} is a {type(fn).__name__}, not a function")
    return fn


def _accepts(fn: RewardFn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _call(fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str],
          rows: list[dict] | None, fn_kwargs: dict | None = None) -> list[float]:
    """Call ``fn`` and check it returned one finite number per completion (``fn_kwargs``: those it accepts)."""
    kwargs = {k: v for k, v in (fn_kwargs or {}).items() if _accepts(fn, k)}
    if _accepts(fn, "prompts"):
        kwargs["prompts"] = prompts
    if rows is not None and _accepts(fn, "rows"):
        kwargs["rows"] = rows
    values = fn(completions, answers, **kwargs)
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"reward function returned {type(values).__name__}, expected a list of floats") from None
    if len(values) != len(completions):
        raise ValueError(f"reward function returned {len(values)} values for {len(completions)} completions")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise ValueError(f"reward function returned {v!r}; rewards must be finite numbers")
        out.append(float(v))
    return out


@dataclass(frozen=True)
class _Chunk:
    """Consecutive samples of one batch; ``start`` is the batch index of the first."""

    start: int
    prompts: list[str]
    completions: list[str]
    answers: list[str]
    rows: list[dict] | None

    def __len__(self) -> int:
        return len(self.completions)

    def sample(self, i: int) -> tuple[list[str], list[str], list[str], list[dict] | None]:
        """The one-sample argument lists of sample ``i`` of the chunk."""
        return ([self.prompts[i]], [self.completions[i]], [self.answers[i]],
                None if self.rows is None else [self.rows[i]])

    def after(self, i: int) -> "_Chunk":
        """The samples after sample ``i``."""
        return _Chunk(self.start + i + 1, self.prompts[i + 1 :], self.completions[i + 1 :], self.answers[i + 1 :],
                      None if self.rows is None else self.rows[i + 1 :])

    def error(self, i: int, message: str, traceback: str = "", output: str = "") -> RewardError:
        return RewardError.of(self.start + i, self.prompts[i], self.completions[i], message, traceback, output)


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def score_chunk(fn: RewardFn, chunk: _Chunk, error_reward: float,
                fn_kwargs: dict | None = None) -> tuple[list[float], list[RewardError]]:
    """Rewards for one chunk in this process: one call, then one call per sample if it fails."""
    try:
        return _call(fn, chunk.prompts, chunk.completions, chunk.answers, chunk.rows, fn_kwargs), []
    except Exception:  # noqa: BLE001 - any user error: retry per sample to find the culprit
        pass
    rewards, errors = [], []
    for i in range(len(chunk)):
        try:
            rewards += _call(fn, *chunk.sample(i), fn_kwargs)
        except Exception as e:  # noqa: BLE001 - user code may raise anything
            rewards.append(error_reward)
            errors.append(chunk.error(i, _message(e), traceback.format_exc()))
    return rewards, errors


# --- worker-process side ------------------------------------------------------------


class _Output:
    """A worker's fds 1 and 2 (so ``print``, stderr, C code and subprocesses alike): a pipe that a
    thread drains, keeping the first ``OUTPUT_KEEP`` bytes of each sample's output in memory."""

    MARK = b"\x00\x01flowrl-reward-sample-end\x01\x00"

    def __init__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        r, w = os.pipe()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self._r, self._kept, self._dropped = r, bytearray(), 0
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._drain, daemon=True, name="flowrl-reward-output").start()

    def _keep(self, data: bytes) -> None:
        room = OUTPUT_KEEP - len(self._kept)
        self._kept += data[:room]
        self._dropped += max(0, len(data) - room)

    def _drain(self) -> None:
        pending = b""
        while True:
            data = os.read(self._r, 1 << 16)
            if not data:
                return
            pending += data
            at = pending.find(self.MARK)
            while at >= 0:
                self._keep(pending[:at])
                text = self._kept.decode("utf-8", errors="replace")
                self._done.put(text + (f"\n[... {self._dropped} more bytes]" if self._dropped else ""))
                self._kept, self._dropped = bytearray(), 0
                pending = pending[at + len(self.MARK):]
                at = pending.find(self.MARK)
            if len(pending) > len(self.MARK):  # what cannot be the start of a mark
                self._keep(pending[: -len(self.MARK)])
                pending = pending[-len(self.MARK):]

    def take(self) -> str:
        """What was printed since the last ``take``."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # replaced or closed by the reward function
                pass
        try:
            os.write(1, self.MARK)
            return self._done.get(timeout=10.0)
        except (OSError, queue.Empty):
            return "[output not captured: the reward function closed or redirected its stdout]"


def _worker_main(conn, spec: str, folder: str | None, fn_kwargs: dict | None = None) -> None:
    """Score the chunks sent on ``conn`` one sample at a time; one message per sample, in order:
    ``("ok", reward, output)`` or ``("error", message, traceback, output)``."""
    os.setsid()  # a session of its own: a signal to flowrl's process group (Ctrl-C) is flowrl's to handle
    try:
        output = _Output()
        fn = resolve_reward(spec, folder)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("init_error", _message(e)))
        return
    output.take()  # what importing the module printed is not a sample's
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        for i in range(len(chunk)):
            try:
                value = _call(fn, *chunk.sample(i), fn_kwargs)[0]
            except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: never die silently
                conn.send(("error", _message(e), traceback.format_exc(), output.take()))
            else:
                conn.send(("ok", value, output.take()))


STARTUP_TIMEOUT_S = 300.0
"""How long a spawned worker may take to import Python and the reward's module before it counts
as hung: generous, since a loaded machine (or a cold file cache) makes imports take a minute."""


class _Worker:
    """A spawned scoring process and the chunk it is working on."""

    def __init__(self, ctx, spec: str, folder: str | None, fn_kwargs: dict | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, folder, fn_kwargs), daemon=True,
                                name="flowrl-reward")
        from flowrl.runtime.environment import environ_for

        with environ_for("reward"):  # the scrubbed environment (flowrl.runtime.environment), no secrets
            self.proc.start()
        child.close()
        self.chunk: _Chunk | None = None
        self.index = 0
        """Sample of ``chunk`` being scored now."""
        self.since = 0.0
        """When it started (``time.monotonic()``)."""

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            self.kill()
            raise RewardSpecError(f"reward worker did not start within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RewardSpecError(f"reward worker died while starting (exit code {self.proc.exitcode})") from None
        if msg[0] == "init_error":
            self.kill()
            raise RewardSpecError(msg[1])

    def give(self, chunk: _Chunk) -> None:
        self.conn.send(chunk)
        self.chunk, self.index, self.since = chunk, 0, time.monotonic()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


# --- the pool -------------------------------------------------------------------------


class RewardPool:
    """Scores batches with the reward named by ``spec`` on ``workers`` processes (0: in process).

    ``error_reward`` is what a failed sample scores; ``chunk_size`` samples go to a worker
    at a time; ``timeout_s`` bounds each sample's call (process workers only);
    ``folder`` (the flow file's) is searched first for ``spec``'s module; ``fn_kwargs`` are passed
    to the function where it takes them (``timeout_s`` to the ``code`` verifier). ``on_wait``:
    see the module docstring. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        spec: str,
        *,
        workers: int = 2,
        chunk_size: int = 64,
        error_reward: float = 0.0,
        timeout_s: float = 60.0,
        folder: str | None = None,
        fn_kwargs: dict | None = None,
    ) -> None:
        if workers < 0 or chunk_size < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool: workers={workers}, chunk_size={chunk_size}, timeout_s={timeout_s}; "
                             "need workers >= 0, chunk_size >= 1, timeout_s > 0")
        self.spec, self.workers, self.chunk_size = spec, workers, chunk_size
        self.error_reward, self.timeout_s = float(error_reward), timeout_s
        self.folder = str(folder) if folder else None
        self.fn_kwargs = dict(fn_kwargs or {})
        self.on_wait: Callable[[int, int], None] | None = None
        """Told ``(samples scored, samples)`` while a batch is pending (see the module docstring)."""
        # Resolve here too: a bad spec fails now, in the caller, with the spec in the message.
        self._fn = resolve_reward(spec, self.folder)
        self._ctx = multiprocessing.get_context("spawn")
        self._pool: list[_Worker] = []
        for _ in range(workers):
            self._pool.append(_Worker(self._ctx, spec, self.folder, self.fn_kwargs))
        for w in self._pool:
            w.wait_ready(max(STARTUP_TIMEOUT_S, timeout_s))
        self.restarts = 0
        """Workers replaced so far (after a hang or a crash)."""
        self.correct: float | None = 1.0
        """The reward the held-out accuracy counts as right (a ``python_reward`` returns 1.0 for a right answer)."""

    def score(
        self, completions: list[str], answers: list[str], prompts: list[str] | None = None,
        rows: list[dict] | None = None,
    ) -> RewardResult:
        """Rewards for ``completions[i]`` against ``answers[i]`` (``[N]`` each); never raises for user errors.

        ``rows[i]``: the dataset row sample ``i`` came from (every field), for rewards that
        take ``rows`` (e.g. the ``code`` verifier's ``tests``).
        """
        n = len(completions)
        if len(answers) != n or (prompts is not None and len(prompts) != n) or (rows is not None and len(rows) != n):
            raise ValueError(
                f"RewardPool.score: {n} completions, {len(answers)} answers, "
                f"{'no' if prompts is None else len(prompts)} prompts, {'no' if rows is None else len(rows)} rows; "
                "pass one of each per sample"
            )
        prompts = prompts if prompts is not None else [""] * n
        chunks = [_Chunk(s, prompts[s : s + self.chunk_size], completions[s : s + self.chunk_size],
                         answers[s : s + self.chunk_size], None if rows is None else rows[s : s + self.chunk_size])
                  for s in range(0, n, self.chunk_size)]
        if not self._pool:
            results = [score_chunk(self._fn, c, self.error_reward, self.fn_kwargs) for c in chunks]
            rewards = [r for chunk_rewards, _ in results for r in chunk_rewards]
            return RewardResult(rewards, [e for _, errs in results for e in errs])
        return self._score_pool(n, chunks)

    def _score_pool(self, n: int, chunks: list[_Chunk]) -> RewardResult:
        rewards: list[float | None] = [None] * n
        errors: dict[int, RewardError] = {}
        recovered: dict[int, RewardError] = {}
        printed: dict[int, str] = {}
        todo = deque(chunks)
        started = last_report = time.monotonic()
        idle, busy = list(self._pool), []

        def fail(w: _Worker, message: str, replace: bool, retry: bool = False) -> None:
            chunk, i = w.chunk, w.index
            busy.remove(w)
            if retry and chunk.start + i not in recovered:  # once: a fresh worker scores it again
                recovered[chunk.start + i] = chunk.error(i, message + "; scored again by a fresh worker")
                todo.appendleft(chunk.after(i - 1))
            else:
                rewards[chunk.start + i] = self.error_reward
                errors[chunk.start + i] = chunk.error(i, message)
                if i + 1 < len(chunk):
                    todo.appendleft(chunk.after(i))  # the rest of the chunk goes on elsewhere
            if replace:
                w.kill()
                fresh = _Worker(self._ctx, self.spec, self.folder, self.fn_kwargs)
                self._pool[self._pool.index(w)] = fresh
                fresh.wait_ready(max(STARTUP_TIMEOUT_S, self.timeout_s))
                self.restarts += 1
                idle.append(fresh)
            else:
                idle.append(w)

        while todo or busy:
            while todo and idle:
                w = idle.pop()
                w.give(todo.popleft())
                busy.append(w)
            now = time.monotonic()
            if self.on_wait is not None and now - started >= WAIT_REPORT_S and now - last_report >= 1.0:
                self.on_wait(sum(r is not None for r in rewards), n)
                last_report = now
            timeout = max(0.0, min(w.since + self.timeout_s for w in busy) - now)
            if self.on_wait is not None:
                timeout = min(timeout, 1.0)
            ready = set(wait([w.conn for w in busy], timeout))
            for w in list(busy):
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(timeout=5)  # EOF can come before the exit status
                        fail(w, f"WorkerDied: the reward process exited with code {w.proc.exitcode} "
                                "while scoring this sample", replace=True, retry=True)
                        continue
                    i = w.chunk.start + w.index
                    if msg[0] == "ok":
                        rewards[i] = msg[1]
                        if msg[2]:
                            printed[i] = msg[2]
                    else:
                        rewards[i] = self.error_reward
                        errors[i] = w.chunk.error(w.index, msg[1], msg[2], msg[3])
                    w.index += 1
                    w.since = time.monotonic()
                    if w.index == len(w.chunk):
                        busy.remove(w)
                        idle.append(w)
                elif time.monotonic() - w.since >= self.timeout_s:
                    fail(w, f"TimeoutError: reward did not finish within its timeout of {self.timeout_s:g} s "
                            "(the flow's `timeout` option of the reward)", replace=True)
        return RewardResult([float(r) for r in rewards], [errors[i] for i in sorted(errors)],
                            recovered=[recovered[i] for i in sorted(recovered) if i not in errors],
                            output=sorted(printed.items()))

    def close(self) -> None:
        """Stop the worker processes."""
        for w in self._pool:
            try:
                w.conn.close()  # EOF: the worker returns
            except OSError:
                pass
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
        self._pool = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
