"""``delta``: send only the tensors that changed since the last sync, over another protocol.

For slow links (another region, a serving fleet behind a thin pipe) and for models
whose updates touch few tensors (LoRA-style training, frozen embeddings, a trainer
that updates only some layers). The first sync sends everything; later ones send
the tensors whose bytes changed, detected by:

* ``threshold = 0`` (default, exact): the tensor's CRC-32 differs from the one last
  sent. Costs one CRC pass over the weights on the sender and no copy; a changed
  tensor with an identical CRC-32 (probability 2^-32 per changed tensor) would be
  missed.
* ``threshold > 0`` (lossy): ``max |new - last sent| > threshold`` (a NaN counts as
  changed). The sender keeps a copy of every tensor as last sent, so drift below the
  threshold accumulates against that copy and is sent once it exceeds it: a receiver
  is never more than ``threshold`` (absolute, per element) from the trainer.

The changed tensors travel through an inner protocol (``inplace`` by default, or
``broadcast`` / ``checkpoint``), which verifies every bucket as usual. The first
tensor of each sync is a manifest (JSON in a uint8 tensor) with the version, the
version the delta is against, the changed names and the CRC-32 of *every* tensor
the receiver should now hold. The receiver keeps its own copy of the weights
(:attr:`DeltaSync.state`), applies the delta to it, and checks that the delta is
against the version it holds and that its copy's checksums match the manifest's,
so a missed or partial delta is caught, naming the tensor.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Iterator

import torch

from flowrl.runtime.sync.base import (
    NamedTensors,
    ProtocolStats,
    WeightSync,
    check_role,
    check_version,
    from_json_tensor,
    json_tensor,
    raw_bytes,
)
from flowrl.runtime.weight_sync import WeightSyncError, crc32

MANIFEST = "__flowrl_delta_manifest__"
"""Name of the manifest tensor that leads every delta (never a model weight name)."""

FULL = -1
"""``base`` of a sync that sends every tensor (the first one, or after :meth:`DeltaSync.reset`)."""


class DeltaSync:
    """Changed tensors only, over an inner protocol; both ends keep state between syncs."""

    name: ClassVar[str] = "delta"
    collective: bool = False
    """Each end runs as its inner protocol does (set from the inner protocol when built)."""
    wraps_inner: ClassVar[bool] = True
    """Its ends run as its inner protocol's do (collective or not)."""
    default_inner: ClassVar[str] = "inplace"
    """The inner protocol when none is named."""

    def __init__(self, role: str, *, inner: str | WeightSync | None = None, threshold: float = 0.0,
                 keep_copy: bool = True, **inner_options: Any):
        """Args:
            role: ``"sender"`` or ``"receiver"``.
            inner: the protocol that carries the changed tensors: a name in
                :data:`flowrl.runtime.sync.PROTOCOLS` (built with ``role`` and
                ``inner_options``) or an already built object of that role.
            threshold: 0 = exact change detection by CRC-32; > 0 = send a float tensor
                once it moved more than this (absolute, per element) from its last sent value.
            keep_copy: receiver: keep a full copy of the weights in :attr:`state`.
            inner_options: keyword arguments of the inner protocol (``bucket_bytes``,
                ``rendezvous``, ``directory``, ...).
        """
        from flowrl.runtime.sync.registry import make_sync  # the registry imports this module by name only

        check_role(self.name, role)
        inner = self.default_inner if inner is None else inner
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise WeightSyncError(f"delta: threshold={threshold!r}; hint: 0 for exact change detection, "
                                  "or a positive absolute tolerance")
        if isinstance(inner, str):
            if inner == self.name:
                raise WeightSyncError("delta: inner='delta'; hint: the inner protocol carries the tensors: "
                                      "inplace, broadcast or checkpoint")
            inner = make_sync(inner, role, **inner_options)
        elif inner_options:
            raise WeightSyncError(f"delta: options {sorted(inner_options)} given with an already built inner "
                                  "protocol; hint: pass them to the inner protocol instead")
        if getattr(inner, "role", None) != role:
            raise WeightSyncError(f"delta: the inner protocol's role is {getattr(inner, 'role', None)!r}, "
                                  f"this end is a {role}; hint: build both with the same role")
        self.role = role
        self.inner = inner
        self.collective = inner.collective
        self.threshold = float(threshold)
        self.keep_copy = keep_copy
        self.stats = ProtocolStats(protocol=self.name)
        self.version = -1
        self.state: dict[str, torch.Tensor] = {}
        """Receiver with ``keep_copy``: every weight as of :attr:`version` (CPU tensors)."""
        self._crcs: dict[str, int] = {}
        self._sent: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget the history: the next sync sends (sender) / accepts (receiver) every tensor."""
        self.version = -1
        self._crcs.clear()
        self._sent.clear()
        self.state.clear()

    # ---- sender ------------------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors, version: int) -> ProtocolStats:
        """Send the manifest and the tensors that changed since the last sync, through the inner protocol."""
        check_role(self.name, self.role, "sender")
        version = check_version(self.name, version)
        started = time.perf_counter()
        crcs: dict[str, int] = {}
        changed: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named_tensors:
            if name in crcs or name == MANIFEST:
                raise WeightSyncError(f"weight {name!r} appears twice in one sync (or uses a reserved name); "
                                      "hint: names must be unique")
            crc = crc32(raw_bytes(name, tensor)[1])
            if self._changed(name, tensor, crc):
                changed.append((name, tensor))
                crcs[name] = crc
            else:
                crcs[name] = self._crcs[name]
        detect_seconds = time.perf_counter() - started
        manifest = {"version": version, "base": self.version if self._crcs else FULL,
                    "changed": [n for n, _ in changed], "crcs": crcs}
        inner = self.inner.send([(MANIFEST, json_tensor(manifest))] + changed, version)
        self._commit(version, crcs, changed)
        self.stats = self._stats_from(inner, version, len(changed), len(crcs) - len(changed))
        self.stats.pack_seconds += detect_seconds
        self.stats.seconds = time.perf_counter() - started
        return self.stats

    def _changed(self, name: str, tensor: torch.Tensor, crc: int) -> bool:
        """Whether ``tensor`` must be sent: new, different bytes, and (lossy mode) moved past the threshold."""
        if self._crcs.get(name) is None:
            return True
        if crc == self._crcs[name]:
            return False
        last = self._sent.get(name)
        if self.threshold == 0 or last is None or not tensor.is_floating_point() or last.shape != tensor.shape \
                or last.dtype != tensor.dtype:
            return True
        diff = (tensor.detach().to("cpu", torch.float64) - last.to(torch.float64)).abs()
        return not bool((diff <= self.threshold).all())  # NaN compares False: a NaN is a change

    def _commit(self, version: int, crcs: dict[str, int], changed: list[tuple[str, torch.Tensor]]) -> None:
        """Record what the receivers now hold (only after the inner send succeeded)."""
        if self.threshold > 0:
            for name, tensor in changed:
                if tensor.is_floating_point():
                    self._sent[name] = tensor.detach().to("cpu").clone()
            self._sent = {n: t for n, t in self._sent.items() if n in crcs}
        self._crcs = crcs
        self.version = version

    def handoff(self) -> Any:
        """The inner protocol's handoff (forward it to every receiver)."""
        check_role(self.name, self.role, "sender")
        return self.inner.handoff()

    # ---- receiver ----------------------------------------------------------------------------
    def receive(self, handoff: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield only the changed tensors (load them in place); :attr:`state` then holds every weight."""
        check_role(self.name, self.role, "receiver")
        return self._receive(self.inner.receive(handoff))

    def _receive(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        started = time.perf_counter()
        try:
            manifest = self._read_manifest(pairs)
            expected = set(manifest["changed"])
            got: set[str] = set()
            for name, tensor in pairs:
                if name not in expected or name in got:
                    raise WeightSyncError(f"delta: tensor {name!r} arrived but the manifest of version "
                                          f"{manifest['version']} does not list it as changed (or lists it once); "
                                          "hint: sender and receiver disagree on the delta format")
                got.add(name)
                self._crcs[name] = manifest["crcs"][name]
                if self.keep_copy:
                    self.state[name] = tensor.clone()  # the inner protocol may hand out views of its buffers
                yield name, tensor
        finally:
            pairs.close()  # a collective inner protocol drains the rest of the sync off the wire
        self._check_complete(manifest, expected - got)
        changed = len(expected)
        self.stats = self._stats_from(self.inner.stats, manifest["version"], changed, len(manifest["crcs"]) - changed)
        self.stats.seconds = time.perf_counter() - started
        self.version = manifest["version"]

    def _read_manifest(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> dict:
        first = next(pairs, None)
        if first is None or first[0] != MANIFEST:
            raise WeightSyncError(f"delta: the sync starts with {first[0] if first else 'nothing'!r}, not the delta "
                                  "manifest; hint: the sender must use the delta protocol too")
        manifest = from_json_tensor(first[1])
        base = manifest["base"]
        if base != FULL and base != self.version:
            raise WeightSyncError(f"delta: version {manifest['version']} is a delta against version {base}, but this "
                                  f"receiver holds version {self.version}; hint: it missed a sync: call reset() on "
                                  "the sender so the next sync is complete")
        if base == FULL:
            self._crcs.clear()
            self.state.clear()
        return manifest

    def _check_complete(self, manifest: dict, missing: set[str]) -> None:
        """Every changed tensor arrived, and the receiver's copy has the checksums the sender's model has."""
        if missing:
            raise WeightSyncError(f"delta: version {manifest['version']} lists {sorted(missing)[0]!r} "
                                  f"(and {len(missing) - 1} more) as changed but it never arrived; "
                                  "hint: the inner transport dropped tensors")
        for name, crc in manifest["crcs"].items():
            held = self._crcs.get(name)
            if held != crc:
                held_text = "nothing" if held is None else f"crc32 {held:#010x}"
                raise WeightSyncError(f"delta: tensor {name!r}: this receiver holds {held_text}, the sender's "
                                      f"version {manifest['version']} has crc32 {crc:#010x}; hint: a delta was "
                                      "lost or applied twice: call reset() on both ends")
        for name in set(self._crcs) - set(manifest["crcs"]):  # removed from the model
            self._crcs.pop(name)
            self.state.pop(name, None)

    def _stats_from(self, inner: ProtocolStats, version: int, sent: int, skipped: int) -> ProtocolStats:
        return ProtocolStats(bytes=inner.bytes, buckets=inner.buckets, tensors=sent, copied_bytes=inner.copied_bytes,
                             pack_seconds=inner.pack_seconds,
                             unpack_seconds=inner.unpack_seconds, protocol=self.name, version=version,
                             seconds=inner.seconds, wire_bytes=inner.wire_bytes, skipped=skipped)

    def close(self) -> None:
        """Close the inner protocol."""
        self.inner.close()
