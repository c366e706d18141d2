"""Hugging Face hub ids (``hf("org/name")``) resolved from the local cache, offline.

flowrl never downloads: a hub id names a checkpoint that ``hf download org/name`` (or the
older ``huggingface-cli download org/name``) has put in the local Hugging Face cache. The
cache is huggingface_hub's (its folder: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``)::

    models--org--name/
      refs/main                     the commit hash the branch pointed at when downloaded
      snapshots/<hash>/config.json  the files of that commit (links into blobs/)
      blobs/...

Compile time (``flowrl check`` / ``plan``) reads the layout by hand (:func:`cached_snapshot`):
importing huggingface_hub's file API costs more than a second, and ``check`` answers in
milliseconds. Run time asks huggingface_hub itself (:func:`snapshot_path`,
``snapshot_download(local_files_only=True)``) and checks the weights are there. Where a
model is missing, the error names the command that downloads it (:func:`download_hint`).

A local directory always wins over a hub id of the same spelling (:func:`find_checkpoint`).

>>> is_hub_id("Qwen/Qwen3-0.6B"), is_hub_id("./models/tiny"), is_hub_id("/abs/path"), is_hub_id("a/b/c")
(True, False, False, False)
>>> repo_folder("Qwen/Qwen3-0.6B")
'models--Qwen--Qwen3-0.6B'
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
"""Files holding weights (safetensors, or PyTorch's pickles in older repositories)."""


class HubError(RuntimeError):
    """A hub id whose checkpoint is not (wholly) in the local cache; the message says how to get it."""


def is_hub_id(text: str) -> bool:
    """``org/name`` as the hub spells repositories (one slash, no leading ``.``, ``/`` or ``~``)."""
    return bool(_ID.match(text)) and not text.endswith((".json", ".jsonl", ".flow"))


def cache_dir() -> Path:
    """The hub cache folder, read from the environment as huggingface_hub reads it (each call)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expanduser(os.environ[var]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def repo_folder(repo_id: str) -> str:
    """The cache folder name of a model repository (``models--org--name``)."""
    return "models--" + repo_id.replace("/", "--")


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` (a branch or a commit hash) in the cache
    if it holds a ``config.json``; None otherwise. Reads files only (no huggingface_hub import)."""
    if not is_hub_id(repo_id):
        return None
    repo = cache_dir() / repo_folder(repo_id)
    commit = revision
    if not _COMMIT.match(revision):
        try:
            commit = (repo / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def find_checkpoint(written: str, local: str | Path) -> Path | None:
    """Where ``hf(written)``'s ``config.json`` is: the local directory ``local`` (``written``
    resolved against the flow file's folder) if it has one, else the cached snapshot of the hub
    id ``written``; None if neither."""
    local = Path(local)
    if (local / "config.json").is_file():
        return local
    return cached_snapshot(written)


def download_hint(repo_id: str, *, folder: bool = True) -> str:
    """How to put ``repo_id`` where flowrl reads it (on a machine with network access); ``folder``:
    name the cache folder (run-time messages; compile-time ones stay the same on every machine).

    >>> download_hint("org/name", folder=False)
    'put it in the local Hugging Face cache with `hf download org/name` (huggingface_hub >= 0.34; older: `huggingface-cli download org/name`), which flowrl reads (set HF_HOME or HF_HUB_CACHE to move it)'
    """
    where = f" at {cache_dir()}" if folder else ""
    return (f"put it in the local Hugging Face cache with `hf download {repo_id}` (huggingface_hub >= 0.34; "
            f"older: `huggingface-cli download {repo_id}`), which flowrl reads{where} (set HF_HOME or HF_HUB_CACHE "
            "to move it)")


def snapshot_path(repo_id: str) -> Path:
    """Run time: the complete local snapshot of ``repo_id`` (config, tokenizer, weights), found by
    huggingface_hub offline (``snapshot_download(local_files_only=True)``); :class:`HubError`
    with the download command when it or its weights are missing."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - transformers depends on huggingface_hub
        raise HubError(f"reading hub id {repo_id!r} from the local cache needs huggingface_hub ({e}); "
                       "`pip install huggingface_hub`") from None
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=str(cache_dir())))
    except LocalEntryNotFoundError:
        raise HubError(f"`{repo_id}` is not a local directory nor in the local Hugging Face cache; flowrl never "
                       "downloads: " + download_hint(repo_id)) from None
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any(p.name.endswith(WEIGHT_SUFFIXES) and p.exists() for p in path.iterdir()):
        missing.append("weights (*.safetensors)")
    if missing:
        raise HubError(f"the cached snapshot of `{repo_id}` ({path}) has no {', '.join(missing)}: the download was "
                       f"partial (e.g. `hf download {repo_id} config.json`); " + download_hint(repo_id))
    return path


__all__ = ["HubError", "is_hub_id", "cache_dir", "repo_folder", "cached_snapshot", "find_checkpoint",
           "download_hint", "snapshot_path", "WEIGHT_SUFFIXES"]
