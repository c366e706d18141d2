"""The command line and the pre-exec set-up of one sandboxed program (worker side).

Layers, outermost first (each one holds even if a later one is missing):

1. rlimits (CPU, address space, processes, file size, open files, core dumps = 0),
   set in the forked child before anything else;
2. a network namespace: a root worker moves itself into a private one at start (its
   programs share it: no per-run cost); otherwise bubblewrap's ``--unshare-net``, or
   ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` here;
3. the worker's own unprivileged uid (``setgroups([])``, ``setresgid``, ``setresuid``) when
   the worker runs as root;
4. bubblewrap: new user/pid/ipc/uts/cgroup/mount namespaces, a read-only ``/usr`` and
   nothing else of the host, the run's tmpfs as ``/sandbox`` (also ``$HOME``, ``/tmp`` and
   ``/dev/shm``), a read-only ``/dev``, its own ``/proc``, a cleared environment; it dies
   with the worker. The tmpfs is mounted by the worker in its own mount namespace, capped
   in bytes and in files (``nr_inodes``); without bubblewrap it is the program's working
   directory and is bound over the host's world-writable directories in that namespace;
5. the seccomp filter (bubblewrap's ``--seccomp FD``, else ``prctl`` here).
"""

from __future__ import annotations

import math
import os
import resource
import signal

from flowrl.sandbox import procs
from flowrl.sandbox.seccomp import load_filter
from flowrl.sandbox.types import SCRATCH, Job, Language, Limits, WorkerConfig

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
       "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of a program (plus HOME and TMPDIR = its scratch directory)."""

ENV_EXTRA = frozenset({"HOME", "TMPDIR", "PWD", "LC_CTYPE"})
"""Variables a program may also see: its scratch directory, and what bubblewrap and Python add."""

MIB = 1 << 20


def rlimits(limits: Limits, nproc_base: int) -> dict[int, int]:
    """RLIMIT_* -> value for one run; ``nproc_base`` tasks of the uid that are not the program's."""
    cpu = math.ceil(limits.timeout_s) + 1
    return {
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_AS: limits.memory_mb * MIB,
        resource.RLIMIT_NPROC: nproc_base + limits.processes,
        resource.RLIMIT_FSIZE: limits.file_size_mb * MIB,
        resource.RLIMIT_NOFILE: limits.open_files,
        resource.RLIMIT_CORE: 0,
    }


def bwrap_argv(cfg: WorkerConfig, lang: Language, job: Job, fds: dict[str, int], seccomp_fd: int | None,
               *, share_net: bool, scratch: str | None = None) -> list[str]:
    """bubblewrap's command line: the view described in the module docstring, then the program.

    ``fds``: file name -> readable fd of its content (copied into the tmpfs by ``--file``);
    ``share_net``: stay in the worker's own (private) network namespace rather than make one;
    ``scratch``: the worker's own tmpfs for this run (capped in size and files, holding the
    files already), bound as the scratch directory and ``/dev/shm``; None: bubblewrap makes
    size-capped tmpfs mounts (their file count is not capped).
    """
    if scratch is None:
        writable = ["--size", str(4 * MIB), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                    "--size", str(job.limits.scratch_mb * MIB), "--tmpfs", SCRATCH]
    else:
        writable = ["--bind", scratch, "/dev/shm", "--remount-ro", "/dev", "--bind", scratch, SCRATCH]
    argv = [cfg.bwrap, "--unshare-all", *(["--share-net"] if share_net else []), "--unshare-user",
            "--disable-userns", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
            "--proc", "/proc", "--dev", "/dev", *writable, "--symlink", SCRATCH, "/tmp"]
    for name in sorted({os.path.dirname(n) for n in fds} - {""}):
        argv += ["--dir", f"{SCRATCH}/{name}"]
    for name, fd in fds.items():
        argv += ["--file", str(fd), f"{SCRATCH}/{name}"]
    argv += ["--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for key, value in {**ENV, "HOME": SCRATCH, "TMPDIR": SCRATCH}.items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--", *lang.command, lang.filename]


def child_setup(cfg: WorkerConfig, limits: dict[int, int], netns: bool, seccomp: bool) -> None:
    """Runs in the forked child before exec (``preexec_fn``): rlimits, netns, uid, seccomp.

    The order matters: limits first (they bind bubblewrap too), the network namespace
    while still privileged, the uid switch, and the parent-death signal after it (a
    credential change clears it), the seccomp filter last (it denies ``unshare``).
    """
    for res, value in limits.items():
        # CPU: the hard limit one second later, so that SIGXCPU (reported as a timeout) comes
        # before the hard limit's SIGKILL; the others: soft = hard.
        resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
    if netns:
        procs.unshare(procs.CLONE_NEWNET | procs.CLONE_NEWUSER)
    if cfg.uid is not None:
        os.setgroups([])
        os.setresgid(cfg.uid, cfg.uid, cfg.uid)
        os.setresuid(cfg.uid, cfg.uid, cfg.uid)
    procs.prctl(procs.PR_SET_PDEATHSIG, signal.SIGKILL)
    if seccomp:
        load_filter(cfg.seccomp_bpf)
