"""Model directories for tests that compile flows against a checkpoint's config without loading it.

``flowrl check`` refuses an ``hf("dir")`` whose weights are missing (:mod:`flowrl.model_files`); a
test that only plans needs no real weights, so it writes a safetensors file holding no tensors: a
whole, valid file (the engines would find no tensors in it, which ``check`` does not read).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

EMPTY_SAFETENSORS = struct.pack("<Q", 8) + b"{}      "
"""A safetensors file with no tensors: the 8-byte header length, then the header ``{}`` padded to 8 bytes."""


def write_empty_weights(folder: str | Path) -> Path:
    """``folder/model.safetensors`` holding no tensors (see the module docstring)."""
    path = Path(folder) / "model.safetensors"
    path.write_bytes(EMPTY_SAFETENSORS)
    return path


def write_char_tokenizer(folder: str | Path, chars: str = "0123456789+-=") -> None:
    """A character-level ``tokenizer.json`` in ``folder`` (with the ``tokenizers`` library alone: no torch)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(Path(folder) / "tokenizer.json"))


def write_planned_checkpoint(folder: str | Path, config: dict) -> Path:
    """A directory ``check`` accepts for ``config``: its ``config.json``, a tokenizer, weights with no tensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    write_char_tokenizer(folder)
    write_empty_weights(folder)
    return folder
