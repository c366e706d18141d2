"""Records shared by the sandbox pool (caller side) and its worker processes.

Everything here is plain data: it crosses the pipe between the pool and a worker as a
pickle, so it must stay importable without the rest of flowrl.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PYTHON = "/usr/bin/python3"
"""The interpreter sandboxed programs run under. Not ``sys.executable``: a virtualenv under
``/root`` (mode 0700) is unreadable after the switch to an unprivileged uid, and the
sandbox's read-only filesystem view only holds ``/usr``."""

SCRATCH = "/sandbox"
"""The program's working directory inside the bubblewrap view (also its ``$HOME`` and ``/tmp``)."""

SCRATCH_MOUNT = "/tmp"
"""Where a worker with a mount namespace of its own mounts each run's scratch tmpfs (in that
namespace only: the host's ``/tmp`` is untouched): the program's working directory without
bubblewrap, bound to :data:`SCRATCH` with it."""

SHARED_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock")
"""The host's other world-writable directories; without bubblewrap, the run's scratch tmpfs is
bound over each (in the worker's mount namespace), so the program's writes land in its own capped space."""


@dataclass(frozen=True)
class Language:
    """How to run a program of one language: its file name and the command that runs it."""

    filename: str
    """Name the source is written to in the scratch directory."""
    command: tuple[str, ...]
    """argv before the file name; absolute paths under ``/usr`` (the sandbox sees nothing else)."""


LANGUAGES: dict[str, Language] = {
    # -E: ignore PYTHON* variables; -S: no site module (the standard library only, and ~5 ms
    # less per start than importing site and its .pth hooks); -B: write no .pyc files.
    "python": Language("main.py", (PYTHON, "-E", "-S", "-B")),
    "bash": Language("main.sh", ("/usr/bin/bash", "--norc", "--noprofile")),
}


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run. Every limit binds every process the program starts."""

    timeout_s: float = 5.0
    """Wall-clock deadline; at it the whole process tree is killed (CPU time is capped at
    ``ceil(timeout_s) + 1`` s per process as a second line)."""
    memory_mb: int = 256
    """Address space per process (RLIMIT_AS), MiB: a larger allocation fails (Python: MemoryError)."""
    processes: int = 64
    """Processes + threads of the run (RLIMIT_NPROC of the worker's uid): fork bombs stop here."""
    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), MiB."""
    scratch_mb: int = 64
    """Size of the program's writable space, MiB: its scratch directory, a tmpfs of its own (with
    or without bubblewrap) that is also its ``/tmp``, ``/var/tmp`` and ``/dev/shm``; where the
    worker cannot mount one (no mount namespace) only ``file_size_mb`` per file binds."""
    scratch_files: int = 4096
    """Files, directories and links the program may create in its writable space (the tmpfs's
    ``nr_inodes``): each costs kernel memory whatever its size, so a loop creating empty
    directories stops here with ENOSPC (``SandboxResult.files_exceeded``)."""
    open_files: int = 128
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; a program that writes more is stopped
    (``SandboxResult.truncated``)."""

    def check(self) -> "Limits":
        """``self``, or ValueError naming the first limit out of range."""
        bounds = {"timeout_s": (0.01, 3600), "memory_mb": (32, 1 << 20), "processes": (4, 1 << 16),
                  "file_size_mb": (1, 1 << 20), "scratch_mb": (1, 1 << 20), "scratch_files": (16, 1 << 24), "open_files": (16, 1 << 20),
                  "output_bytes": (1, 1 << 30)}
        for name, (lo, hi) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(f"sandbox limit {name}={value!r} is out of range; give a number in [{lo}, {hi}]")
        return self


@dataclass(frozen=True)
class Job:
    """One program to run."""

    source: bytes
    language: str
    stdin: bytes
    files: dict[str, bytes]
    """Extra files for the scratch directory: relative path -> content."""
    limits: Limits


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did. Output is decoded as UTF-8 with U+FFFD for invalid bytes."""

    stdout: str
    """At most ``Limits.output_bytes`` bytes of the program's standard output."""
    stderr: str
    """At most ``Limits.output_bytes`` bytes of its standard error."""
    exit_code: int
    """The exit status; ``-N`` when a signal N ended the program (as ``subprocess`` reports it)."""
    timed_out: bool
    """The deadline (or the CPU-time limit) stopped the program."""
    memory_exceeded: bool
    """An allocation hit the memory limit (Python's ``MemoryError``; ``Cannot allocate memory``
    or ``std::bad_alloc`` on stderr)."""
    killed_signal: int | None
    """The signal that ended the program (9 for a deadline or an output flood), else None."""
    wall_s: float
    """Seconds from start to the end of the program's process tree."""
    truncated: bool = False
    """stdout or stderr passed ``Limits.output_bytes``: the program was stopped there."""
    files_limit: int | None = None
    """How many files/directories the program could create in its writable space
    (``Limits.scratch_files``), or None where that cap is not in force (the worker has no mount
    namespace: see the ``files`` layer of the self-check)."""
    files_exceeded: bool = False
    """The program used up ``files_limit``: its next create failed with ENOSPC."""
    scratch_full: bool = False
    """The program filled its writable space's ``Limits.scratch_mb`` (ENOSPC)."""

    @property
    def ok(self) -> bool:
        """Exited with status 0 on its own."""
        return self.exit_code == 0 and not self.timed_out and not self.truncated


@dataclass(frozen=True)
class Layer:
    """One isolation layer and whether it is in force, as the worker's start-up probe saw it."""

    name: str
    active: bool
    detail: str
    """What is in force, or why not (the kernel's or the tool's own words where there are some)."""


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to know to run jobs; sent as its first message."""

    uid: int | None
    """The unprivileged uid its programs run as (None: not root, programs keep the caller's uid)."""
    bwrap: str | None
    """Path of the bubblewrap binary, or None to run without the filesystem/pid-namespace layer."""
    no_bwrap_reason: str
    """Why ``bwrap`` is None (for the self-check's report)."""
    seccomp_bpf: bytes | None
    """The compiled seccomp filter (``struct sock_filter[]``), or None when it could not be built."""
    project_dirs: tuple[str, ...] = field(default_factory=tuple)
    """Host directories the start-up probe checks are hidden from programs (e.g. the project)."""
