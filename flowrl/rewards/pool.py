"""Run a reward function over batches of completions in a worker pool, surviving its failures.

A reward is named by a spec string: a built-in verifier (``"exact"``, ``"math"``) or a
user function ``"package.module:function"`` with the verifier signature
``fn(completions: list[str], answers: list[str]) -> list[float]`` (it may also take a
``prompts`` keyword argument, which is then passed).

Failure handling: each chunk of samples is first scored with one call. If that call
raises (or returns the wrong number of values, or a non-number), the chunk is scored
again one sample at a time, so a failure is pinned to its sample: that sample gets
``error_reward`` and a ``RewardError`` record (index, truncated prompt and completion,
exception message); the other samples keep their real rewards and the run goes on. A
chunk that runs past ``timeout_s`` scores ``error_reward`` for all its samples and the
pool's processes are replaced.

Why processes (``multiprocessing`` "spawn" pool) rather than threads:

* user reward code is usually pure Python or sympy (``math_verify``), which holds the
  GIL: threads would not run in parallel;
* ``math_verify`` guards parsing with ``signal.alarm``, which only works on a process's
  main thread (each pool worker's tasks run there);
* a hung or crashing user function can be stopped: ``Pool.terminate()`` is public,
  whereas ``concurrent.futures`` has no way to kill a running task;
* "spawn" rather than "fork": the parent has torch's thread pools (and maybe Ray and
  vLLM) running, and forking a multi-threaded process can deadlock.

``workers=0`` scores in the calling process (no pool, no timeout): cheapest for the
built-in verifiers on small batches, and for tests.
"""

from __future__ import annotations

import importlib
import inspect
import math
import multiprocessing
import traceback
from dataclasses import dataclass, field
from typing import Callable

from flowrl.rewards.verifiers import VERIFIERS

RewardFn = Callable[..., list[float]]

MAX_TEXT = 200
"""Characters of prompt / completion kept in a ``RewardError``."""


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

    def __str__(self) -> str:
        return f"reward failed on sample {self.index} (prompt {self.prompt!r}, completion {self.completion!r}): {self.message}"


@dataclass
class RewardResult:
    """Rewards of one batch and the samples whose reward failed."""

    rewards: list[float]
    """Length N, one reward per completion (``error_reward`` where it failed)."""
    errors: list[RewardError] = field(default_factory=list)
    """Failed samples, in index order."""


def _truncate(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def resolve_reward(spec: str) -> RewardFn:
    """The function a spec names: a built-in verifier name, or ``"module:function"``."""
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise RewardSpecError(
            f"reward {spec!r} is neither a built-in verifier {sorted(VERIFIERS)} nor of the form 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardSpecError(
            f"reward {spec!r}: cannot import module {module_name!r} ({e}); hint: is it on PYTHONPATH / installed?"
        ) from None
    fn = getattr(module, func_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardSpecError(f"reward {spec!r}: module {module_name!r} has no function {func_name!r}; it has {public}")
    if not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {module_name}.{func_name} is a {type(fn).__name__}, not a function")
    return fn


def _takes_prompts(fn: RewardFn) -> bool:
    """Whether ``fn`` accepts a ``prompts`` keyword (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == "prompts" or p.kind is p.VAR_KEYWORD for p in params)


def _call(fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Call ``fn`` and check it returned one finite number per completion."""
    kwargs = {"prompts": prompts} if _takes_prompts(fn) else {}
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


def score_chunk(
    fn: RewardFn, start: int, prompts: list[str], completions: list[str], answers: list[str], error_reward: float
) -> tuple[list[float], list[RewardError]]:
    """Rewards for one chunk whose first sample has batch index ``start``; failures pinned per sample."""
    try:
        return _call(fn, prompts, completions, answers), []
    except Exception:  # noqa: BLE001 - any user error: retry per sample to find the culprit
        pass
    rewards, errors = [], []
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
        try:
            rewards += _call(fn, [p], [c], [a])
        except Exception as e:  # noqa: BLE001 - user code may raise anything
            rewards.append(error_reward)
            message = f"{type(e).__name__}: {e}"
            errors.append(RewardError(start + i, _truncate(p), _truncate(c), message))
    return rewards, errors


# --- worker-process side ------------------------------------------------------------

_WORKER_FN: RewardFn | None = None


def _init_worker(spec: str) -> None:
    global _WORKER_FN
    _WORKER_FN = resolve_reward(spec)


def _worker_score(args: tuple) -> tuple[list[float], list[RewardError]]:
    start, prompts, completions, answers, error_reward = args
    try:
        return score_chunk(_WORKER_FN, start, prompts, completions, answers, error_reward)
    except BaseException as e:  # noqa: BLE001 - e.g. SystemExit from user code: never kill the worker silently
        msg = f"{type(e).__name__}: {e} ({traceback.format_exc(limit=1).strip().splitlines()[-1]})"
        errs = [RewardError(start + i, _truncate(p), _truncate(c), msg) for i, (p, c) in enumerate(zip(prompts, completions))]
        return [error_reward] * len(completions), errs


# --- the pool -------------------------------------------------------------------------


class RewardPool:
    """Scores batches with the reward named by ``spec`` on ``workers`` processes (0: in process).

    ``error_reward`` is what a failed sample scores; ``chunk_size`` samples go to a worker
    per task; ``timeout_s`` bounds one chunk (process workers only).
    Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        spec: str,
        *,
        workers: int = 2,
        chunk_size: int = 64,
        error_reward: float = 0.0,
        timeout_s: float = 60.0,
    ) -> None:
        if workers < 0 or chunk_size < 1:
            raise ValueError(f"RewardPool: workers={workers}, chunk_size={chunk_size}; need workers >= 0, chunk_size >= 1")
        self.spec, self.workers, self.chunk_size = spec, workers, chunk_size
        self.error_reward, self.timeout_s = float(error_reward), timeout_s
        # Resolve here too: a bad spec fails now, in the caller, with the spec in the message.
        self._fn = resolve_reward(spec)
        self._pool = self._start() if workers else None

    def _start(self):
        ctx = multiprocessing.get_context("spawn")
        return ctx.Pool(self.workers, initializer=_init_worker, initargs=(self.spec,))

    def score(
        self, completions: list[str], answers: list[str], prompts: list[str] | None = None
    ) -> RewardResult:
        """Rewards for ``completions[i]`` against ``answers[i]`` (``[N]`` each); never raises for user errors."""
        if len(completions) != len(answers) or (prompts is not None and len(prompts) != len(completions)):
            raise ValueError(
                f"RewardPool.score: {len(completions)} completions, {len(answers)} answers, "
                f"{'no' if prompts is None else len(prompts)} prompts; pass one of each per sample"
            )
        prompts = prompts if prompts is not None else [""] * len(completions)
        starts = range(0, len(completions), self.chunk_size)
        chunks = [
            (s, prompts[s : s + self.chunk_size], completions[s : s + self.chunk_size],
             answers[s : s + self.chunk_size], self.error_reward)
            for s in starts
        ]
        results = self._score_inline(chunks) if self._pool is None else self._score_pool(chunks)
        rewards = [r for chunk_rewards, _ in results for r in chunk_rewards]
        errors = [e for _, chunk_errors in results for e in chunk_errors]
        return RewardResult(rewards, errors)

    def _score_inline(self, chunks: list[tuple]) -> list[tuple[list[float], list[RewardError]]]:
        return [score_chunk(self._fn, *chunk) for chunk in chunks]

    def _score_pool(self, chunks: list[tuple]) -> list[tuple[list[float], list[RewardError]]]:
        pending = [self._pool.apply_async(_worker_score, (chunk,)) for chunk in chunks]
        results, restart = [], False
        for chunk, fut in zip(chunks, pending):
            try:
                # After one timeout the pool is doomed; later chunks get a short grace only.
                results.append(fut.get(timeout=1.0 if restart else self.timeout_s))
            except multiprocessing.TimeoutError:
                restart = True
                start, prompts, completions, _, error_reward = chunk
                msg = f"TimeoutError: reward did not finish within {self.timeout_s} s (chunk of {len(completions)})"
                errs = [RewardError(start + i, _truncate(p), _truncate(c), msg) for i, (p, c) in enumerate(zip(prompts, completions))]
                results.append(([error_reward] * len(completions), errs))
        if restart:  # a worker is stuck in user code: replace them all
            self._pool.terminate()
            self._pool.join()
            self._pool = self._start()
        return results

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
