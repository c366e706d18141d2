"""``checkpoint``: safetensors files in a shared directory, then every replica reloads them.

For engines that cannot share a process group with the trainer (another cluster, a
serving fleet, a restarted replica) and for keeping each synced version on disk.

Layout of ``directory``::

    v00000007/manifest.json                format, version, files, each tensor's dtype, shape, bytes, CRC-32
    v00000007/weights-00000.safetensors    at most ``bucket_bytes`` of tensors per file
    LATEST                                 "v00000007": the newest complete version

Atomicity: a version is written into ``.v00000007.tmp-<pid>/``, every file is
fsync'ed, and only then is the directory renamed to ``v00000007`` (one atomic
``rename``) and ``LATEST`` replaced (write a temporary file, fsync, ``os.replace``).
A reader therefore sees the previous version or the new one, never half of one; a
sender killed mid-write leaves only a ``.tmp-`` directory, which readers never open
and the next sender on the directory deletes. One sender per directory.

The receiver checks the manifest's version against the handoff's and every
tensor's CRC-32 against the manifest (the same per-tensor checksum as the buckets of
:mod:`flowrl.runtime.weight_sync`), naming the tensor and file on a mismatch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import ClassVar, Iterator, NamedTuple

import torch

from flowrl.runtime.sync.base import NamedTensors, ProtocolStats, Timer, check_role, check_version, raw_bytes
from flowrl.runtime.weight_sync import CorruptedWeights, LostWeights, WeightSyncError, crc32

FORMAT = "flowrl-weights/1"
"""``format`` field of every manifest; a reader refuses others."""

_VERSION_DIR = re.compile(r"^v(\d{8})$")


class CheckpointHandoff(NamedTuple):
    """What the driver may forward to receivers: which version to read, and where."""

    version: int
    """Policy version written."""
    path: str
    """Absolute path of the version's directory (``.../v00000007``)."""


def version_dir(directory: Path, version: int) -> Path:
    """``directory/v{version:08d}``: where version ``version`` lives once complete."""
    return directory / f"v{version:08d}"


def _fsync(path: Path) -> None:
    """Flush a file's or directory's data and metadata to disk (a crash after this keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointSync:
    """Sender writes a version atomically; receivers read the latest (or the handed-off) version."""

    name: ClassVar[str] = "checkpoint"
    collective: ClassVar[bool] = False

    def __init__(self, role: str, *, directory: str | os.PathLike, keep: int = 1, bucket_bytes: int = 512 << 20,
                 fsync: bool = True):
        """Args:
            role: ``"sender"`` (train worker) or ``"receiver"`` (rollout worker).
            directory: the shared directory (every process must see the same files).
            keep: complete versions the sender keeps on disk (older ones are deleted), >= 1.
            bucket_bytes: largest safetensors file, bytes (a file holds at least one tensor).
            fsync: flush files before publishing them (turn off only on tmpfs, e.g. in benchmarks).
        """
        check_role(self.name, role)
        if not isinstance(keep, int) or keep < 1:
            raise WeightSyncError(f"checkpoint: keep={keep!r}; hint: keep at least 1 version")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise WeightSyncError(f"checkpoint: bucket_bytes={bucket_bytes!r}; hint: a positive file size in bytes")
        self.role = role
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.bucket_bytes = bucket_bytes
        self.fsync = fsync
        self.stats = ProtocolStats(protocol=self.name)
        self.version = -1
        self._outbox: CheckpointHandoff | None = None
        if role == "sender":
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()

    # ---- sender ------------------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Write ``named_tensors`` as version ``version`` and publish it atomically."""
        check_role(self.name, self.role, "sender")
        version = check_version(self.name, version)
        self.stats = stats = ProtocolStats(protocol=self.name, version=version)
        with Timer(stats):
            tmp = self.directory / f".v{version:08d}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                manifest = self._write_files(tmp, named_tensors, version, stats)
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
                if self.fsync:
                    for f in tmp.iterdir():
                        _fsync(f)
                    _fsync(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing was published; leave no debris
                raise
            final = self._publish(tmp, version)
        self.version = version
        self._outbox = CheckpointHandoff(version, str(final))
        return stats

    def _write_files(self, tmp: Path, named_tensors: NamedTensors, version: int, stats: ProtocolStats) -> dict:
        """Write the safetensors files; return the manifest (tensors in sending order)."""
        entries: list[dict] = []
        files: list[str] = []
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = 0
        storages: set[int] = set()
        seen: set[str] = set()
        for name, tensor in named_tensors:
            if name in seen:
                raise WeightSyncError(f"weight {name!r} appears twice in one sync; hint: names must be unique")
            seen.add(name)
            dtype_name, raw = raw_bytes(name, tensor)
            if shard and shard_bytes + raw.nbytes > self.bucket_bytes:
                stats.wire_bytes += self._save_shard(tmp, shard, files, version)
                shard, shard_bytes = {}, 0
            cpu = tensor.detach().to("cpu").contiguous()
            ptr = cpu.untyped_storage().data_ptr()
            if cpu.numel() and ptr in storages:  # tied weights share storage; safetensors refuses aliases
                cpu = cpu.clone()
            storages.add(cpu.untyped_storage().data_ptr())
            shard[name] = cpu
            shard_bytes += raw.nbytes
            entries.append({"name": name, "file": f"weights-{len(files):05d}.safetensors", "dtype": dtype_name,
                            "shape": list(cpu.shape), "nbytes": int(raw.nbytes), "crc32": crc32(raw)})
            stats.tensors += 1
            stats.bytes += int(raw.nbytes)
            stats.copied_bytes += int(raw.nbytes) if cpu.data_ptr() != tensor.data_ptr() else 0
        if shard or not files:
            stats.wire_bytes += self._save_shard(tmp, shard, files, version)
        stats.buckets = len(files)
        return {"format": FORMAT, "version": version, "files": files, "tensors": entries}

    def _save_shard(self, tmp: Path, shard: dict[str, torch.Tensor], files: list[str], version: int) -> int:
        from safetensors.torch import save_file

        name = f"weights-{len(files):05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": FORMAT, "version": str(version)})
        files.append(name)
        return (tmp / name).stat().st_size

    def _publish(self, tmp: Path, version: int) -> Path:
        """Rename the finished directory into place, point LATEST at it, prune old versions."""
        final = version_dir(self.directory, version)
        if final.exists():  # the same version re-sent (e.g. after a resume): swap the old one out first
            old = self.directory / f".{final.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        latest_tmp = self.directory / f".LATEST.tmp-{os.getpid()}"
        latest_tmp.write_text(final.name + "\n")
        if self.fsync:
            _fsync(latest_tmp)
        os.replace(latest_tmp, self.directory / "LATEST")
        if self.fsync:
            _fsync(self.directory)
        self._prune(version)
        return final

    def _prune(self, current: int) -> None:
        versions = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _VERSION_DIR.match(p.name)))
        stale = [v for v in versions if v != current][: max(0, len(versions) - self.keep)]
        for v in stale:
            shutil.rmtree(version_dir(self.directory, v), ignore_errors=True)

    def _remove_stale_temporaries(self) -> None:
        """Delete what a killed sender left (``.tmp-`` / ``.old-`` entries); readers never look at them."""
        for p in self.directory.iterdir():
            if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def handoff(self) -> CheckpointHandoff:
        """The version and path of the last :meth:`send` (receivers can also find it through ``LATEST``)."""
        check_role(self.name, self.role, "sender")
        if self._outbox is None:
            raise WeightSyncError("checkpoint: handoff() before send(); hint: call send(named_tensors, version) first")
        return self._outbox

    # ---- receiver ----------------------------------------------------------------------------
    def receive(self, handoff: CheckpointHandoff | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the tensors of ``handoff``'s version (default: ``LATEST``), each verified against the manifest."""
        check_role(self.name, self.role, "receiver")
        if handoff is not None and not isinstance(handoff, CheckpointHandoff):
            raise WeightSyncError(f"checkpoint: receive() got {type(handoff).__name__}; hint: pass the sender's "
                                  "CheckpointHandoff, or nothing to read LATEST")
        path = Path(handoff.path) if handoff is not None else self._latest()
        manifest = self._manifest(path)
        if handoff is not None and manifest["version"] != handoff.version:
            raise WeightSyncError(f"checkpoint: {path} holds version {manifest['version']}, the sender wrote "
                                  f"{handoff.version}; hint: the directory was overwritten by another sender")
        if handoff is None and manifest["version"] < self.version:
            raise WeightSyncError(f"checkpoint: LATEST is version {manifest['version']}, older than version "
                                  f"{self.version} already received; hint: another sender rewound {self.directory}")
        return self._read(path, manifest)

    def _latest(self) -> Path:
        try:
            name = (self.directory / "LATEST").read_text().strip()
        except FileNotFoundError:
            raise WeightSyncError(f"checkpoint: no LATEST in {self.directory}; hint: the sender has not completed "
                                  "a send() yet, or the directory is not the shared one") from None
        if not _VERSION_DIR.match(name):
            raise WeightSyncError(f"checkpoint: LATEST in {self.directory} reads {name!r}; hint: expected 'vNNNNNNNN'")
        return self.directory / name

    def _manifest(self, path: Path) -> dict:
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except FileNotFoundError:
            raise WeightSyncError(f"checkpoint: {path}/manifest.json is missing; hint: the version was deleted "
                                  "(raise `keep`) or never completed") from None
        except ValueError as error:
            raise WeightSyncError(f"checkpoint: {path}/manifest.json is not valid JSON ({error}); hint: the file "
                                  "was damaged after it was published") from None
        if manifest.get("format") != FORMAT:
            raise WeightSyncError(f"checkpoint: {path}/manifest.json has format {manifest.get('format')!r}; "
                                  f"hint: this reader understands {FORMAT!r}")
        return manifest

    def _read(self, path: Path, manifest: dict) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        self.stats = stats = ProtocolStats(protocol=self.name, version=manifest["version"])
        with Timer(stats):
            by_file: dict[str, list[dict]] = {}
            for entry in manifest["tensors"]:
                by_file.setdefault(entry["file"], []).append(entry)
            missing = [file for file in manifest["files"] if not (path / file).is_file()]
            if missing:
                raise LostWeights(f"checkpoint: {', '.join(missing)} of the {len(manifest['files'])} file(s) of "
                                  f"version {manifest['version']} in {path} never arrived; hint: the shared directory "
                                  "lost them, resend the sync")
            for file in manifest["files"]:
                try:
                    with safe_open(str(path / file), framework="pt") as f:
                        tensors = [(e, f.get_tensor(e["name"])) for e in by_file.get(file, [])]
                except (SafetensorError, OSError) as error:
                    raise WeightSyncError(f"checkpoint: {path / file} is unreadable ({error}); hint: the file was "
                                          "damaged or truncated after it was published") from None
                stats.wire_bytes += (path / file).stat().st_size
                stats.buckets += 1
                for entry, tensor in tensors:
                    _verify(entry, tensor, path / file)
                    stats.tensors += 1
                    stats.bytes += entry["nbytes"]
                    yield entry["name"], tensor
        self.version = manifest["version"]

    def close(self) -> None:
        """Nothing is held open between calls."""
        self._outbox = None


def _verify(entry: dict, tensor: torch.Tensor, file: Path) -> None:
    """Raise :class:`WeightSyncError` naming the tensor if its dtype, shape or CRC-32 differs from the manifest."""
    dtype_name, raw = raw_bytes(entry["name"], tensor)
    if dtype_name != entry["dtype"] or list(tensor.shape) != entry["shape"]:
        raise WeightSyncError(f"checkpoint: tensor {entry['name']!r} in {file} is {dtype_name} {list(tensor.shape)}, "
                              f"the manifest says {entry['dtype']} {entry['shape']}; hint: the file does not belong "
                              "to this manifest")
    got = crc32(raw)
    if got != entry["crc32"]:
        raise CorruptedWeights(f"checkpoint: tensor {entry['name']!r} in {file} is corrupted: crc32 {got:#010x}, "
                              f"expected {entry['crc32']:#010x}; hint: the file was damaged on disk or in transit")
