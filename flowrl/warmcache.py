"""The warm start's settings and its cache, without torch: whether a warm start is cached, and where.

A run's driver asks this first (:func:`cached`): a cached warm start is found without importing
:mod:`flowrl.models` and transformers' model classes, whose registry loads torch.distributed.tensor and
sympy (seconds of the driver's start-up on 2 cores, before any engine starts; see
:func:`~flowrl.runtime.materialize.load_tokenizer_for` for the other half). :mod:`flowrl.models.warmstart`
builds what is not cached and re-exports these names. A module outside :mod:`flowrl.models`, whose package
imports torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowrl.cache import cache_root
from flowrl.catalog.models import TINY_DEFAULTS, TINY_INTERMEDIATE, TINY_MAX_LEN, tiny_shape
from flowrl.tasks import get_task

CACHE_VERSION = 3
"""Bump when the warm-start procedure changes, so stale cache entries are not reused."""


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny model (see ``build_tiny_model``); defaults fit the arith task."""

    arch: str = "llama"
    """The family: a key of :data:`~flowrl.catalog.architectures.TINY_ARCHS` ("llama", "qwen3", "gpt2"...)."""
    hidden: int = TINY_DEFAULTS["hidden"]
    """Residual width."""
    layers: int = TINY_DEFAULTS["layers"]
    """Decoder blocks."""
    heads: int = TINY_DEFAULTS["heads"]
    """Query heads; the head size hidden / heads must be one vLLM's CPU attention takes
    (:data:`flowrl.catalog.models.CPU_HEAD_SIZES`)."""
    kv_heads: int = TINY_DEFAULTS["kv_heads"]
    """Key/value heads (grouped-query attention)."""
    intermediate: int = TINY_INTERMEDIATE
    """MLP width."""
    max_position: int = TINY_MAX_LEN
    """Longest sequence in tokens."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start settings (defaults chosen by ``bench/rl_feasibility.py``)."""

    steps: int = 3000
    """Most optimizer steps (fewer when ``stop_at_accuracy`` is reached first)."""
    batch_size: int = 64
    """Rows per step, sampled without replacement within a step."""
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay. Without it the step at which the model starts to add
    varies far more with the seed (seed 1 had not started after 3000 steps)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    stop_at_accuracy: float | None = 0.3
    """Stop at the first check at which greedy accuracy on the ``check_rows`` validation
    rows reaches this (None: run all steps, on every row). Why: a 2-layer model learns
    addition in a sudden transition (held-out accuracy ~8% on a plateau, then 12% -> 48%
    within 150 steps) whose start varies with the seed and the CPU's arithmetic (about 450
    to 1300 steps), so no fixed step count leaves every seed "partway"; GRPO gains little
    from below ~15% and a lot from ~25-40%."""
    check_every: int = 10
    """Steps between accuracy checks. Small, so that the transition cannot carry the model
    far past the target between two checks (the old 50 did: 19% on one CPU, 27% on another)."""
    check_rows: int = 512
    """How many rows (the first ones of the train split) the check scores. With a
    ``stop_at_accuracy`` they are a validation set: never trained on, so the check measures
    what held-out accuracy measures. (Checked on rows it trained on, the model memorised
    them at a rate that depends on the CPU: one machine stopped at 30% on them with 20%
    held-out, another at 34% held-out.) The accuracy is computed exactly in one
    teacher-forced forward pass (``teacher_forced_accuracy``), so the check is cheap enough
    to run often."""


@dataclass(frozen=True)
class WarmStartResult:
    """What ``warm_start`` produced or found in its cache."""

    path: Path
    """The checkpoint directory (transformers + tokenizer files)."""
    cached: bool
    """True when the checkpoint came from the cache."""
    info: dict = field(default_factory=dict)
    """Contents of ``warmstart.json``: the key's inputs, final loss, held-out accuracy."""


class WarmStartError(RuntimeError):
    """A warm start that cannot run (bad settings, unusable cache directory)."""


def task_sft(task: str, **overrides) -> SFTConfig:
    """The warm-start settings of ``task``: ``SFTConfig``'s defaults, the task's own (``Task.sft``),
    then ``overrides``."""
    return SFTConfig(**{**get_task(task).sft, **overrides})


def default_cache_dir() -> Path:
    """``warmstart/`` under :func:`flowrl.cache.cache_root` (``$FLOWRL_CACHE``, else ``~/.cache/flowrl``)."""
    return cache_root() / "warmstart"


def cache_key(task: str, model_cfg: TinyModelConfig, sft: SFTConfig, seed: int) -> tuple[str, dict]:
    """``(hex key, the dict it hashes)`` for one warm start."""
    inputs = {
        "version": CACHE_VERSION,
        "task": task,
        "task_spec": get_task(task).spec(),
        "model": asdict(model_cfg),
        "sft": asdict(sft),
        "seed": seed,
    }
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16], inputs


def task_model_config(task: str, **overrides) -> TinyModelConfig:
    """The tiny model shape of ``task``: the catalogue's rule (:func:`flowrl.catalog.models.tiny_shape`:
    the defaults, the task's own ``Task.model``, then ``overrides``), which ``check`` plans with."""
    get_task(task)  # an unknown task is an error here, not the catalogue's defaults
    return TinyModelConfig(arch=str(overrides.get("arch", TinyModelConfig.arch)),
                           **tiny_shape({**overrides, "task": task}))


def read_entry(file: Path) -> dict:
    """A cache entry's record (``warmstart.json``, ``reward.json``): JSON only, so a cache someone else
    can write runs nothing when read; one that does not parse is a :class:`WarmStartError` naming it."""
    try:
        info = json.loads(file.read_bytes().decode("utf-8"))
        if not isinstance(info, dict):
            raise ValueError(f"a JSON {type(info).__name__}, not an object")
        return info
    except (OSError, ValueError) as e:
        raise WarmStartError(f"cache entry {file.parent} is damaged: {file.name} cannot be read ({type(e).__name__}: "
                             f"{str(e)[:200]}); it was not loaded; hint: delete {file.parent} (it is built "
                             f"again)") from None


def cached(task: str, model_cfg: TinyModelConfig, sft: SFTConfig, seed: int,
           cache_dir: str | Path | None = None) -> tuple[WarmStartResult | None, Path, str, dict]:
    """``(the cached result or None, the cache root, the key, the inputs it hashes)`` of one warm start."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key, inputs = cache_key(task, model_cfg, sft, seed)
    final = root / f"{task}-{key}"
    if (final / "warmstart.json").is_file():
        return WarmStartResult(final, True, read_entry(final / "warmstart.json")), root, key, inputs
    return None, root, key, inputs


__all__ = ["CACHE_VERSION", "SFTConfig", "TinyModelConfig", "WarmStartError", "WarmStartResult", "cache_key",
           "cached", "read_entry", "default_cache_dir", "task_model_config", "task_sft"]
