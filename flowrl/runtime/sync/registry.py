"""Weight-sync protocols by name, built from their catalogue records.

Each :class:`~flowrl.catalog.protocols.ProtocolSpec` names the class implementing both
ends (``runtime``, ``module:Class``) and what carries its bytes on each platform
(``transport``). :data:`PROTOCOLS` maps every catalogue name to its class;
:func:`make_sync` builds one end, giving a class that takes a ``backend`` (a broadcast) the
record's transport on this machine's platform unless the caller (the plan) says otherwise.
Nothing here lists a protocol by name: a protocol added to the catalogue with an existing
class needs no code.

>>> PROTOCOLS["gloo"].__name__, PROTOCOLS["delta"].__name__
('BroadcastSync', 'DeltaSync')
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from flowrl.catalog.protocols import PROTOCOLS as RECORDS
from flowrl.catalog.protocols import ProtocolSpec
from flowrl.runtime.sync.base import WeightSync
from flowrl.runtime.weight_sync import WeightSyncError


def runtime_class(spec: ProtocolSpec) -> type:
    """Import the class the record names (``module:Class``)."""
    module, _, attr = spec.runtime.partition(":")
    return getattr(importlib.import_module(module), attr)


PROTOCOLS: dict[str, type] = {name: runtime_class(spec) for name, spec in RECORDS.items()}
"""Schedule protocol name -> the class implementing it (``cls(role, **options)``)."""


def machine_platform() -> str:
    """The platform this process runs on (:data:`~flowrl.catalog.platforms.PLATFORMS`)."""
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def record(name: str) -> ProtocolSpec:
    """The catalogue record of protocol ``name``, or :class:`WeightSyncError` with a suggestion."""
    spec = RECORDS.get(name)
    if spec is None:
        close = difflib.get_close_matches(str(name), RECORDS, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"protocols: {', '.join(sorted(RECORDS))}"
        raise WeightSyncError(f"unknown weight-sync protocol {name!r}; hint: {hint}")
    return spec


def protocol_class(name: str) -> type:
    """The class of protocol ``name`` (for ``collective``), or :class:`WeightSyncError` with a suggestion."""
    return PROTOCOLS[record(name).name]


def is_collective(name: str, **options: Any) -> bool:
    """Whether sender and receivers of protocol ``name`` run together (a ``delta``: as its ``inner`` does)."""
    cls = protocol_class(name)
    inner = options.get("inner")
    if getattr(cls, "wraps_inner", False):
        return is_collective(inner or cls.default_inner)
    return bool(cls.collective)


def sync_kwargs(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments :func:`make_sync` builds protocol ``name``'s class with: ``options``, checked
    against the class's parameters, plus the record's transport on this platform as the ``backend`` of a
    class that takes one and was given none."""
    cls = PROTOCOLS[record(name).name]
    params = inspect.signature(cls.__init__).parameters
    if "backend" in params and options.get("backend") is None:
        options = {**options, "backend": record(name).transport.get(machine_platform())}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [p for p in params if p not in ("self", "role")]
        for key in options:
            if key not in allowed:
                raise WeightSyncError(f"protocol `{name}` has no option {key!r}; hint: its options are "
                                      f"{', '.join(allowed)}")
    return options


def make_sync(name: str, role: str, **options: Any) -> WeightSync:
    """Build one end of protocol ``name``.

    Args:
        name: a catalogue protocol (:data:`PROTOCOLS`).
        role: ``"sender"`` (train worker) or ``"receiver"`` (rollout worker).
        options: the class's keyword arguments (``bucket_bytes``, ``rendezvous``, ``directory``, ...);
            a class taking ``backend`` gets the record's transport on this platform when none is given.

    Raises:
        WeightSyncError: unknown protocol or option, naming it with a hint.
    """
    return PROTOCOLS[record(name).name](role, **sync_kwargs(name, options))


def delta_carrier(transport: str) -> str:
    """The protocol that carries a ``delta``'s changed tensors over ``transport`` (a plan's transport):
    the first record marked ``carries_delta`` whose transport on some platform is ``transport``."""
    for spec in RECORDS.values():
        if spec.carries_delta and transport in spec.transport.values():
            return spec.name
    carriers = sorted({t for s in RECORDS.values() if s.carries_delta for t in s.transport.values()})
    raise WeightSyncError(f"no protocol carries a delta over transport {transport!r}; hint: transports that do: "
                          f"{', '.join(carriers)}")


__all__ = ["PROTOCOLS", "runtime_class", "machine_platform", "record", "protocol_class", "is_collective",
           "sync_kwargs", "make_sync", "delta_carrier"]
