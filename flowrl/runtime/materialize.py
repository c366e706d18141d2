"""Turn the plan's model records into local checkpoint directories.

* ``hf("dir")``: a local transformers checkpoint; flowrl never downloads, so a path that
  is not a directory is an error with the fix.
* ``tiny(task = ...)``: built locally and warm-started by a short supervised phase,
  cached by content (:func:`flowrl.models.warmstart.warm_start`).
* ``frozen(m)`` / ``critic(m)``: start from ``m``'s initial weights.
"""

from __future__ import annotations

import time
from pathlib import Path

from flowrl.plan import ExecutionPlan, ModelPlan
from flowrl.runtime.handlers import RuntimeFlowError


def materialize_models(plan: ExecutionPlan, log) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    pending = list(plan.models)
    while pending:  # derived models need their base first
        progressed = False
        for m in list(pending):
            if m.base is not None and m.base not in paths:
                continue
            paths[m.id] = _one(m, paths, log)
            pending.remove(m)
            progressed = True
        if not progressed:
            raise RuntimeFlowError(f"{pending[0].origin}: model `{pending[0].id}` derives from an unknown model")
    return paths


def _one(m: ModelPlan, paths: dict[str, Path], log) -> Path:
    if m.base is not None:
        return paths[m.base]
    if m.source == "hf":
        p = Path(m.args["path"])
        if not (p / "config.json").is_file():
            raise RuntimeFlowError(f"{m.origin}: hf(\"{m.args['path']}\") is not a local transformers checkpoint "
                                   "(no config.json); flowrl never downloads models: save one with "
                                   "`save_pretrained(dir)` and point hf(...) at that directory")
        return p
    if m.source == "tiny":
        from flowrl.models.warmstart import SFTConfig, TinyModelConfig, warm_start

        a = m.args
        cfg = TinyModelConfig(hidden=int(a.get("hidden", 128)), layers=int(a.get("layers", 2)),
                              heads=int(a.get("heads", 4)), kv_heads=int(a.get("kv_heads", 2)))
        sft = SFTConfig(steps=int(a.get("warm_start", SFTConfig().steps)))
        t0 = time.time()
        log(f"model `{m.id}`: preparing the tiny {a.get('task', 'arith')} model "
            "(built and warm-started by SFT on first use, then cached)...")
        result = warm_start(str(a.get("task", "arith")), model_cfg=cfg, sft=sft, seed=int(a.get("seed", 0)))
        acc = result.info.get("test_accuracy")
        how = "cached" if result.cached else f"built and warm-started in {time.time() - t0:.0f}s"
        log(f"model `{m.id}`: tiny {a.get('task', 'arith')} model {how}"
            + (f" (SFT held-out accuracy {100 * acc:.1f}%)" if acc is not None else "") + f": {result.path}")
        return Path(result.path)
    raise RuntimeFlowError(f"{m.origin}: model source `{m.source}` cannot be materialized")


def load_tokenizer_for(plan: ExecutionPlan, paths: dict[str, Path]):
    """The tokenizer shared by the flow's models (the one that generates, else the first)."""
    from transformers import AutoTokenizer

    gen = next((op.model for op in plan.ops if op.kind == "generate"), None)
    mid = gen or (plan.models[0].id if plan.models else None)
    if mid is None:
        raise RuntimeFlowError(f"{plan.source}: the flow declares no model")
    return AutoTokenizer.from_pretrained(str(paths[mid]))
