"""The small record types every catalogue table is written in.

Pure data: nothing here imports torch, Ray, an engine or the compiler, so the compiler
reads the catalogue in milliseconds and the runtime reads the same records.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KwSpec:
    """A keyword option. ``type`` is a scalar type, ``list``, ``size``, ``config`` or ``any``."""

    type: str
    default: object = None
    doc: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    required: bool = False
    requires: str = ""
    """Another option of the same call that must be given (and not empty) when this one is (E221)."""
    config: str = "loss"
    """For a ``config`` option: the table of configuration values it takes, a key of
    :data:`flowrl.catalog.ops.CONFIG_TABLES` (``loss``: ``ppo_clip(0.2)``...; ``adapter``: ``lora(r = 16)``)."""


@dataclass(frozen=True)
class ArgSpec:
    """A positional argument: a resource of ``type`` or a ``data`` value needing ``needs``."""

    name: str
    type: str  # "model" | "dataset" | "reward" | "env" | "data" | "str"
    needs: frozenset[str] = frozenset()
    optional: bool = False
    doc: str = ""
    choices: tuple[str, ...] = ()
    """For a ``str`` argument: the values it may take (empty: any string)."""


@dataclass(frozen=True)
class Support:
    """Whether something runs on one platform, and within which limits.

    ``limits`` caps options or parallel axes (``{"tp": 1}``: tensor parallelism is not
    available there); ``why`` says what stands in the way and what to use instead. A
    record with ``ok=False`` does not run on that platform at all.
    """

    ok: bool = True
    limits: dict = field(default_factory=dict)
    why: str = ""


RUNS = Support()
"""Runs, with no limits."""


def unsupported(why: str) -> Support:
    return Support(False, {}, why)


def limited(why: str, **limits: int) -> Support:
    return Support(True, dict(limits), why)


__all__ = ["KwSpec", "ArgSpec", "Support", "RUNS", "unsupported", "limited"]
