"""Turn the plan's model records into local checkpoint directories.

* ``hf("dir")``: a local transformers checkpoint; ``hf("org/name")`` that is not a local
  directory: its snapshot in the local Hugging Face cache (:mod:`flowrl.hub`). flowrl never
  downloads, so a path that is neither is an error with the fix (the download command).
* ``tiny(task = ...)``: built locally and warm-started by a short supervised phase,
  cached by content (:func:`flowrl.models.warmstart.warm_start`).
* ``tiny_rm(task = ...)``: a reward model, that model warm-started further and fit to
  preference pairs of its samples (:func:`flowrl.models.reward.reward_start`), cached by content.
* ``frozen(m)`` / ``critic(m)``: start from ``m``'s initial weights.

Each is the function of :data:`MODEL_SOURCES` its op's catalogue record names
(``OpSpec.handler``: ``hf``, ``tiny``, ``tiny_rm``, ``derived``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from flowrl.catalog.ops import OPS, OpKind
from flowrl.plan import ExecutionPlan, ModelPlan
from flowrl.runtime.errors import RuntimeFlowError


def materialize_models(plan: ExecutionPlan, log) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    pending = list(plan.models)
    while pending:  # derived models need their base first
        progressed = False
        for m in list(pending):
            if m.base is not None and m.base not in paths:
                continue
            paths[m.id] = _one(m, paths, log, plan.run.seed)
            pending.remove(m)
            progressed = True
        if not progressed:
            raise RuntimeFlowError(f"{pending[0].origin}: model `{pending[0].id}` derives from an unknown model")
    return paths


def hf(m: ModelPlan, paths: dict[str, Path], log, seed: int) -> Path:
    """A local transformers checkpoint directory, else the hub id's snapshot in the local Hugging
    Face cache (:func:`flowrl.hub.snapshot_path`: offline, weights checked); flowrl never downloads."""
    p = Path(m.args["path"])
    if not (p / "config.json").is_file() and m.args.get("hub_id"):
        from flowrl.hub import HubError, snapshot_path

        try:
            found = snapshot_path(m.args["hub_id"])
        except HubError as e:
            raise RuntimeFlowError(f"{m.origin}: hf(\"{m.args['hub_id']}\"): {e}") from None
        log(f"model `{m.id}`: `{m.args['hub_id']}` from the local Hugging Face cache: {found}")
        return _loadable(m, found, f"hf(\"{m.args['hub_id']}\"), from the local Hugging Face cache, ")
    if not (p / "config.json").is_file():
        raise RuntimeFlowError(f"{m.origin}: hf(\"{m.args['path']}\") is not a local transformers checkpoint "
                               "(no config.json); flowrl never downloads models: save one with "
                               "`save_pretrained(dir)` and point hf(...) at that directory")
    return _loadable(m, p)


def _loadable(m: ModelPlan, folder: Path, what: str = "") -> Path:
    """``folder``, if it holds what the engines load (:func:`flowrl.model_files.checkpoint_problems`, the rule
    ``flowrl check`` applies: the files may have changed since); else the first problem, as a user error."""
    from flowrl.model_files import checkpoint_problems

    problems = checkpoint_problems(folder)
    if problems:
        raise RuntimeFlowError(f"{m.origin}: model `{m.id}`: {what}{folder} cannot be loaded: "
                               + "; ".join(p.reason for p in problems) + f"; hint: {problems[0].fix}")
    return folder


def _tiny_config(a: dict):
    """The shape of a ``tiny``/``tiny_rm`` model: the flow's options over its task's shape, by the rule
    the compiler plans with (:func:`flowrl.warmcache.task_model_config`)."""
    from flowrl.warmcache import task_model_config

    shape = {k: (str if k == "arch" else int)(a[k]) for k in ("arch", "hidden", "layers", "heads", "kv_heads") if k in a}
    return task_model_config(str(a.get("task", "arith")), **shape)


def tiny(m: ModelPlan, paths: dict[str, Path], log, seed: int) -> Path:
    """A tiny model built for its task and warm-started by SFT (cached by content).

    Its init and SFT data order are seeded by the run's ``seed`` plus ``tiny(seed = ...)``
    (an offset, as ``generate``'s seed is), so ``--set seed=1`` reaches the warm start."""
    from flowrl.warmcache import cached, task_sft

    a = m.args
    task, seed = str(a.get("task", "arith")), seed + int(a.get("seed", 0))
    cfg = _tiny_config(a)
    steps = a.get("warm_start")  # None: the task's (Task.sft, over SFTConfig's)
    sft = task_sft(task, **({} if steps is None else {"steps": int(steps)}))
    t0 = time.time()
    log(f"model `{m.id}`: preparing the tiny {task} model "
        "(built and warm-started by SFT on first use, then cached)...")
    result = cached(task, cfg, sft, seed)[0]
    if result is None:  # torch and transformers only when there is a model to build
        from flowrl.models.warmstart import warm_start

        result = warm_start(task, model_cfg=cfg, sft=sft, seed=seed)
    acc = result.info.get("test_accuracy")
    how = "cached" if result.cached else f"built and warm-started in {time.time() - t0:.0f}s"
    log(f"model `{m.id}`: tiny {task} model {how}"
        + (f" (SFT held-out accuracy {100 * acc:.1f}%)" if acc is not None else "") + f": {result.path}")
    return Path(result.path)


def tiny_rm(m: ModelPlan, paths: dict[str, Path], log, seed: int) -> Path:
    """A tiny reward model for its task (:mod:`flowrl.models.reward`; cached by content): the task's tiny
    model warm-started further, fit to preference pairs of a policy's samples; seeded as ``tiny`` is."""
    from flowrl.models.reward import PreferenceConfig, reward_start
    from flowrl.warmcache import task_sft

    a = m.args
    task = str(a.get("task", "arith"))
    cfg = _tiny_config(a)
    t0 = time.time()
    log(f"model `{m.id}`: preparing the tiny {task} reward model (warm-started, fit to preference pairs on first "
        "use, then cached)...")
    result = reward_start(task, model_cfg=cfg, sft=task_sft(task), seed=seed + int(a.get("seed", 0)),
                          preferences=PreferenceConfig(steps=int(a.get("steps", 4000)), samples=int(a.get("samples", 8)),
                                                       base_accuracy=float(a.get("base_accuracy", 0.8))))
    auc = result.info.get("test_auc")
    how = "cached" if result.cached else f"built in {time.time() - t0:.0f}s"
    log(f"model `{m.id}`: tiny {task} reward model {how}"
        + (f" (held-out: ranks a right sample over a wrong one {100 * auc:.1f}% of the time)" if auc is not None
           else "") + f": {result.path}")
    return Path(result.path)


def derived(m: ModelPlan, paths: dict[str, Path], log, seed: int) -> Path:
    """``frozen(m)`` / ``critic(m)``: the base model's initial weights."""
    return paths[m.base]


MODEL_SOURCES: dict[str, Callable[[ModelPlan, dict, Callable, int], Path]] = {
    f.__name__: f for f in (hf, tiny, tiny_rm, derived)}
"""``OpSpec.handler`` of a model op -> ``source(model plan, paths so far, log, run seed) -> checkpoint directory``."""


def source_of(m: ModelPlan) -> Callable[[ModelPlan, dict, Callable, int], Path]:
    """The source of ``m`` (its op's ``OpSpec.handler``); an unknown source is an error."""
    spec = OPS.get(m.source)
    source = MODEL_SOURCES.get(spec.handler) if spec is not None and spec.kind == OpKind.MODEL else None
    if source is None:
        raise RuntimeFlowError(f"{m.origin}: model source `{m.source}` cannot be materialized; sources: "
                               f"{', '.join(sorted(k for k, s in OPS.items() if s.kind == OpKind.MODEL))}")
    return source


def _one(m: ModelPlan, paths: dict[str, Path], log, seed: int) -> Path:
    return source_of(m)(m, paths, log, seed)


PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` names of transformers' plain fast tokenizer (one class; the first its name since transformers 5)."""


def load_tokenizer_for(plan: ExecutionPlan, paths: dict[str, Path]):
    """The tokenizer shared by the flow's models (the one that generates, else the first).

    A checkpoint whose ``tokenizer_config.json`` names the plain fast tokenizer (``TokenizersBackend``,
    ``PreTrainedTokenizerFast`` before transformers 5: the tiny models) loads that class directly, what
    ``AutoTokenizer`` would resolve to, without importing transformers' model registry (``auto_factory``
    pulls in torch.distributed.tensor and sympy: 5-15 s of the driver's start-up on 2 cores, measured
    at load 1-3, before any engine starts)."""
    mid = tokenizer_model(plan)
    if mid is None:
        raise RuntimeFlowError(f"{plan.source}: the flow declares no model")
    model = next((m for m in plan.models if m.id == mid), None)
    return load_tokenizer(Path(paths[mid]), f"{model.origin}: model `{mid}`: " if model is not None else "")


def tokenizer_model(plan: ExecutionPlan) -> str | None:
    """The model whose tokenizer is the flow's (:func:`load_tokenizer_for`): the one that generates, else the
    first; None when the flow declares none."""
    gen = next((op.model for op in plan.ops if op.kind == OpKind.GENERATE), None)
    return gen or (plan.models[0].id if plan.models else None)


def load_tokenizer(path: Path, who: str = ""):
    """The tokenizer of the checkpoint at ``path`` (see :func:`load_tokenizer_for` for the class); a tokenizer
    its loader refuses (a damaged ``tokenizer.json``) is a user error naming the directory (``who``: the
    model, as messages name it)."""
    try:
        if tokenizer_class(path) in PLAIN_TOKENIZERS:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - the loader's own error, whatever its class, is the cause named
        from flowrl.runtime.errors import innermost

        raise RuntimeFlowError(f"{who}the tokenizer in {path} cannot be loaded: {innermost(e)}; hint: save the "
                               "model's tokenizer there again: `AutoTokenizer.from_pretrained(src).save_pretrained(dir)`"
                               ) from e


def tokenizer_class(path: Path) -> str | None:
    """The ``tokenizer_class`` a local checkpoint's ``tokenizer_config.json`` names (None: no such file or
    field, e.g. a hub id, which ``AutoTokenizer`` resolves)."""
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
