"""Checkpoints that cannot be lost: written atomically, checked before they are loaded.

A checkpoint ``RUN_DIR/checkpoints/step_NNNNNN/`` is written into ``step_NNNNNN.tmp/``; every
file is fsync'd, then ``manifest.json`` (each file's size in bytes and CRC-32) is written last
and fsync'd, and the directory is renamed into place (the parent fsync'd after). So a kill at
any moment leaves the previous checkpoints untouched, and a ``step_*`` directory without a
manifest is a half-written one (ignored, with a note). :func:`verify_checkpoint` re-reads every
file against the manifest; :func:`resumable_checkpoint` picks what ``--resume`` loads and, when
the newest checkpoint is damaged (a bit flip, a truncated file), names the file, both checksums
and the previous intact checkpoint with the exact command that resumes from it.

A full disk while writing (``ENOSPC``, on this process or a train engine's) removes the
temporary directory and raises :class:`CheckpointError` saying so; earlier checkpoints stay.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> ckpt = write_checkpoint(d / "checkpoints" / "step_000002", lambda tmp: (tmp / "a.bin").write_bytes(b"abc"))
>>> sorted(p.name for p in ckpt.iterdir())
['a.bin', 'manifest.json']
>>> verify_checkpoint(ckpt)
>>> (ckpt / "a.bin").write_bytes(b"abd") and None
>>> verify_checkpoint(ckpt)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
flowrl.runtime.checkpoints.CheckpointError: checkpoint .../step_000002 is damaged: a.bin has CRC-32 0x...
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Callable, Iterator

from flowrl.runtime.errors import RuntimeFlowError

MANIFEST = "manifest.json"
"""Written last into a checkpoint: ``{"format": 1, "files": {relative path: {"bytes", "crc32"}}}``."""
FORMAT = 1
_CHUNK = 1 << 20  # bytes read at a time when checksumming (1 MiB)


class CheckpointError(RuntimeFlowError):
    """A checkpoint that could not be written (disk full) or that fails its manifest check."""


def checkpoint_dir(out: Path, step: int) -> Path:
    """``out/checkpoints/step_NNNNNN``: the state after step ``step``."""
    return out / "checkpoints" / f"step_{step:06d}"


# ---- writing -------------------------------------------------------------------------------------


def write_checkpoint(final: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` fills a temporary directory; then fsync, manifest, rename to ``final``.

    An existing ``final`` (a step written again after resuming from an earlier one) is
    replaced only once the new one is complete. A failure (disk full included) removes the
    temporary directory; ENOSPC becomes a :class:`CheckpointError` naming the checkpoint.
    """
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        files = {}
        for path in sorted(_files(tmp)):
            size, crc = _checksum(path, sync=True)
            files[path.relative_to(tmp).as_posix()] = {"bytes": size, "crc32": f"{crc:#010x}"}
        manifest = tmp / MANIFEST
        with open(manifest, "w", encoding="utf-8") as f:
            f.write(json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        for d in sorted({p.parent for p in _files(tmp)} | {tmp}, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(d)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(error):
            previous = [p for p in complete_checkpoints(final.parent.parent) if p != final]
            kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint"
            raise CheckpointError(f"disk full while writing checkpoint {final} (ENOSPC); it was not written and "
                                  f"{kept}; hint: free space on that disk (or move the run directory), then "
                                  f"`flowrl run --resume {final.parent.parent}`") from error
        raise
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def disk_full(error: BaseException | None) -> bool:
    """``error`` (or what caused it, Ray's task errors unwrapped) is an OSError ENOSPC."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        cause = getattr(error, "cause", None)  # ray.exceptions.RayTaskError: the actor's exception
        error = cause if isinstance(cause, BaseException) else (error.__cause__ or error.__context__)
    return False


def _files(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*") if p.is_file())


def _checksum(path: Path, sync: bool = False) -> tuple[int, int]:
    """(bytes, CRC-32) of ``path``; ``sync``: fsync it too (it was just written)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, crc


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, new files) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- reading -------------------------------------------------------------------------------------


def step_of(path: Path) -> int | None:
    """The step of a ``step_NNNNNN`` directory name, else None (``.tmp``, ``.old``, other names)."""
    digits = path.name[len("step_"):]
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def complete_checkpoints(out: Path) -> list[Path]:
    """``out``'s checkpoints that have a manifest (written to the end), oldest first."""
    found = [p for p in (out / "checkpoints").glob("step_*") if p.is_dir() and step_of(p) is not None]
    return sorted((p for p in found if (p / MANIFEST).is_file()), key=step_of)


def half_written(out: Path) -> list[Path]:
    """``out``'s checkpoint directories a kill interrupted: ``step_*.tmp``, or ``step_N`` without a manifest."""
    def unfinished(p: Path) -> bool:
        return p.name.endswith(".tmp") or (step_of(p) is not None and not (p / MANIFEST).is_file())

    return sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir() and unfinished(p))


def verify_checkpoint(ckpt: Path) -> None:
    """Every file of ``ckpt``'s manifest is there with its size and CRC-32; else :class:`CheckpointError`
    naming the checkpoint, the file and what differs."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: its {MANIFEST} cannot be read "
                              f"({type(error).__name__}: {error})") from None
    for name, want in sorted(files.items()):
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {name} is missing (the manifest lists "
                                  f"{want['bytes']} bytes, CRC-32 {want['crc32']})")
        size, crc = _checksum(path)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {name} has {size} bytes, the manifest says "
                                  f"{want['bytes']} (truncated or overwritten); CRC-32 {crc:#010x}, "
                                  f"the manifest says {want['crc32']}")
        if f"{crc:#010x}" != want["crc32"]:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {name} has CRC-32 {crc:#010x}, the manifest says "
                                  f"{want['crc32']} (its {size} bytes changed after it was written)")


def resumable_checkpoint(out: Path, step: int | None = None, *,
                         note: Callable[[str], None] = lambda _: None) -> Path | None:
    """The checkpoint ``--resume`` loads: step ``step``'s, else the newest; verified against its manifest.

    None when there is no complete checkpoint. Half-written directories are skipped with a
    ``note``. A damaged checkpoint raises :class:`CheckpointError` naming it, the file and both
    checksums, and offering the newest earlier checkpoint that verifies, with its command.
    """
    for p in half_written(out):
        note(f"note: ignoring {p}: a checkpoint whose writing did not finish (no {MANIFEST})")
    ckpts = complete_checkpoints(out)
    if step is not None:
        chosen = [p for p in ckpts if step_of(p) == step]
        if not chosen:
            have = ", ".join(str(step_of(p)) for p in ckpts) or "none"
            raise CheckpointError(f"--resume-step {step}: {out} has no complete checkpoint of step {step}; "
                                  f"complete checkpoints: {have}")
        ckpts = ckpts[:ckpts.index(chosen[0]) + 1]
    if not ckpts:
        return None
    newest = ckpts[-1]
    try:
        verify_checkpoint(newest)
    except CheckpointError as damaged:
        earlier = None
        for p in reversed(ckpts[:-1]):
            try:
                verify_checkpoint(p)
                earlier = p
                break
            except CheckpointError:
                continue
        offer = (f"the previous intact checkpoint is step {step_of(earlier)}: "
                 f"`flowrl run --resume {out} --resume-step {step_of(earlier)}` continues from it"
                 if earlier is not None else "no earlier checkpoint is intact: start the run again")
        raise CheckpointError(f"{damaged}; {offer}") from None
    return newest


# ---- retention -----------------------------------------------------------------------------------


def retained(steps: list[int], *, keep_last: int, keep_best: int, scores: dict[int, float],
             protect: frozenset[int] = frozenset()) -> set[int]:
    """The checkpoint steps retention keeps of ``steps``: the newest ``keep_last`` (at least the newest
    one: a run resumes from it), the ``keep_best`` with the highest held-out accuracy among those with a
    score (``scores``: step -> ``eval/accuracy``; ties: the earlier step, which reached it first), and
    ``protect`` (the checkpoint a resumed run started from). ``keep_last = keep_best = 0``: all.

    >>> sorted(retained([2, 4, 6, 8], keep_last=1, keep_best=1, scores={2: 0.5, 4: 0.9, 6: 0.9, 8: 0.1}))
    [4, 8]
    >>> sorted(retained([2, 4, 6, 8], keep_last=2, keep_best=0, scores={}, protect=frozenset({2})))
    [2, 6, 8]
    """
    if keep_last <= 0 and keep_best <= 0:
        return set(steps)
    ordered = sorted(steps)
    keep = set(ordered[-max(keep_last, 1):]) | (set(protect) & set(steps))
    scored = sorted((s for s in ordered if s in scores), key=lambda s: (-scores[s], s))
    return keep | set(scored[:max(keep_best, 0)])


def prune_checkpoints(out: Path, *, keep_last: int, keep_best: int, scores: dict[int, float],
                      protect: frozenset[int] = frozenset(), note: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Delete ``out``'s complete checkpoints that :func:`retained` does not keep; returns those deleted.

    Only what flowrl wrote goes (a checkpoint listed in the run directory's list, :mod:`flowrl.runtime.rundir`);
    a checkpoint that is not listed, or is a link, is kept with a ``note``. Half-written directories are
    left to the next run's clean-up (a kill may have left them; ``--resume`` ignores them)."""
    from flowrl.runtime.rundir import PATH, listed

    ckpts = {step_of(p): p for p in complete_checkpoints(out)}
    keep = retained(list(ckpts), keep_last=keep_last, keep_best=keep_best, scores=scores, protect=protect)
    owned = listed(out)
    deleted = []
    for step in sorted(set(ckpts) - keep):
        path = ckpts[step]
        rel = path.relative_to(out).as_posix()
        if owned.get(rel) != PATH or path.is_symlink():
            note(f"note: retention keeps {path}: flowrl did not write it (not in the run directory's list)")
            continue
        (path / MANIFEST).unlink()  # first: a deletion cut short leaves a half-written checkpoint, never a "complete" one
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    if deleted:
        _fsync_dir(out / "checkpoints")
    return deleted


__all__ = ["MANIFEST", "CheckpointError", "checkpoint_dir", "write_checkpoint", "disk_full", "step_of",
           "complete_checkpoints", "half_written", "verify_checkpoint", "resumable_checkpoint", "retained",
           "prune_checkpoints"]
