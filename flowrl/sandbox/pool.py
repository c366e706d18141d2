"""A fixed-size pool of sandbox workers behind a thread-safe ``run`` / ``submit``.

Each worker is a long-lived ``python -m flowrl.sandbox.worker`` process; when the pool
runs as root each worker owns one unprivileged uid for its lifetime (a ``flock``'d slot
under ``/run/flowrl-sandbox``, so pools in different processes never share a uid, and a
uid left by a dead pool is swept by its next owner). One thread per worker takes jobs
from a shared queue, so callers on any thread just call :meth:`SandboxPool.run`.

A program cannot take its worker down (other uid, other pid namespace), but if a worker
dies or stops answering anyway, the job gets a :class:`SandboxError` and a fresh worker
replaces it: the pool keeps serving.

At start-up every worker probes which isolation layers hold (see
:mod:`flowrl.sandbox.worker`); :attr:`SandboxPool.layers` has the result, and each layer
that is not active is logged as a warning once per process.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import posixpath
import queue
import select
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from flowrl.sandbox.seccomp import SeccompUnavailable, build_filter
from flowrl.sandbox.types import LANGUAGES, Job, Layer, Limits, SandboxResult, WorkerConfig
from flowrl.sandbox.wire import recv, send

log = logging.getLogger("flowrl.sandbox")

UID_BASE = int(os.environ.get("FLOWRL_SANDBOX_UID_BASE", "3500000"))
"""First uid of the range root pools give their workers (``FLOWRL_SANDBOX_UID_BASE``);
no user or service may own uids in ``[UID_BASE, UID_BASE + UID_SLOTS)``."""
UID_SLOTS = 4096
LOCK_DIR = Path("/run/flowrl-sandbox")
REPLY_GRACE_S = 30.0
"""How long past a job's deadline a worker may take to answer before it is replaced."""

_PROJECT = str(Path(__file__).resolve().parents[2])


class SandboxError(RuntimeError):
    """The sandbox could not run a program (bad arguments, or a worker failure): never the program's fault."""


class _UidSlot:
    """An exclusive claim on one uid of the sandbox range, held while the file lock is."""

    def __init__(self) -> None:
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        st = LOCK_DIR.stat()
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise SandboxError(f"{LOCK_DIR} must be owned by root and not group/world-writable (mode {st.st_mode:o})")
        for i in range(UID_SLOTS):
            fd = os.open(LOCK_DIR / f"{UID_BASE + i}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = UID_BASE + i, fd
            return
        raise SandboxError(f"all {UID_SLOTS} sandbox uids from {UID_BASE} are taken; close other sandbox pools")

    def release(self) -> None:
        os.close(self._fd)


def _static_config(uid: int | None, use_bubblewrap: bool) -> WorkerConfig:
    """What to ask the worker for; its probe then drops whatever does not hold here."""
    try:
        bpf = build_filter()
    except SeccompUnavailable as e:
        log.warning("flowrl sandbox: seccomp filter unavailable: %s", e)
        bpf = None
    bwrap = next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)
    reason = "bubblewrap not found (fix: apt-get install bubblewrap)"
    if not use_bubblewrap:
        bwrap, reason = None, "bubblewrap switched off by the caller (use_bubblewrap=False)"
    # The probe checks these are hidden; /usr is shown to programs by design.
    hidden = tuple(d for d in dict.fromkeys((_PROJECT, os.getcwd())) if d != "/" and not d.startswith("/usr/"))
    return WorkerConfig(uid=uid, bwrap=bwrap, no_bwrap_reason=reason, seccomp_bpf=bpf, project_dirs=hidden)


class _Worker:
    """One worker process and the pipes to it."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _PROJECT, "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "flowrl.sandbox.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd="/",
                                     start_new_session=True)  # flowrl's group signals are flowrl's to handle
        try:
            send(self.proc.stdin, cfg)
            reply = self._reply(120.0)
        except (OSError, EOFError, TimeoutError) as e:
            self.kill()
            raise SandboxError(f"sandbox worker failed to start: {e}") from None
        if not (isinstance(reply, tuple) and reply[0] == "ready"):
            self.kill()
            raise SandboxError(f"sandbox worker failed to start: {reply[1] if isinstance(reply, tuple) else reply!r}")
        self.pid, self.layers = reply[1], reply[2]

    def _reply(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"sandbox worker {self.proc.pid} did not answer within {timeout:.0f} s")
        msg = recv(self.proc.stdout)
        if msg is None:
            raise EOFError(f"sandbox worker {self.proc.pid} died (exit status {self.proc.wait()})")
        return msg

    def call(self, job: Job) -> SandboxResult:
        send(self.proc.stdin, job)
        reply = self._reply(job.limits.timeout_s + REPLY_GRACE_S)
        if isinstance(reply, tuple):
            raise SandboxError(f"sandbox worker {self.pid}: {reply[1]}")
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:  # unflushed bytes to a dead worker
                pass

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker exits after its current job
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


_REPORTED: set[tuple[str, str]] = set()


def _report(layers: tuple[Layer, ...]) -> None:
    for layer in layers:
        if not layer.active and (layer.name, layer.detail) not in _REPORTED:
            _REPORTED.add((layer.name, layer.detail))
            log.warning("flowrl sandbox: isolation layer %r is NOT active: %s", layer.name, layer.detail)


class SandboxPool:
    """``workers`` sandbox workers (default: ``FLOWRL_SANDBOX_WORKERS`` or the CPU count).

    ``limits`` are the defaults of every run; ``run``/``submit`` override the deadline and
    memory per call. ``use_bubblewrap=False`` runs without the filesystem / pid-namespace
    layer (where bubblewrap is not allowed; the self-check reports it). Thread-safe. Use as a
    context manager, or call ``close()``.
    """

    def __init__(self, workers: int | None = None, *, limits: Limits = Limits(), use_bubblewrap: bool = True) -> None:
        n = workers or int(os.environ.get("FLOWRL_SANDBOX_WORKERS", "0")) or max(2, os.cpu_count() or 2)
        if n < 1:
            raise ValueError(f"SandboxPool: workers={workers}; need at least 1")
        self.limits = limits.check()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._slots = [_UidSlot() if os.geteuid() == 0 else None for _ in range(n)]
        first = _static_config(self._slots[0].uid if self._slots[0] else None, use_bubblewrap)
        self._configs = [replace(first, uid=s.uid if s else None) for s in self._slots]
        # Each worker is started by the thread that serves it for the pool's lifetime: a
        # worker dies with the thread that started it (PR_SET_PDEATHSIG follows threads).
        self._workers: list = [None] * n
        self._started = [threading.Event() for _ in range(n)]
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"sandbox-{i}")
                         for i in range(n)]
        for t in self._threads:
            t.start()
        for e in self._started:
            e.wait()
        errors = [w for w in self._workers if isinstance(w, Exception)]
        if errors:
            self.close()
            raise SandboxError(f"sandbox pool could not start: {errors[0]}") from errors[0]
        self.layers: tuple[Layer, ...] = self._workers[0].layers
        _report(self.layers)

    # ---- callers ------------------------------------------------------------------------
    def submit(self, source: str | bytes, *, language: str = "python", stdin: str | bytes = "",
               timeout_s: float | None = None, memory_mb: int | None = None,
               files: dict[str, str | bytes] | None = None) -> "Future[SandboxResult]":
        """Queue one program; the future's result is its :class:`SandboxResult`."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        job = self._job(source, language, stdin, timeout_s, memory_mb, files)
        fut: Future = Future()
        self._jobs.put((job, fut))
        return fut

    def run(self, source: str | bytes, **kwargs) -> SandboxResult:
        """Run one program and wait for its result (arguments as :meth:`submit`)."""
        return self.submit(source, **kwargs).result()

    def _job(self, source, language, stdin, timeout_s, memory_mb, files) -> Job:
        if language not in LANGUAGES:
            raise SandboxError(f"unknown sandbox language {language!r}; known: {sorted(LANGUAGES)}")
        limits = self.limits
        if timeout_s is not None or memory_mb is not None:
            limits = replace(limits, timeout_s=limits.timeout_s if timeout_s is None else timeout_s,
                             memory_mb=limits.memory_mb if memory_mb is None else memory_mb)
        try:
            limits.check()
        except ValueError as e:
            raise SandboxError(str(e)) from None
        main = LANGUAGES[language].filename
        out_files = {}
        for name, content in (files or {}).items():
            norm = posixpath.normpath(name) if isinstance(name, str) else ""
            if not norm or norm.startswith(("/", "..")) or norm == "." or norm == main or "\0" in norm:
                raise SandboxError(f"sandbox file name {name!r}: give a relative path inside the scratch "
                                   f"directory, not {main!r}")
            out_files[norm] = _bytes(content, f"file {name!r}")
        return Job(_bytes(source, "source"), language, _bytes(stdin, "stdin"), out_files, limits)

    # ---- serving threads ----------------------------------------------------------------
    def _serve(self, i: int) -> None:
        try:
            self._workers[i] = _Worker(self._configs[i])
        except Exception as e:  # noqa: BLE001 - raised by the constructor, in the caller's thread
            self._workers[i] = e
        finally:
            self._started[i].set()
        if isinstance(self._workers[i], Exception):
            return
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            if self._workers[i] is not None and self._workers[i].proc.poll() is not None:
                self._replace(i)  # died while idle (killed from outside): replace it before use
            if self._workers[i] is None:  # the last replacement failed: try again
                try:
                    self._workers[i] = _Worker(self._configs[i])
                except Exception as e:  # noqa: BLE001 - the job fails, the pool keeps trying
                    fut.set_exception(SandboxError(f"sandbox worker could not be restarted: {e}"))
                    continue
            try:
                fut.set_result(self._workers[i].call(job))
            except SandboxError as e:
                fut.set_exception(e)
            except (OSError, EOFError, TimeoutError) as e:
                self._replace(i)  # first, so that the pool is whole again when the caller hears
                fut.set_exception(SandboxError(f"{e}; the worker was replaced"))
            except BaseException as e:  # noqa: BLE001 - never leave a caller waiting
                self._replace(i)
                fut.set_exception(e)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = None
        try:
            self._workers[i] = _Worker(self._configs[i])
        except Exception as e:  # noqa: BLE001 - retried on the next job
            log.error("flowrl sandbox: could not restart worker %d: %s", i, e)

    def worker_pids(self) -> list[int]:
        """Process ids of the workers (for monitoring and tests)."""
        return [w.pid for w in self._workers if isinstance(w, _Worker)]

    # ---- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (after their current jobs); queued jobs are cancelled."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=60)
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()
        for w in self._workers:
            if isinstance(w, _Worker):
                w.close()
        self._release()

    def _release(self) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.release()
        self._slots = []

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bytes(value, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise SandboxError(f"sandbox {what} must be str or bytes, got {type(value).__name__}")


# ---- the process-wide default pool --------------------------------------------------------

_DEFAULT: SandboxPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> SandboxPool:
    """The pool :func:`run_code` uses, started on first use and closed at exit."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = SandboxPool()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


def _forget_default() -> None:
    # A forked child has the pool object but not its threads: it starts its own on use.
    global _DEFAULT, _DEFAULT_LOCK
    _DEFAULT, _DEFAULT_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_default)


def run_code(source: str, *, language: str = "python", stdin: str = "", timeout_s: float = 5.0,
             memory_mb: int = 256, files: dict[str, str | bytes] | None = None) -> SandboxResult:
    """Run ``source`` in the default sandbox pool and return what it did.

    >>> run_code("print(6 * 7)").stdout
    '42\\n'
    """
    return default_pool().run(source, language=language, stdin=stdin, timeout_s=timeout_s,
                              memory_mb=memory_mb, files=files)


def self_check() -> tuple[Layer, ...]:
    """The isolation layers of the default pool, as its workers' start-up probe found them."""
    return default_pool().layers
