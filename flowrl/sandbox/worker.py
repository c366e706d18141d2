"""A sandbox worker: a long-lived small process that runs one program at a time.

Started by :class:`~flowrl.sandbox.pool.SandboxPool` as ``python -m flowrl.sandbox.worker``
(never forked from the caller: a parent with torch loaded costs ~6 ms more per fork, and
the worker must be single-threaded for ``preexec_fn``). Protocol on its stdin/stdout: a
length-prefixed pickle per message; first the :class:`WorkerConfig`, answered by
``("ready", pid, layers)``; then one :class:`Job` per message, answered by a
:class:`SandboxResult` or ``("error", message)``. EOF on stdin ends the worker; so does its
parent's death (``PR_SET_PDEATHSIG``).

Per job: write the files, start the program under the layers of
:mod:`flowrl.sandbox.launch`, feed stdin and collect at most ``output_bytes`` of each
output stream, stop it at the deadline, then kill and reap everything it left
(:func:`flowrl.sandbox.procs.sweep`) before answering.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial

from flowrl.sandbox import launch, procs
from flowrl.sandbox.seccomp import load_filter
from flowrl.sandbox.types import (LANGUAGES, SCRATCH_MOUNT, SHARED_WRITABLE, Job, Layer, Limits, SandboxResult,
                                  WorkerConfig)
from flowrl.sandbox.wire import recv, send

# ---- one run ----------------------------------------------------------------------------

_MEMORY = re.compile(rb"^MemoryError\b|Cannot allocate memory|std::bad_alloc|out of memory", re.MULTILINE)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("sandbox-file")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _scratch(files: dict[str, bytes], uid: int | None) -> str:
    """A host scratch directory holding ``files``, owned by ``uid`` (no-bubblewrap path)."""
    path = tempfile.mkdtemp(prefix="flowrl-sandbox-")
    for name, data in files.items():
        dest = os.path.join(path, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "wb") as f:
            f.write(data)
    if uid is not None:
        for root, dirs, names in os.walk(path):
            for n in dirs + names:
                os.chown(os.path.join(root, n), uid, uid)
        os.chown(path, uid, uid)
    return path


def private_mounts() -> str | None:
    """Move this worker into a mount namespace of its own (root: ``CLONE_NEWNS``; otherwise a
    user namespace too, mapping its own uid), where it can mount each run's scratch tmpfs
    without the host seeing it. None on success, else why not (the kernel's words)."""
    try:
        if os.geteuid() == 0:
            procs.unshare(procs.CLONE_NEWNS)
        else:
            uid, gid = os.geteuid(), os.getegid()
            procs.unshare(procs.CLONE_NEWUSER | procs.CLONE_NEWNS)
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        procs.mount("none", "/", None, procs.MS_REC | procs.MS_PRIVATE)  # nothing propagates to the host
        procs.mount("flowrl-probe", SCRATCH_MOUNT, "tmpfs", procs.MS_NOSUID | procs.MS_NODEV, "size=4096,nr_inodes=16")
        procs.umount(SCRATCH_MOUNT)
    except OSError as e:
        return str(e)
    return None


class _Scratch:
    """One run's writable space: a tmpfs at :data:`SCRATCH_MOUNT` (in the worker's own mount
    namespace) capped at ``scratch_mb`` and ``scratch_files``, holding the run's files; without
    bubblewrap also bound over the host's world-writable directories (``binds``)."""

    def __init__(self, files: dict[str, bytes], limits: Limits, uid: int | None, *, bind_shared: bool) -> None:
        dirs = {d for name in files for d in _parents(name)}
        own = 1 + len(dirs) + len(files)  # the root, and what is written here before the program starts
        opts = f"size={limits.scratch_mb * launch.MIB},nr_inodes={limits.scratch_files + own},mode=0700"
        if uid is not None:
            opts += f",uid={uid},gid={uid}"
        procs.mount("flowrl-sandbox", SCRATCH_MOUNT, "tmpfs", procs.MS_NOSUID | procs.MS_NODEV, opts)
        self.path, self.limit, self.binds = SCRATCH_MOUNT, limits.scratch_files, []
        try:
            for d in sorted(dirs):
                os.mkdir(os.path.join(self.path, d))
            for name, data in files.items():
                with open(os.path.join(self.path, name), "wb") as f:
                    f.write(data)
            if uid is not None:
                for name in [*dirs, *files]:
                    os.chown(os.path.join(self.path, name), uid, uid)
            if bind_shared:
                for d in dict.fromkeys(os.path.realpath(p) for p in SHARED_WRITABLE):
                    if os.path.isdir(d) and d != self.path:
                        procs.mount(self.path, d, None, procs.MS_BIND)
                        self.binds.append(d)
        except BaseException:
            self.close()
            raise

    def usage(self) -> tuple[bool, bool]:
        """(files used up, bytes used up)."""
        st = os.statvfs(self.path)
        return st.f_ffree == 0, st.f_bavail == 0

    def close(self) -> None:
        for d in reversed(self.binds):
            procs.umount(d)
        self.binds = []
        procs.umount(self.path)


def _parents(name: str) -> list[str]:
    out, d = [], os.path.dirname(name)
    while d:
        out.append(d)
        d = os.path.dirname(d)
    return out


class _Run:
    """The I/O loop of one program: stdin in, capped stdout/stderr out, deadline, flood stop."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, limits: Limits, uid: int | None):
        self.proc, self.limits, self.uid = proc, limits, uid
        self.out = [bytearray(), bytearray()]
        self.timed_out = self.flooded = self.swept = False
        self.sel = selectors.DefaultSelector()
        self.pidfd = os.pidfd_open(proc.pid)
        self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.sel.register(proc.stdout, selectors.EVENT_READ, 0)
        self.sel.register(proc.stderr, selectors.EVENT_READ, 1)
        self.stdin = memoryview(stdin)
        if stdin:
            os.set_blocking(proc.stdin.fileno(), False)
            self.sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
        else:
            proc.stdin.close()

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read(self, key) -> None:
        data = os.read(key.fileobj.fileno(), 1 << 16)
        if not data:
            self.sel.unregister(key.fileobj)
            return
        buf = self.out[key.data]
        room = self.limits.output_bytes - len(buf)
        buf += data[:room]
        if len(data) > room and not self.flooded:
            self.flooded = True
            self._kill()

    def _write(self, key) -> None:
        try:
            n = os.write(key.fileobj.fileno(), self.stdin[: 1 << 16])
        except (BrokenPipeError, BlockingIOError) as e:
            n = 0 if isinstance(e, BlockingIOError) else len(self.stdin)
        self.stdin = self.stdin[n:]
        if not self.stdin:
            self.sel.unregister(key.fileobj)
            key.fileobj.close()

    def run(self, t0: float, timeout_s: float) -> float:
        """Drive the program started at ``t0`` to its end; returns its wall time (s)."""
        deadline, exited, wall = t0 + timeout_s, False, None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not exited:
                if self.timed_out:
                    raise RuntimeError(f"program {self.proc.pid} did not die within 5 s of SIGKILL")
                self.timed_out = True
                self._kill()
                deadline = time.monotonic() + 5.0  # time for the killed tree to go
                continue
            if exited and len(self.sel.get_map()) == 0:
                break
            if remaining <= 0:
                break  # a pipe is still open after the sweep: give up on it
            for key, _ in self.sel.select(remaining):
                if key.data == "exit":
                    self.sel.unregister(self.pidfd)
                    self.proc.wait()
                    wall = time.monotonic() - t0
                    # Daemons it left may still hold the pipes open: kill them now, then drain.
                    procs.sweep(self.uid)
                    self.swept = exited = True
                    deadline = time.monotonic() + 5.0
                elif key.data == "in":
                    self._write(key)
                else:
                    self._read(key)
        return wall if wall is not None else time.monotonic() - t0

    def close(self) -> None:
        self.sel.close()
        os.close(self.pidfd)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if not f.closed:
                f.close()


@dataclass(frozen=True)
class Mode:
    """How this worker applies the layers bubblewrap does not (found by :func:`probe`)."""

    worker_netns: bool = False
    """The worker itself sits in a private network namespace (root): programs share it, so no
    run pays for creating and tearing down one (bubblewrap gets ``--share-net``)."""
    netns_per_run: bool = False
    """Without bubblewrap: ``unshare`` a network namespace in each program's pre-exec."""
    seccomp_per_run: bool = False
    """Without bubblewrap: load the seccomp filter in each program's pre-exec."""
    private_mounts: bool = False
    """The worker has a mount namespace of its own: each run gets a fresh tmpfs capped in bytes
    and files (:class:`_Scratch`)."""


def run_job(cfg: WorkerConfig, job: Job, mode: Mode) -> SandboxResult:
    """Run ``job`` under ``cfg``'s layers, as ``mode`` says."""
    lang = LANGUAGES[job.language]
    files = {lang.filename: job.source, **job.files}
    nproc_base = 0 if cfg.uid is not None else procs.tasks_of_uid(os.getuid())
    limits = launch.rlimits(job.limits, nproc_base)
    fds: list[int] = []
    scratch = mounted = None
    try:
        if mode.private_mounts:
            mounted = _Scratch(files, job.limits, cfg.uid, bind_shared=not cfg.bwrap)
        if cfg.bwrap:
            names = {} if mounted else {name: _memfd(data) for name, data in files.items()}
            fds += names.values()
            seccomp_fd = _memfd(cfg.seccomp_bpf) if cfg.seccomp_bpf else None
            if seccomp_fd is not None:
                fds.append(seccomp_fd)
            argv = launch.bwrap_argv(cfg, lang, job, names, seccomp_fd, share_net=mode.worker_netns,
                                     scratch=mounted.path if mounted else None)
            cwd, env = "/", {"PATH": launch.ENV["PATH"]}
            setup = partial(launch.child_setup, cfg, limits, False, False)
        else:
            scratch = mounted.path if mounted else _scratch(files, cfg.uid)
            argv = [*lang.command, lang.filename]
            cwd, env = scratch, {**launch.ENV, "HOME": scratch, "TMPDIR": scratch}
            setup = partial(launch.child_setup, cfg, limits, mode.netns_per_run, mode.seccomp_per_run)
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env=env, pass_fds=fds, start_new_session=True, preexec_fn=setup)
        run = _Run(proc, job.stdin, job.limits, cfg.uid)
        try:
            wall = run.run(start, job.limits.timeout_s)
        finally:
            run.close()
            if not run.swept:  # an error cut the run short
                procs.sweep(cfg.uid)
        files_full, bytes_full = mounted.usage() if mounted else (False, False)
    finally:
        for fd in fds:
            os.close(fd)
        if mounted is not None:
            mounted.close()
        elif scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return replace(_result(proc.returncode, run, wall, bubblewrap=bool(cfg.bwrap)),
                   files_limit=mounted.limit if mounted else None, files_exceeded=files_full, scratch_full=bytes_full)


def _result(rc: int, run: _Run, wall: float, *, bubblewrap: bool) -> SandboxResult:
    signum = -rc if rc < 0 else None
    # bubblewrap reports a program killed by signal N as exit status 128 + N (as shells do).
    if bubblewrap and signum is None and 128 < rc < 128 + signal.NSIG:
        signum, rc = rc - 128, -(rc - 128)
    stdout, stderr = (bytes(b) for b in run.out)
    timed_out = run.timed_out or signum == signal.SIGXCPU
    return SandboxResult(
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        exit_code=rc, timed_out=timed_out,
        memory_exceeded=bool(_MEMORY.search(stderr[-4096:])),
        killed_signal=signum, wall_s=wall, truncated=run.flooded)


# ---- start-up probe: which layers hold --------------------------------------------------

PROBE = r"""
import json, os, resource, socket, sys
paths = json.loads(sys.stdin.read())
out = {"uid": os.getuid(), "pid": os.getpid(), "env": sorted(os.environ),
       "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0], "as": resource.getrlimit(resource.RLIMIT_AS)[0],
       "visible": [p for p in paths if os.path.exists(p)], "files": os.statvfs(".").f_ffree}
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    out["socket"] = "allowed"
except OSError as e:
    out["socket"] = e.strerror
try:
    out["ifaces"] = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
except OSError as e:
    out["ifaces"] = str(e)
try:
    open("/flowrl-probe", "w").close()
    out["root_writable"] = True
except OSError:
    out["root_writable"] = False
print(json.dumps(out))
"""


def _try_in_child(fn) -> str | None:
    """Run ``fn`` in a forked child: None if it worked, else its error message."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            fn()
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - report anything
            os.write(w, f"{type(e).__name__}: {e}".encode()[:1000])
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else (msg or f"exit status {status}")


def _probe_run(cfg: WorkerConfig, mode: Mode) -> tuple[dict | None, str]:
    paths = ["/root", "/etc/shadow", *cfg.project_dirs]
    job = Job(PROBE.encode(), "python", json.dumps(paths).encode(), {}, Limits(timeout_s=20.0))
    try:
        res = run_job(cfg, job, mode)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
    if res.exit_code != 0:
        return None, (res.stderr.strip() or f"exit code {res.exit_code}").splitlines()[-1]
    return json.loads(res.stdout), ""


def probe(cfg: WorkerConfig, subreaper: str | None) -> tuple[WorkerConfig, Mode, tuple[Layer, ...]]:
    """Find the layers that hold here: the config and :class:`Mode` to run with, and one
    :class:`Layer` per layer as a probe program saw it."""
    notes: dict[str, str] = {}
    if cfg.seccomp_bpf is None:
        notes["seccomp"] = "no filter: pyseccomp or libseccomp2 is not installed"
    worker_netns = False
    if os.geteuid() == 0:
        try:
            procs.unshare(procs.CLONE_NEWNET)  # this worker, and so every program it starts
            worker_netns = True
        except OSError as e:
            notes["network"] = f"unshare(CLONE_NEWNET) refused: {e}"
    mounts_err = private_mounts()
    if mounts_err:
        notes["files"] = f"no mount namespace for the worker ({mounts_err})"
    mode = Mode(worker_netns=worker_netns, private_mounts=mounts_err is None)
    if cfg.bwrap:
        seen, why = _probe_run(cfg, mode)
        if seen is None:
            cfg = replace(cfg, bwrap=None, no_bwrap_reason=f"bubblewrap fails here ({why})")
    if not cfg.bwrap:
        netns_err = None
        if not worker_netns:
            netns_err = _try_in_child(lambda: procs.unshare(procs.CLONE_NEWNET | procs.CLONE_NEWUSER))
            if netns_err:
                notes["network"] = f"unshare(CLONE_NEWUSER | CLONE_NEWNET) refused: {netns_err}"
        seccomp_err = "no filter" if cfg.seccomp_bpf is None else _try_in_child(lambda: load_filter(cfg.seccomp_bpf))
        if seccomp_err and cfg.seccomp_bpf is not None:
            notes["seccomp"] = f"prctl(PR_SET_SECCOMP) refused: {seccomp_err}"
        mode = Mode(worker_netns, netns_per_run=not worker_netns and netns_err is None,
                    seccomp_per_run=seccomp_err is None, private_mounts=mode.private_mounts)
        seen, why = _probe_run(cfg, mode)
        if seen is None:
            raise RuntimeError(f"sandbox worker cannot run a trivial program: {why}")
    return cfg, mode, _layers(cfg, mode, seen, notes, subreaper)


def _layers(cfg: WorkerConfig, mode: Mode, seen: dict, notes: dict[str, str],
            subreaper: str | None) -> tuple[Layer, ...]:
    default = Limits()
    uid_ok = cfg.uid is not None and seen["uid"] == cfg.uid
    rl_ok = seen["as"] == default.memory_mb * launch.MIB
    net_ok = seen["ifaces"] == ["lo"]
    sc_ok = seen["socket"] == os.strerror(1)
    fs_ok = bool(cfg.bwrap) and not seen["visible"] and not seen["root_writable"]
    env_ok = set(seen["env"]) <= set(launch.ENV) | launch.ENV_EXTRA
    tree = ["subreaper" if subreaper is None else f"NO subreaper ({subreaper})",
            "pid namespace" if cfg.bwrap else "no pid namespace", "kill by uid" if uid_ok else "no kill by uid"]

    def why(name: str, default_reason: str) -> str:
        return notes.get(name, default_reason)

    return (
        Layer("uid", uid_ok, f"programs run as uid {seen['uid']}" if uid_ok else why(
            "uid", f"not root: programs run as the caller's uid {seen['uid']}, and RLIMIT_NPROC counts the "
                   "caller's own tasks too (limit = their number + processes)")),
        Layer("rlimits", rl_ok, "CPU, address space, processes, file size, open files, core=0" if rl_ok
              else f"RLIMIT_AS is {seen['as']} in the program"),
        Layer("network", net_ok, "own network namespace (loopback only)" if net_ok
              else why("network", f"the program sees interfaces {seen['ifaces']}")),
        Layer("seccomp", sc_ok, "socket, ptrace, mount, namespaces, bpf, ... fail with EPERM" if sc_ok
              else why("seccomp", f"socket() gave {seen['socket']!r}")),
        Layer("filesystem", fs_ok, "bubblewrap: read-only /usr, private size-capped tmpfs /sandbox" if fs_ok
              else f"bubblewrap runs, yet the program sees {seen['visible']} (root writable: "
                   f"{seen['root_writable']})" if cfg.bwrap
              else f"{cfg.no_bwrap_reason}: programs see the host filesystem as their uid does (visible: "
                   f"{seen['visible']}); " + ("its writes land in its own tmpfs (see 'files')" if mode.private_mounts
                                           else "scratch is capped per file only")),
        Layer("files", mode.private_mounts and default.scratch_files <= seen["files"] <= default.scratch_files + 2,
              f"each run writes only to a tmpfs of its own ({default.scratch_mb} MiB, {default.scratch_files} files "
              "by default): scratch, /tmp" + (", /dev/shm" if cfg.bwrap else ", /var/tmp, /dev/shm, /run/lock")
              if mode.private_mounts else why("files", f"the probe saw {seen['files']} free files")
              + ": the number of files a program creates is not capped"),
        Layer("environment", env_ok, "scrubbed (PATH, HOME, TMPDIR, locale)" if env_ok
              else f"the program sees {seen['env']}"),
        Layer("process tree", subreaper is None, ", ".join(tree) + "; killed at the deadline"),
        Layer("output", True, "stdout/stderr capped; a flood stops the program"),
    )


def main() -> None:
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    # Keep stray prints (of this process or a library) out of the protocol stream.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    parent = os.getppid()
    procs.prctl(procs.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the pool died before the line above
        return
    try:
        procs.prctl(procs.PR_SET_CHILD_SUBREAPER, 1)
        subreaper = None
    except OSError as e:
        subreaper = str(e)
    cfg = recv(proto_in)
    if cfg is None:
        return
    if cfg.uid is not None:
        procs.sweep(cfg.uid)  # whatever a dead previous owner of this uid left
    try:
        cfg, mode, layers = probe(cfg, subreaper)
    except Exception as e:  # noqa: BLE001 - the pool raises it with this message
        send(proto_out, ("error", f"{type(e).__name__}: {e}"))
        return
    send(proto_out, ("ready", os.getpid(), layers))
    while True:
        job = recv(proto_in)
        if job is None:
            return
        try:
            result = run_job(cfg, job, mode)
        except Exception as e:  # noqa: BLE001 - report to the caller; the worker keeps serving
            result = ("error", f"{type(e).__name__}: {e}")
        send(proto_out, result)


if __name__ == "__main__":
    sys.exit(main())
