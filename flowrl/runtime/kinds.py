"""The runtime's builder of a resource (dataset, reward, environment), found through its op's record.

A resource plan names its op (``jsonl``, ``python_reward``, ``python_env`` ...); the op's
catalogue record (:class:`~flowrl.catalog.ops.OpSpec`) gives its kind and ``handler``, and the
runtime module of that kind keeps a table ``handler -> builder``. :func:`builder_for` is that
look-up, with the two errors it can meet: a name that is not of the kind, and a record whose
handler the runtime lacks (``tests/catalog/test_pairing.py`` checks that none does).
"""

from __future__ import annotations

from typing import Callable, Mapping

from flowrl.catalog.ops import OPS, OpKind
from flowrl.runtime.errors import RuntimeFlowError


def builder_for(name: str, kind: OpKind, table: Mapping[str, Callable], origin: str, *, noun: str, listing: str,
                things: str) -> Callable:
    """``table[OPS[name].handler]``, or a :class:`RuntimeFlowError` at ``origin``.

    ``noun`` names one of the kind, with its article, in the first error (``"a dataset format"``), ``listing`` its
    list of known names (``"formats"``), ``things`` the resources in the second (``"datasets"``).

    >>> builder_for("jsonl", OpKind.DATASET, {"jsonl": len}, "d.flow:1:1", noun="a dataset format",
    ...             listing="formats", things="datasets")
    <built-in function len>
    >>> builder_for("csv", OpKind.DATASET, {}, "d.flow:1:1", noun="a dataset format", listing="formats",
    ...             things="datasets")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    flowrl.runtime.errors.RuntimeFlowError: d.flow:1:1: `csv` is not a dataset format; formats: ...jsonl, ...parquet...
    """
    spec = OPS.get(name)
    if spec is None or spec.kind != kind:
        raise RuntimeFlowError(f"{origin}: `{name}` is not {noun}; {listing}: "
                               f"{', '.join(sorted(k for k, s in OPS.items() if s.kind == kind))}")
    build = table.get(spec.handler)
    if build is None:
        raise RuntimeFlowError(f"{origin}: `{name}` {things} have no runtime builder `{spec.handler}`; "
                               "`flowrl check` refuses them by their record's platforms, so this plan was not made "
                               "by this version's compiler")
    return build


__all__ = ["builder_for"]
