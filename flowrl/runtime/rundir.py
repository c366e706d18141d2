"""What flowrl wrote in a run directory: the list it keeps there, and the only deletions it does.

A run directory ``RUN/`` holds ``RUN/.flowrl-owned``, one JSON object a line, ``{"path": "plan.json",
"kind": "path"}``: every entry flowrl wrote there, recorded *before* it is created (write-ahead), so
a crash never leaves a flowrl file that is not listed. Two kinds:

- ``path``: the entry and, if it is a directory, everything under it (a checkpoint, whose files the
  engines' ranks write; a tracker's folder, which its library fills);
- ``dir``: a directory flowrl made to hold listed entries (``checkpoints/``); what is in it is
  flowrl's only if listed itself.

Every deletion flowrl does in a run directory goes through :func:`remove_owned` (``--overwrite``,
the clean-up after a failed run): it walks the directory without following symbolic links (a link
is unlinked, never followed), deletes only listed entries, keeps everything else, and never
touches a directory that holds ``.git``. A listed path that leaves the directory (``../x``, an
absolute path) matches nothing. :func:`check_replaceable` is what ``--overwrite`` asks first: the
first entry that is not listed is named, and nothing is deleted.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> start(d); own(d, "plan.json"); (d / "plan.json").write_text("{}") and None
>>> (d / "notes.txt").write_text("mine") and None
>>> first_foreign(d)
'notes.txt'
>>> remove_owned(d)
['notes.txt']
>>> sorted(p.name for p in d.iterdir())
['notes.txt']

Imports only the standard library (the runtime, the launcher and the CLI all write through it).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path, PurePosixPath

LIST = ".flowrl-owned"
"""The list of what flowrl wrote, inside the run directory (itself flowrl's)."""
PATH, DIR = "path", "dir"
GIT = ".git"

_lock = threading.Lock()
_known: dict[str, tuple] = {}
"""Run directory (absolute) -> ((inode, size) of its list, what is listed): a path is appended once."""


class RunDirError(Exception):
    """A run directory flowrl may not replace or clean (a ``.git``, an entry it did not write, no list)."""


def tmp_sibling(path: Path) -> Path:
    """Where an atomic write of ``path`` writes first (renamed over ``path`` after)."""
    return path.with_name(path.name + ".tmp")


def start(out: Path) -> None:
    """Begin an empty list in ``out`` (a new or emptied run directory)."""
    with _lock:
        try:
            os.unlink(out / LIST)
        except FileNotFoundError:
            pass
        os.close(_open_list(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW))
        _known.pop(_key(out), None)


def is_listed(out: Path) -> bool:
    """``out`` has a list (a run directory written since flowrl keeps one); a link there is none."""
    try:
        return stat.S_ISREG(os.lstat(out / LIST).st_mode)
    except OSError:
        return False


def own(out: Path, *paths: str | Path, kind: str = PATH) -> None:
    """Record ``paths`` (relative to ``out``, or inside it) as flowrl's, before they are created.

    Each path's parent directories up to ``out`` are recorded as ``dir``. A path outside ``out``
    is not recorded (ValueError: a bug of the caller). Appends to the list (creating it if an
    older run directory has none) and flushes each line.
    """
    rels: list[tuple[str, str]] = []
    for p in paths:
        rel = _relative(out, Path(p))
        parts = PurePosixPath(rel).parts
        rels += [("/".join(parts[:i]), DIR) for i in range(1, len(parts))] + [(rel, kind)]
    with _lock:
        known = _listed_locked(out)
        lines = []
        for rel, k in rels:
            if known.get(rel) == PATH or known.get(rel) == k:
                continue
            known[rel] = PATH if PATH in (k, known.get(rel)) else DIR
            lines.append(json.dumps({"path": rel, "kind": known[rel]}) + "\n")
        if lines:  # appended, never through a link (a list replaced by one would write into its target)
            fd = _open_list(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)
            try:
                data = "".join(lines).encode("utf-8")
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
            _remember(out)


def _open_list(out: Path, flags: int) -> int:
    """The list's file descriptor; RunDirError when it cannot be written (a link put in its place, which
    ``O_NOFOLLOW`` refuses to write through, or a file system that refuses)."""
    try:
        return os.open(out / LIST, flags, 0o644)
    except OSError as e:
        raise RunDirError(f"{out / LIST} cannot be written ({e.strerror or type(e).__name__}): flowrl lists there "
                          "what it writes and writes nothing through a link; start a new run with --out") from None


def own_inside(out: Path, path: str | Path, kind: str = PATH) -> None:
    """:func:`own` ``path`` (relative to the working directory, as a setting is) if it lies inside
    ``out``; else nothing (a setting may point elsewhere)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(out))
    if _safe(Path(rel).as_posix()):
        own(out, rel, kind=kind)


def listed(out: Path) -> dict[str, str]:
    """The list of ``out`` as ``{relative posix path: kind}``; lines that do not parse, and paths
    that would leave ``out`` (absolute, ``..``, empty), are ignored."""
    if not is_listed(out):
        return {}
    try:
        fd = os.open(out / LIST, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        try:
            item = json.loads(line)
            rel, kind = item["path"], item.get("kind", PATH)
        except (ValueError, TypeError, KeyError):
            continue
        if not isinstance(rel, str) or kind not in (PATH, DIR) or not _safe(rel):
            continue
        found[rel] = PATH if PATH in (kind, found.get(rel)) else DIR
    return found


def first_foreign(out: Path) -> str | None:
    """The first entry of ``out`` (sorted, depth first) that flowrl did not write, else None."""
    return next(_foreign(out, "", listed(out)), None)


def check_replaceable(out: Path) -> None:
    """RunDirError unless everything in ``out`` is listed as flowrl's (and there is no ``.git``)."""
    if os.path.lexists(out / GIT):
        raise RunDirError(f"the directory holds {GIT}: flowrl never deletes anything in a directory with {GIT}")
    if not is_listed(out):
        raise RunDirError(f"the directory has no list of what flowrl wrote there ({LIST}: a run made before flowrl "
                          "kept one, or not a run), so flowrl cannot tell its files from yours; if it is an old run "
                          "you no longer need, delete it yourself (rm -r), or choose another --out")
    foreign = first_foreign(out)
    if foreign is not None:
        raise RunDirError(f"the directory holds {foreign}, which flowrl did not write; flowrl deletes only what it "
                          "wrote: move it away, or choose another --out")


def remove_owned(out: Path, remove_dir: bool = False) -> list[str]:
    """Delete what the list of ``out`` names (then the list); keep everything else.

    Returns the entries kept (relative paths, sorted), none of which flowrl wrote. A directory
    with ``.git`` is not touched at all (everything is kept). ``remove_dir``: also remove ``out``
    itself if it is then empty.
    """
    if not out.is_dir():
        return []
    if os.path.lexists(out / GIT):
        return sorted(e.name for e in os.scandir(out))
    with _lock:
        _known.pop(_key(out), None)
    kept = _remove(out, "", listed(out))
    try:
        (out / LIST).unlink()
    except FileNotFoundError:
        pass
    if remove_dir and not kept:
        try:
            out.rmdir()
        except OSError:
            pass
    return kept


# ---- the walks (never following a symbolic link) -------------------------------------------------

def _entries(out: Path, rel: str) -> list[os.DirEntry]:
    try:
        with os.scandir(out / rel if rel else out) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def _foreign(out: Path, rel: str, owned: dict[str, str]):
    for entry in _entries(out, rel):
        path = f"{rel}/{entry.name}" if rel else entry.name
        if not rel and entry.name == LIST:
            continue
        kind = owned.get(path)
        if kind is None or entry.name == GIT:
            yield path
        elif kind == DIR and entry.is_dir(follow_symlinks=False):
            yield from _foreign(out, path, owned)


def _remove(out: Path, rel: str, owned: dict[str, str]) -> list[str]:
    kept: list[str] = []
    for entry in _entries(out, rel):
        path = f"{rel}/{entry.name}" if rel else entry.name
        if not rel and entry.name == LIST:
            continue
        kind = owned.get(path)
        if kind is None:
            kept.append(path)
        elif kind == DIR and entry.is_dir(follow_symlinks=False):
            inner = _remove(out, path, owned)
            kept += inner
            if not inner:
                _quietly(os.rmdir, entry.path)
        else:
            _delete(entry.path)
    return kept


def _delete(path: str) -> None:
    """Unlink a file or symbolic link; remove a real directory with all it holds (links in it unlinked)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)  # never follows links (the fd-based rmtree)
    else:
        _quietly(os.unlink, path)


def _quietly(fn, path: str) -> None:
    try:
        fn(path)
    except OSError:
        pass


def _safe(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "." not in rel.split("/") \
        and "\\" not in rel and "\0" not in rel


def _relative(out: Path, path: Path) -> str:
    """``path`` (``out / ...``, an absolute path inside ``out``, or a path relative to ``out``) as a
    relative posix path; ValueError if it is outside."""
    try:
        rel = path.relative_to(out)
    except ValueError:
        rel = Path(os.path.relpath(os.path.abspath(path), os.path.abspath(out))) if path.is_absolute() else path
    text = rel.as_posix()
    if not _safe(text):
        raise ValueError(f"{path} is not inside the run directory {out}")
    return text


def _key(out: Path) -> str:
    return os.path.abspath(out)


def _listed_locked(out: Path) -> dict[str, str]:
    """The list as this process last read or wrote it, read again if the file changed under it."""
    key = _key(out)
    try:
        st = os.stat(out / LIST)
        stamp = (st.st_ino, st.st_size)
    except OSError:
        stamp = None
    cached = _known.get(key)
    if cached is None or cached[0] != stamp:
        cached = _known[key] = (stamp, listed(out))
    return cached[1]


def _remember(out: Path) -> None:
    try:
        st = os.stat(out / LIST)
        _known[_key(out)] = ((st.st_ino, st.st_size), _known[_key(out)][1])
    except (OSError, KeyError):
        pass


__all__ = ["LIST", "PATH", "DIR", "RunDirError", "tmp_sibling", "start", "is_listed", "own", "own_inside", "listed",
           "first_foreign", "check_replaceable", "remove_owned"]
