"""What a model directory must hold for flowrl's engines to load it, read as data (no torch, nothing loaded).

``flowrl check`` (:mod:`flowrl.compiler.passes.check_resources`) and the runtime
(:mod:`flowrl.runtime.materialize`, before any engine starts) apply the same rule to the
checkpoint an ``hf(...)`` names, a local directory or a hub snapshot:

* ``config.json`` parses (:mod:`flowrl.catalog.models`) and names an architecture of the
  catalogue (:func:`~flowrl.catalog.architectures.architecture_of`: by ``architectures[0]``, else
  ``model_type``);
* weights, as safetensors only: ``model.safetensors``, or ``model.safetensors.index.json`` whose
  every shard exists, each file's header intact (its 8-byte length and JSON header read, and the
  tensors' byte ranges inside the file: a truncated download is caught here). PyTorch's pickles
  (``pytorch_model.bin``) are refused: reading one can run code, and flowrl reads no format that can;
* a tokenizer the loaders read (:data:`TOKENIZER_FILES`).

:func:`checkpoint_problems` returns what is wrong, each with a fix; :func:`tokenizer_fingerprint`
names a tokenizer by its content, to tell whether two models read the same token ids.

>>> import json, struct, tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
>>> [p.what for p in checkpoint_problems(d)]
['config']
>>> _ = (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
...     "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10}))
>>> [p.what for p in checkpoint_problems(d)]
['weights', 'tokenizer']
>>> header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
>>> _ = (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
>>> print(weight_problems(d)[0].reason)
model.safetensors is truncated: its tensors end at byte 8 of the data, which holds 4 bytes
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from flowrl.userfiles import read_bounded

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")
"""Weight files that are Python pickles (``torch.load`` of one can execute code)."""
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
"""What transformers' ``AutoTokenizer`` builds a tokenizer from, each a set of files that suffices:
a fast tokenizer's ``tokenizer.json``, a SentencePiece model, a byte-level BPE's vocabulary and merges, a
WordPiece vocabulary."""
MAX_HEADER_BYTES = 100 << 20
"""The safetensors library's own limit on a header (100 MB): a larger length is a damaged file."""

CONVERT_HINT = ("convert it to safetensors once, where you trust the file: `python -c \"import transformers as t; "
                "t.AutoModelForCausalLM.from_pretrained('DIR').save_pretrained('DIR')\"` (save_pretrained writes "
                "model.safetensors); flowrl never reads a weight format that can execute code")


TOKENIZER_READ_BYTES = 256 << 20
"""The largest tokenizer file (or weight index) read whole (real ones are tens of MB): a check stays bounded."""
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,79}")
"""What a config's architecture name may look like to be quoted in a diagnostic."""

@dataclass(frozen=True)
class FileProblem:
    """Why a model directory cannot be loaded as it is."""

    what: str
    """``config``, ``weights`` or ``tokenizer``."""
    reason: str
    """What is wrong, naming the file (relative to the directory)."""
    fix: str
    """What to do about it."""
    partial: bool = False
    """Files are missing or cut short: a partial or damaged copy, which fetching it again cures (not so a
    pickle or an architecture flowrl does not know)."""


def checkpoint_problems(folder: str | Path, *, tokenizer: bool = True) -> list[FileProblem]:
    """What keeps ``folder`` from loading (empty: it loads); see the module docstring. ``tokenizer``:
    whether a tokenizer is needed (a checkpoint whose token ids come from another model's tokenizer
    needs none of its own, but every ``hf(...)`` model needs one today)."""
    folder = Path(folder)
    out = config_problems(folder)
    if out:
        return out  # not a checkpoint of a model flowrl knows: what else it lacks is beside the point
    out += weight_problems(folder)
    if tokenizer:
        problem = tokenizer_problem(folder)
        if problem is not None:
            out.append(problem)
    return out


def config_problems(folder: Path) -> list[FileProblem]:
    """``config.json`` is a decoder config of an architecture of the catalogue."""
    from flowrl.catalog.architectures import ARCHITECTURES, architecture_of
    from flowrl.catalog.models import ConfigError, from_config, read_config

    try:
        cfg = read_config(folder / "config.json")
        from_config(folder)
    except ConfigError as e:
        return [FileProblem("config", str(e), "point hf(...) at a directory written by a transformers model's "
                                              "`save_pretrained(dir)`", partial=True)]
    if architecture_of(cfg) is None:
        named = (cfg.get("architectures") or [None])[0] or cfg.get("model_type") or "no architecture"
        if not (isinstance(named, str) and _NAME.fullmatch(named)):  # quote a class name, never other text
            named = "an unreadable name"
        return [FileProblem("config", f"config.json names {named}, an architecture flowrl does not know",
                            f"flowrl runs {', '.join(sorted(ARCHITECTURES))} (and their sequence-classification "
                            "heads, by `model_type`)")]
    return []


def weight_problems(folder: Path) -> list[FileProblem]:
    """Safetensors weights are there, whole (see the module docstring)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(read_bounded(index, TOKENIZER_READ_BYTES))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [FileProblem("weights", f"{SAFETENSORS_INDEX} cannot be read as an index ({e})",
                                "write the checkpoint again with `save_pretrained(dir)`")]
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return [FileProblem("weights", f"{SAFETENSORS_INDEX} names {len(shards)} shard(s), and "
                                           f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                                           f"{'is' if len(missing) == 1 else 'are'} missing",
                                "the download or copy was partial: fetch the missing shards", partial=True)]
        files = [folder / s for s in shards]
    elif (folder / SAFETENSORS).is_file():
        files = [folder / SAFETENSORS]
    else:
        pickles = [p for p in PICKLES if (folder / p).is_file()]
        if pickles:
            return [FileProblem("weights", f"the weights are {pickles[0]}, a PyTorch pickle (loading one can run "
                                           "code), and there is no model.safetensors",
                                CONVERT_HINT.replace("DIR", str(folder)))]
        return [FileProblem("weights", f"no weights: neither {SAFETENSORS} nor {SAFETENSORS_INDEX}",
                            "save the model with `save_pretrained(dir)` (it writes model.safetensors), or finish "
                            "the download", partial=True)]
    out = []
    for f in files:
        reason = header_problem(f)
        if reason is not None:
            out.append(FileProblem("weights", reason, "the file is damaged or was cut short: copy or download it "
                                                      "again", partial=True))
    return out


def header_problem(path: Path) -> str | None:
    """Why a safetensors file is not whole, from its header alone; None if it is."""
    try:
        stat = path.stat()
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror})"
    return _header_problem(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=256)
def _header_problem(path: str, size: int, mtime: int) -> str | None:
    name = Path(path).name
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{name} is not a safetensors file: {size} bytes, shorter than its header's length"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                return f"{name} is not a safetensors file or is truncated: its header claims {n} bytes of {size}"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    except (ValueError, UnicodeDecodeError):
        return f"{name}'s header is not JSON: the file is damaged"
    if not isinstance(header, dict):
        return f"{name}'s header is not a JSON object: the file is damaged"
    data = size - 8 - n
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"{name}'s header entry {key!r} has no byte range: the file is damaged"
        end = max(end, offsets[1])
    if end > data:
        return f"{name} is truncated: its tensors end at byte {end} of the data, which holds {data} bytes"
    return None


def tokenizer_problem(folder: Path) -> FileProblem | None:
    """None if ``folder`` holds one of :data:`TOKENIZER_FILES`' sets."""
    if any(all((folder / f).is_file() for f in group) for group in TOKENIZER_FILES):
        return None
    return FileProblem("tokenizer", "no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json + merges.txt",
                       "save the model's tokenizer next to it: `AutoTokenizer.from_pretrained(src)"
                       ".save_pretrained(dir)`", partial=True)


def tokenizer_fingerprint(folder: str | Path) -> str | None:
    """A hash of what makes a tokenizer's token ids: ``tokenizer.json``'s model (vocabulary, merges),
    added tokens, normalizer and pre-tokenizer; else the hash of the vocabulary files
    (:data:`TOKENIZER_FILES`). Two checkpoints with the same fingerprint read the same ids as the same
    text. None where the folder holds no tokenizer file."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if path.is_file():
        stat = path.stat()
        return _json_fingerprint(str(path), stat.st_size, stat.st_mtime_ns)
    for group in TOKENIZER_FILES[1:]:
        if all((folder / f).is_file() for f in group):
            h = hashlib.sha256()
            try:
                for f in group:
                    h.update(read_bounded(folder / f, TOKENIZER_READ_BYTES))
            except OSError:  # a pipe, a device, a file too large: no fingerprint (the check says nothing)
                return None
            return h.hexdigest()[:16]
    return None


def same_tokenizer(a: str | Path, b: str | Path) -> bool:
    """Whether the checkpoints at ``a`` and ``b`` tokenize alike (the same folder, or equal
    :func:`tokenizer_fingerprint`s); False where either has no tokenizer file to compare."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    fa = tokenizer_fingerprint(a)
    return fa is not None and fa == tokenizer_fingerprint(b)


@lru_cache(maxsize=64)
def _json_fingerprint(path: str, size: int, mtime: int) -> str | None:
    try:
        tok = json.loads(read_bounded(path, TOKENIZER_READ_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(tok, dict):
        return None
    added = sorted((t.get("id"), t.get("content")) for t in tok.get("added_tokens") or [] if isinstance(t, dict))
    kept = {"model": tok.get("model"), "added": added, "normalizer": tok.get("normalizer"),
            "pre_tokenizer": tok.get("pre_tokenizer")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


__all__ = ["FileProblem", "checkpoint_problems", "config_problems", "weight_problems", "header_problem",
           "tokenizer_problem", "tokenizer_fingerprint", "same_tokenizer", "TOKENIZER_FILES", "PICKLES", "CONVERT_HINT"]
