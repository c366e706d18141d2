"""State files a run reads back, in formats that cannot run code when read: JSON and safetensors.

A run directory may come from anyone (a shared file system, a bug report, a downloaded
checkpoint), and its manifest's CRC-32s are trivial to recompute; so nothing flowrl reads back
may be a pickle. :func:`write_state` writes a value as ``NAME.json`` (its structure: every
value tagged with its type) and, when it holds tensors or arrays, ``NAME.safetensors`` (their
data); :func:`read_state` reads it back equal, type for type (a tuple stays a tuple, a
``np.float32`` a ``np.float32``, a tensor keeps its dtype and shape; floats exactly, NaN and
infinities included), so a resumed run continues bit for bit.

What can be written is a closed list (:data:`DATACLASSES` and the builtin kinds below); anything
else is refused *when it is written* (:class:`StateFileError` naming where in the value it is),
so that a new kind of value never falls back to pickle silently. A file that is not what
:func:`write_state` wrote (damaged, replaced, a pickle) is refused with the file's name; nothing
in it is executed.

>>> import tempfile, torch; d = Path(tempfile.mkdtemp())
>>> value = {"ids": (1, 2), "x": float("nan"), "t": torch.arange(3)}
>>> [p.name for p in write_state(d / "s.json", value)]
['s.json', 's.safetensors']
>>> back = read_state(d / "s.json")
>>> back["ids"], back["t"].tolist(), back["x"] != back["x"]
((1, 2), [0, 1, 2], True)
>>> write_state(d / "bad.json", {"f": open})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
flowrl.runtime.statefile.StateFileError: cannot write .../bad.json: value['f'] is a builtin_function_or_method, ...
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import json
import math
import uuid
from pathlib import Path
from typing import Any

from flowrl.runtime.errors import RuntimeFlowError

FORMAT = "flowrl-state"
VERSION = 1
TAG = "$"
"""The key of a tagged value (every JSON object in a state file is one)."""

UNSAFE_SUFFIXES = (".pkl", ".pickle")
"""State files of older flowrl versions (pickles): refused, never loaded."""


class StateFileError(RuntimeFlowError):
    """A value a state file cannot hold (at write time), or a file that is not a state file (at read time)."""


def _dataclasses() -> dict[str, type]:
    """The records a state file may hold, by name (imported when first needed: no import cycle)."""
    from flowrl.engines.types import Completion, TokenBatch
    from flowrl.runtime.step import Rollouts, StepValue

    return {c.__name__: c for c in (StepValue, Rollouts, TokenBatch, Completion)}


DATACLASSES = ("StepValue", "Rollouts", "TokenBatch", "Completion")
"""The dataclasses a state file may hold (in-flight steps' values); any other class is refused."""

_SCALARS = (datetime.datetime, datetime.date, datetime.time, datetime.timedelta, decimal.Decimal, uuid.UUID)
"""Value types stored as their exact text (ISO 8601, a decimal's digits); a timedelta as its days, seconds, microseconds."""
_SCALAR_NAMES = {t.__name__: t for t in _SCALARS}

_NUMPY_KINDS = "biuf"
"""numpy dtype kinds stored (bool, signed, unsigned, float); object, string, date arrays are refused."""


# ---- writing -------------------------------------------------------------------------------------


def tensor_file(path: Path) -> Path:
    """The safetensors file beside a state file ``NAME.json``."""
    return path.with_suffix(".safetensors")


def write_state(path: Path, value: Any) -> list[Path]:
    """Write ``value`` to ``path`` (JSON) and its tensors to :func:`tensor_file` (only if it holds any);
    returns the files written. Refuses (:class:`StateFileError`) a value holding anything else than
    None, bool, int, float, str, bytes, list, tuple, dict, torch tensors, numpy arrays and scalars of
    numbers, dates and times, decimals, UUIDs, and the records of :data:`DATACLASSES`."""
    tensors: dict[str, Any] = {}
    try:
        doc = {"format": FORMAT, "version": VERSION, "value": _encode(value, tensors, "value")}
    except _Refused as refused:
        raise StateFileError(f"cannot write {path}: {refused}; a checkpoint holds only numbers, strings, "
                             f"bytes, dates and times, lists, tuples, dicts, tensors, numpy arrays and flowrl's step records "
                             f"({', '.join(DATACLASSES)}), never a pickle; hint: return one of those "
                             f"from the function that produced it") from None
    path.write_text(json.dumps(doc, allow_nan=False, separators=(",", ":")), encoding="utf-8")
    written = [path]
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, str(tensor_file(path)))
        written.append(tensor_file(path))
    return written


class _Refused(Exception):
    pass


def _encode(x: Any, tensors: dict, where: str) -> Any:
    t = type(x)
    if x is None or t in (bool, str, int):
        return x
    if t is float:
        return x if math.isfinite(x) else {TAG: "float", "v": repr(x)}
    if t is list:
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]
    if t is tuple:
        return {TAG: "tuple", "v": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]}
    if t is dict:
        if all(type(k) is str for k in x):
            return {TAG: "dict", "v": {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in x.items()}}
        return {TAG: "map", "v": [[_encode(k, tensors, f"{where} key {k!r}"), _encode(v, tensors, f"{where}[{k!r}]")]
                                  for k, v in x.items()]}
    if t is bytes:
        return {TAG: "bytes", "v": base64.b64encode(x).decode("ascii")}
    if t in _SCALARS:  # what a parquet dataset's rows may hold besides JSON's types (Arrow's dates, decimals)
        return {TAG: t.__name__, "v": str(x) if t in (decimal.Decimal, uuid.UUID) else
                ([x.days, x.seconds, x.microseconds] if t is datetime.timedelta else x.isoformat())}
    module = t.__module__.split(".")[0]
    if module == "torch":
        return _encode_tensor(x, tensors, where)
    if module == "numpy":
        return _encode_numpy(x, tensors, where)
    if dataclasses.is_dataclass(x) and t.__name__ in DATACLASSES and _dataclasses()[t.__name__] is t:
        return {TAG: t.__name__, "v": {f.name: _encode(getattr(x, f.name), tensors, f"{where}.{f.name}")
                                       for f in dataclasses.fields(x) if f.init}}
    raise _Refused(f"{where} is a {t.__name__}, which a state file cannot hold")


def _encode_tensor(x: Any, tensors: dict, where: str) -> dict:
    import torch

    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided or x.is_quantized:
        raise _Refused(f"{where} is a {type(x).__name__} (layout {getattr(x, 'layout', '?')}), which a state "
                       f"file cannot hold")
    key = str(len(tensors))
    tensors[key] = x.detach().to("cpu", copy=True).contiguous()  # a copy: views of one storage are saved apart
    out = {TAG: "tensor", "k": key}
    if x.device.type != "cpu":
        out["device"] = str(x.device)
    if x.requires_grad:
        out["grad"] = True
    return out


def _encode_numpy(x: Any, tensors: dict, where: str) -> dict:
    import numpy as np
    import torch

    if isinstance(x, np.ndarray) and type(x) is np.ndarray and x.dtype.kind in _NUMPY_KINDS:
        key = str(len(tensors))
        try:
            tensors[key] = torch.from_numpy(np.ascontiguousarray(x).copy())
        except TypeError as e:  # a dtype torch has no type for
            raise _Refused(f"{where} is a numpy array of {x.dtype} ({e})") from None
        return {TAG: "ndarray", "k": key}
    if isinstance(x, np.generic) and x.dtype.kind in _NUMPY_KINDS:
        return {TAG: "np", "dtype": x.dtype.str, "v": _encode(x.item(), tensors, where)}
    raise _Refused(f"{where} is a numpy {type(x).__name__} of {getattr(x, 'dtype', '?')}, which a state file "
                   f"cannot hold (numbers only)")


# ---- reading -------------------------------------------------------------------------------------


def read_state(path: Path) -> Any:
    """The value :func:`write_state` wrote to ``path``; a file that is not one (damaged, replaced, a
    pickle) is a :class:`StateFileError` naming it. Nothing in the file is executed: JSON and
    safetensors are parsed, and only the types :func:`write_state` writes are built."""
    reading = path
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if doc.get("version") != VERSION:
            raise ValueError(f"format version {doc.get('version')!r}, this flowrl reads {VERSION}")
        tensors: dict = {}
        if tensor_file(path).is_file():
            from safetensors.torch import load_file

            reading = tensor_file(path)
            tensors = load_file(str(reading))
        reading = path
        return _decode(doc["value"], tensors)
    except StateFileError:
        raise
    except Exception as e:  # JSON, UTF-8, safetensors' header, a missing key or tensor, a bad tag
        raise StateFileError(f"{reading} is not a state file this flowrl wrote ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else e!r}); hint: it was damaged or replaced: "
                             f"resume from another checkpoint (`--resume-step`), or start a new run") from None


def _decode(x: Any, tensors: dict) -> Any:
    if x is None or type(x) in (bool, str, int, float):
        return x
    if type(x) is list:
        return [_decode(v, tensors) for v in x]
    if type(x) is not dict:
        raise ValueError(f"unexpected JSON {type(x).__name__}")
    tag = x[TAG]
    if tag == "float":
        if x["v"] not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad float {x['v']!r}")
        return float(x["v"])
    if tag == "tuple":
        return tuple(_decode(v, tensors) for v in _list(x["v"]))
    if tag == "dict":
        if type(x["v"]) is not dict:
            raise ValueError("bad dict")
        return {k: _decode(v, tensors) for k, v in x["v"].items()}
    if tag == "map":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in _list(x["v"])}
    if tag == "bytes":
        return base64.b64decode(x["v"], validate=True)
    if tag in _SCALAR_NAMES:
        cls = _SCALAR_NAMES[tag]
        if cls is datetime.timedelta:
            days, seconds, micro = _list(x["v"])
            return datetime.timedelta(days=int(days), seconds=int(seconds), microseconds=int(micro))
        if type(x["v"]) is not str:
            raise ValueError(f"bad {tag}")
        return cls(x["v"]) if cls in (decimal.Decimal, uuid.UUID) else cls.fromisoformat(x["v"])
    if tag == "tensor":
        t = tensors[x["k"]]
        device = x.get("device")
        if device is not None and _device_available(device):
            t = t.to(device)
        return t.requires_grad_() if x.get("grad") is True else t
    if tag == "ndarray":
        return tensors[x["k"]].numpy()
    if tag == "np":
        import numpy as np

        dtype = np.dtype(x["dtype"])
        if dtype.kind not in _NUMPY_KINDS:
            raise ValueError(f"numpy dtype {dtype} is not stored")
        return dtype.type(_decode(x["v"], tensors))
    if tag in DATACLASSES:
        cls = _dataclasses()[tag]
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        if type(x["v"]) is not dict or not set(x["v"]) <= names:
            raise ValueError(f"bad {tag} fields")
        return cls(**{k: _decode(v, tensors) for k, v in x["v"].items()})
    raise ValueError(f"unknown tag {tag!r}")


def _list(v: Any) -> list:
    if type(v) is not list:
        raise ValueError("expected a list")
    return v


def _device_available(device: str) -> bool:
    import torch

    kind = device.split(":")[0]
    return kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())


def refuse_unsafe_files(directory: Path) -> None:
    """Refuse a checkpoint holding pickles (state files of an older flowrl), before anything loads it."""
    found = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                   if p.is_file() and p.suffix in UNSAFE_SUFFIXES)
    if found:
        raise StateFileError(f"checkpoint {directory} holds {', '.join(found)}: a pickle, written by an older "
                             f"flowrl; it is never loaded (a pickle can run code when read); hint: start a new "
                             f"run (without --resume)")


__all__ = ["StateFileError", "write_state", "read_state", "tensor_file", "refuse_unsafe_files", "DATACLASSES",
           "UNSAFE_SUFFIXES"]
