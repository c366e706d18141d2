"""Write trained weights as a transformers checkpoint directory (what vLLM or `hf(...)` loads).

:func:`write_safetensors` writes ``(name, tensor)`` pairs as transformers' ``save_pretrained`` does:
one ``model.safetensors`` when they fit ``max_shard_bytes``, else shards
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {name: shard}}``), which ``from_pretrained``, vLLM and SGLang
read. :func:`write_hf_checkpoint` adds the source checkpoint's config, tokenizer and generation files.

>>> import tempfile, torch; d = Path(tempfile.mkdtemp())
>>> write_safetensors(d, {"a": torch.zeros(4), "b": torch.ones(4)}, max_shard_bytes=20)
['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
>>> json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
{'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9
"""transformers' default ``max_shard_size`` (5 GB)."""


def write_safetensors(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` (contiguous CPU copies, in order) into ``out_dir``: one file, or shards of at most
    ``max_shard_bytes`` each (a larger tensor alone in its shard) with an index. Returns the files written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return [*names, INDEX]


def write_hf_checkpoint(source_dir: str | os.PathLike, out_dir: str | os.PathLike,
                        tensors: Iterable[tuple[str, torch.Tensor]], *, tied: bool = False,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """``out_dir`` = ``source_dir``'s config, tokenizer and generation files + the weights (:func:`write_safetensors`).

    ``tensors``: ``(hf_name, tensor)`` pairs of the full model (e.g. an engine's
    ``named_weights()``), written contiguous and cloned. ``tied``: the model ties its LM head
    to the embedding, so ``lm_head.weight`` is left out (safetensors refuses shared storage;
    transformers re-ties on load). Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file in Path(source_dir).iterdir():
        weights = file.name.endswith((".safetensors", ".bin")) or file.name.endswith(".index.json")
        if file.is_file() and not weights:  # config, tokenizer and generation files
            shutil.copy(file, out / file.name)
    state = [(name, t) for name, t in tensors if not (tied and name == "lm_head.weight")]
    write_safetensors(out, state, max_shard_bytes=max_shard_bytes)
    return out


__all__ = ["write_safetensors", "write_hf_checkpoint", "SINGLE", "INDEX", "DEFAULT_SHARD_BYTES"]
