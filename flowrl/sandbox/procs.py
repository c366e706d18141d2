"""Process-tree helpers of a sandbox worker: find, kill and reap everything a program left.

A worker sets ``PR_SET_CHILD_SUBREAPER``, so a program's orphans (double-forked,
``setsid``'d daemons) are re-parented to the worker rather than to PID 1: every process a
program starts stays a descendant of the worker, found by walking
``/proc/<pid>/task/<tid>/children``. Root workers additionally kill by uid (each worker
owns one unprivileged uid, so every process of that uid is the program's). Every kill goes
through a pidfd taken before the process is checked, so a pid reused in between is never
hit. Zombies are reaped at once: they count against RLIMIT_NPROC, and PID 1 here reaps
only every ~10 s.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option}, {arg})")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """``mount(2)``; OSError with the kernel's words on failure."""
    enc = (lambda v: None if v is None else v.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount({source!r}, {target!r}, {fstype!r}, {data!r})")


def umount(target: str) -> None:
    """Detach the mount at ``target`` (``umount2(MNT_DETACH)``)."""
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount2({target!r})")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads'), [] once it is gone."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _children_by_scan() -> dict[int, list[int]]:
    """ppid -> pids from ``/proc/*/stat``: the fallback where ``children`` files do not exist."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"
        tree.setdefault(ppid, []).append(int(name))
    return tree


HAVE_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def descendants(root: int) -> list[int]:
    """Every live or zombie descendant of ``root``, parents before children."""
    tree = None if HAVE_CHILDREN_FILES else _children_by_scan()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = children(pid) if tree is None else tree.get(pid, [])
        out += kids
        todo += kids
    return out


def reap() -> int:
    """Collect every exited child of this process; the number collected."""
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def _kill_pinned(pid: int, still_ours) -> int | None:
    """SIGKILL ``pid`` if ``still_ours(pid)`` holds once a pidfd pins it (so a reused pid is
    never hit); returns the pidfd (to wait on, then close) or None if nothing was signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None  # gone
    try:
        if still_ours(pid):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _wait_exit(fds: list[int], timeout: float) -> None:
    """Wait until every pidfd in ``fds`` reports its process exited (or ``timeout`` s), then close them."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline, left = time.monotonic() + timeout, set(fds)
    while left and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            poller.unregister(fd)
            left.discard(fd)
    for fd in fds:
        os.close(fd)


def kill_uid(uid: int) -> list[int]:
    """SIGKILL every live process of ``uid``; returns their pidfds (see :func:`_wait_exit`)."""
    def same_uid(pid: int) -> bool:
        return os.stat(f"/proc/{pid}").st_uid == uid

    return [fd for fd in (_kill_pinned(pid, same_uid) for pid in _pids_of_uid(uid)) if fd is not None]


def _state(pid: str) -> str:
    """The one-letter state of process ``pid`` ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    return chr(stat[stat.rindex(b")") + 2])


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose effective uid is ``uid``.

    Zombies are skipped: they run nothing, and one whose parent is not this process (a
    previous worker's, now re-parented to PID 1) cannot be reaped from here.
    """
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and _state(entry.name) not in ("Z", "X", ""):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def uid_has_processes(uid: int) -> bool:
    """Whether a live (not zombie) process has ``uid`` as its effective uid."""
    return bool(_pids_of_uid(uid))


def tasks_of_uid(uid: int) -> int:
    """Threads of every process of ``uid``: what RLIMIT_NPROC counts for it."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            n += int(stat[stat.rindex(b")") + 2 :].split()[17])  # field 20: num_threads
        except (OSError, ValueError, IndexError):
            pass
    return n


def sweep(uid: int | None) -> int:
    """Kill and reap every descendant of this process (and, as root, every process of ``uid``).

    Descendants first (a walk of this process's tree, no scan of ``/proc``), waiting until
    they have exited, then the uid: in the common case a program's processes are gone by
    then and one scan finds nothing. Loops until a round finds nothing, so a fork bomb
    caught mid-fork is finished too. Returns the number of processes signalled.
    """
    me, killed = os.getpid(), 0
    for _ in range(1000):
        pids = descendants(me)
        if pids:
            family = {me, *pids}
            fds = [fd for fd in (_kill_pinned(p, lambda q: _ppid(q) in family) for p in pids) if fd is not None]
        else:
            fds = kill_uid(uid) if uid is not None else []
            if not fds:
                return killed
        killed += len(fds)
        _wait_exit(fds, timeout=2.0)
        reap()
    raise RuntimeError(f"sandbox worker {me}: processes keep appearing after 1000 kill rounds")
