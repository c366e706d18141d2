"""The sandbox's seccomp filter: build it once (libseccomp via ``pyseccomp``), load it anywhere.

The filter allows every system call except those a test program never needs and an
escape would: sockets (no network at all, not even to a host's abstract Unix sockets),
tracing and reading other processes, namespaces and mounts, kernel keyrings, BPF, perf,
io_uring (its operations bypass seccomp), modules, reboot and clock setting. A denied
call fails with ``EPERM`` (``clone3`` with ``ENOSYS``, so that glibc falls back to
``clone``, whose namespace flags are then checked). ``kill(-1, ...)`` is denied too: it
would reach every process of the uid. System calls of another ABI (i386 ``int 0x80``,
x32) kill the process (libseccomp's default for a foreign architecture).

The compiled program (``struct sock_filter[]``, 8 bytes per instruction) is handed to
bubblewrap (``--seccomp FD``) or loaded with ``prctl(PR_SET_SECCOMP)`` by
:func:`load_filter` (no libseccomp needed where it is loaded).

>>> bpf = build_filter()
>>> len(bpf) % 8 == 0 and len(bpf) > 8 * len(DENIED)
True
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile

DENIED: tuple[str, ...] = (
    "socket", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr",
    "open_by_handle_at", "name_to_handle_at",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "fanotify_init", "lookup_dcookie", "iopl", "ioperm", "modify_ldt", "uselib",
)
"""System calls that fail with EPERM inside the sandbox."""

CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                         0x40000000, 0x00000080)
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME: ``clone`` with any fails."""


class SeccompUnavailable(RuntimeError):
    """The filter cannot be built here (no pyseccomp / libseccomp); the message says why."""


def build_filter() -> bytes:
    """The compiled filter for this machine's architecture."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # OSError: libseccomp.so.2 missing
        raise SeccompUnavailable(f"pyseccomp/libseccomp unavailable ({e}); fix: pip install pyseccomp "
                                 "and apt-get install libseccomp2") from None
    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        f.add_rule(eperm, name)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NAMESPACE_FLAGS:
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # pid_t is 32 bits: compare the low half, whatever the caller left in the upper one.
    f.add_rule(eperm, "kill", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, 0xFFFFFFFF))
    with tempfile.TemporaryFile() as tmp:
        f.export_bpf(tmp)
        tmp.seek(0)
        return tmp.read()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def load_filter(bpf: bytes) -> None:
    """Install ``bpf`` on the calling thread (and everything it execs); sets no_new_privs first."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS): " + os.strerror(ctypes.get_errno()))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP): " + os.strerror(ctypes.get_errno()))
