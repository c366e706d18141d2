"""Local tiny models: built from scratch, optionally warm-started on a task.

``tiny(task="arith", ...)`` is what a flow's model source ``tiny(task="arith", ...)``
resolves to: the path of a transformers checkpoint (loadable by vLLM too).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from flowrl.models.tiny import TinyModelError, build_tiny_model, build_tokenizer, load_tokenizer
from flowrl.models.warmstart import (
    SFTConfig,
    TinyModelConfig,
    WarmStartError,
    WarmStartResult,
    evaluate_accuracy,
    task_model_config,
    task_sft,
    warm_start,
)

_MODEL_KEYS = {f.name for f in fields(TinyModelConfig)}
_SFT_KEYS = {f"sft_{f.name}": f.name for f in fields(SFTConfig)}


def tiny(
    task: str = "arith",
    *,
    seed: int = 0,
    warm: bool = True,
    cache_dir: str | Path | None = None,
    **options,
) -> Path:
    """The checkpoint directory of a tiny model for ``task``.

    ``options`` are ``TinyModelConfig`` fields (``hidden=``, ``layers=``, ...; over the task's
    own shape, ``Task.model``) and SFT
    settings prefixed with ``sft_`` (``sft_steps=``, ``sft_lr=``, ...). ``warm=False``
    skips training (0 SFT steps: random weights). Results are cached (see ``warm_start``).
    """
    unknown = sorted(set(options) - _MODEL_KEYS - set(_SFT_KEYS))
    if unknown:
        raise TinyModelError(
            f"tiny(): unknown option(s) {unknown}; model options are {sorted(_MODEL_KEYS)}, "
            f"warm-start options are {sorted(_SFT_KEYS)}"
        )
    model_cfg = task_model_config(task, **{k: v for k, v in options.items() if k in _MODEL_KEYS})
    sft_kwargs = {_SFT_KEYS[k]: v for k, v in options.items() if k in _SFT_KEYS}
    if not warm:
        sft_kwargs["steps"] = 0
    return warm_start(task, model_cfg=model_cfg, sft=task_sft(task, **sft_kwargs), seed=seed, cache_dir=cache_dir).path


__all__ = [
    "SFTConfig", "TinyModelConfig", "TinyModelError", "WarmStartError", "WarmStartResult",
    "build_tiny_model", "build_tokenizer", "evaluate_accuracy", "load_tokenizer", "task_model_config", "task_sft", "tiny",
    "warm_start",
]
