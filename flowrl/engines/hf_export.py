"""Write trained weights as a transformers checkpoint directory (what vLLM or `hf(...)` loads)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import torch


def write_hf_checkpoint(source_dir: str | os.PathLike, out_dir: str | os.PathLike,
                        tensors: Iterable[tuple[str, torch.Tensor]], *, tied: bool = False) -> Path:
    """``out_dir`` = ``source_dir``'s config, tokenizer and generation files + ``model.safetensors``.

    ``tensors``: ``(hf_name, tensor)`` pairs of the full model (e.g. an engine's
    ``named_weights()``), written contiguous and cloned. ``tied``: the model ties its LM head
    to the embedding, so ``lm_head.weight`` is left out (safetensors refuses shared storage;
    transformers re-ties on load). Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file in Path(source_dir).iterdir():
        weights = file.name.endswith((".safetensors", ".bin")) or file.name.endswith(".index.json")
        if file.is_file() and not weights:  # config, tokenizer and generation files
            shutil.copy(file, out / file.name)
    state = {name: t.contiguous().clone() for name, t in tensors}
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


__all__ = ["write_hf_checkpoint"]
