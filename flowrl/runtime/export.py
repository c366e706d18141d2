"""A run's trained model out: a checkpoint as a Hugging Face model directory (``flowrl export``).

What a train engine saved in ``RUN/checkpoints/step_N/<model>/`` is its own state (optimizer and
RNG included) in its own layout; :func:`export_checkpoint` turns the model's weights into what
``transformers``, vLLM, SGLang and PEFT load:

* a model directory: ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards and
  ``model.safetensors.index.json`` above ``max_shard_bytes``), ``config.json`` (its ``dtype`` the
  tensors'), ``generation_config.json``, and the base checkpoint's tokenizer files (its chat
  template with them); tensors under the checkpoint names transformers writes (a mixture of
  experts' experts one tensor each, as the family's checkpoints hold them);
* for a model that trains LoRA adapters: a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``, the tokenizer beside), what ``PeftModel.from_pretrained(base,
  dir)`` and vLLM's ``LoRARequest`` load; or, ``merge_lora``, a model directory with the
  adapters merged into the base weights (``W + (alpha / r) B A``).

Each train engine's layout has one reader (:data:`READERS`), chosen by the file its ``save`` writes
(not by the engine's name): the torch engine's ``engine_state.pt``; FSDP's sharded
``torch.distributed.checkpoint`` files, gathered; Megatron's per-rank files, tensor-, pipeline- and
expert-parallel shards gathered and renamed by the engine's own converter
(:func:`flowrl.engines.megatron.convert.unshard_state`, :func:`~flowrl.engines.megatron.convert.megatron_to_hf`).

A run directory may come from anyone: nothing read here runs code (JSON, safetensors,
``torch.load(weights_only=True)``, torch.distributed.checkpoint's metadata through the FSDP engine's
safe reader), the checkpoint is verified against its manifest first, and whatever does not fit is
an :class:`ExportError`, one line naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from flowrl.engines.hf_export import DEFAULT_SHARD_BYTES, write_safetensors
from flowrl.plan import ExecutionPlan, ModelPlan
from flowrl.runtime.checkpoints import CheckpointError, complete_checkpoints, step_of, verify_checkpoint
from flowrl.runtime.errors import RuntimeFlowError

RUN_PLAN = "plan.json"
"""What marks a run directory (and holds the plan its checkpoints fit)."""
EXPORTS = "exports"
"""Where a run's own exports go (``export_every``): ``RUN/exports/step_NNNNNN/``."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")
"""Files of a base checkpoint not copied into an export (its weights; the export writes its own)."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportError(RuntimeFlowError):
    """A checkpoint that cannot be exported (not there, damaged, not of this plan) or a target that cannot
    be written; one line naming the file or option, with a hint."""


@dataclass(frozen=True)
class Exported:
    path: Path
    """The directory written."""
    model: str
    step: int
    kind: str
    """``model`` (a model directory) or ``adapter`` (a PEFT adapter directory)."""
    files: tuple[str, ...]


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"`` -> bytes (> 0); ExportError otherwise.

    >>> parse_size("500MB"), parse_size("1KiB"), parse_size("7")
    (500000000, 1024, 7)
    """
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ExportError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


# ---- the run directory ---------------------------------------------------------------------------


def read_plan(run_dir: Path) -> ExecutionPlan:
    """The run's ``plan.json``, read as JSON only; ExportError when it is not a run directory."""
    file = run_dir / RUN_PLAN
    if not file.is_file():
        raise ExportError(f"{run_dir}: no {RUN_PLAN} there; pass the run directory of a `flowrl run` (its --out)")
    try:
        return ExecutionPlan.from_json(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{file} cannot be read ({type(e).__name__}: {_first_line(e)}); hint: pass the run "
                          "directory of a `flowrl run`, as that run wrote it") from None


def checkpoint_for(run_dir: Path, step: int | None) -> Path:
    """``run_dir``'s checkpoint of ``step`` (default: the newest), verified against its manifest."""
    have = [step_of(p) for p in complete_checkpoints(run_dir)]
    if not have:
        raise ExportError(f"{run_dir}: the run left no checkpoint (it stopped before its last step and ran without "
                          "--save-every)")
    chosen = have[-1] if step is None else step
    if chosen not in have:
        raise ExportError(f"{run_dir} --step {step}: no checkpoint of that step; there are: {', '.join(map(str, have))}")
    ckpt = run_dir / "checkpoints" / f"step_{chosen:06d}"
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    return ckpt


def exported_model(plan: ExecutionPlan, model: str | None) -> ModelPlan:
    """The model to export: ``model`` by id, else the flow's one trained policy."""
    trained = [m for m in plan.models if m.train_engine is not None and m.role == "trainable"]
    if model is not None:
        found = next((m for m in plan.models if m.id == model), None)
        if found is None or found not in trained:
            raise ExportError(f"--model {model}: the run trains no such policy; it trains: "
                              f"{', '.join(m.id for m in trained) or 'none'}")
        return found
    if len(trained) != 1:
        raise ExportError(f"the run trains {len(trained)} policies ({', '.join(m.id for m in trained) or 'none'}); "
                          "name one with --model")
    return trained[0]


def export_run(run_dir: str | os.PathLike, to: str | os.PathLike, *, step: int | None = None,
               model: str | None = None, merge_lora: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               log: Callable[[str], None] = lambda _: None) -> Exported:
    """``flowrl export RUN --to DIR``: the checkpoint of ``step`` (default: the newest) of ``run_dir``
    as a Hugging Face directory ``to`` (which must not exist, or be empty)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ExportError(f"{run}: no such run directory")
    plan = read_plan(run)
    m = exported_model(plan, model)
    ckpt = checkpoint_for(run, step)
    from flowrl.runtime.materialize import materialize_models

    try:
        base = materialize_models(_only(plan, m), log)[m.id]
    except RuntimeFlowError as e:
        raise ExportError(f"the base model of `{m.id}` (its config and tokenizer): {e}") from None
    return export_checkpoint(plan, m, ckpt, Path(base), Path(to), merge_lora=merge_lora,
                             max_shard_bytes=max_shard_bytes)


def _only(plan: ExecutionPlan, m: ModelPlan) -> ExecutionPlan:
    """``plan`` with ``m`` and the models it derives from only (nothing else is built to export it)."""
    from dataclasses import replace

    keep, cur = [], m
    while cur is not None:
        keep.append(cur)
        cur = next((x for x in plan.models if x.id == cur.base), None) if cur.base else None
    return replace(plan, models=tuple(reversed(keep)))


# ---- one checkpoint ------------------------------------------------------------------------------


def export_checkpoint(plan: ExecutionPlan, m: ModelPlan, ckpt: Path, base: Path, to: Path, *,
                      merge_lora: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Exported:
    """Write model ``m``'s weights in checkpoint ``ckpt`` (base checkpoint directory ``base``) to ``to``:
    written into ``to.tmp`` and renamed, so a failure leaves no half directory at ``to``."""
    state_dir = ckpt / m.id
    if not state_dir.is_dir():
        raise ExportError(f"checkpoint {ckpt} holds no state of model `{m.id}` ({state_dir} is missing)")
    reader = reader_for(state_dir)
    _check_target(to)
    lora = m.args.get("lora")
    if merge_lora and lora is None:
        raise ExportError(f"--merge-lora: model `{m.id}` trains no LoRA adapters (its weights are the model's); "
                          "drop --merge-lora")
    tmp = to.with_name(to.name + ".tmp")
    if os.path.lexists(tmp):  # never deleted here: it may be someone's (a killed export's: remove it yourself)
        raise ExportError(f"--to {to}: {tmp} exists (an earlier export cut short, or not flowrl's); the export is "
                          f"written there first: remove it, or give another --to")
    try:
        tmp.mkdir(parents=True)
        model = _built(base, m, lora)
        try:
            reader(state_dir, base, model, m)
        except ExportError:
            raise
        except Exception as e:  # noqa: BLE001 - a state that does not fit the model: its loader's own words
            raise ExportError(f"{state_dir} does not fit model `{m.id}` of {base} ({type(e).__name__}: "
                              f"{_first_line(e)}); hint: export with the run's own plan.json and base model") from None
        if lora is not None and not merge_lora:
            files = _write_adapter(model, base, m, tmp)
            kind = "adapter"
        else:
            if lora is not None:
                model = model.merge_and_unload(safe_merge=True)
            files = write_model_dir(base, tmp, checkpoint_tensors(model), max_shard_bytes=max_shard_bytes)
            kind = "model"
        if to.exists():
            to.rmdir()  # empty (checked above)
        tmp.rename(to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(to, m.id, step_of(ckpt) or 0, kind, tuple(files))


def _check_target(to: Path) -> None:
    if to.is_symlink() or (to.exists() and not to.is_dir()):
        raise ExportError(f"--to {to}: that is a file or a link; give a new directory")
    if to.is_dir() and any(to.iterdir()):
        raise ExportError(f"--to {to}: the directory is not empty; give a new or empty directory (nothing is "
                          "overwritten)")


def _built(base: Path, m: ModelPlan, lora: dict | None):
    """The model as the train engine built it (the base checkpoint, PEFT's layers when it trains LoRA),
    to load the saved state into."""
    import torch
    from transformers import AutoModelForCausalLM

    from flowrl.engines.torch_train import _DTYPES

    dtype = _DTYPES.get(str(m.args.get("dtype", "float32")), torch.float32)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    except Exception as e:  # noqa: BLE001 - transformers' own reason, in one line
        raise ExportError(f"the base model {base} cannot be loaded ({type(e).__name__}: {_first_line(e)})") from None
    if lora is not None:
        from flowrl.engines import lora as adapters

        model = adapters.wrap(model, adapters.config_of(lora, str(base)), 0)
    return model


# ---- readers: a train engine's saved state into the built model --------------------------------


def _torch_state(state_dir: Path, base: Path, model, m: ModelPlan) -> None:
    """The torch engine's ``engine_state.pt`` (``torch.load(weights_only=True)``): its ``model`` state dict."""
    from flowrl.engines.base import EngineError, load_tensors_file
    from flowrl.engines.torch_train import STATE_FILE

    try:
        state = load_tensors_file(state_dir / STATE_FILE)
    except EngineError as e:
        raise ExportError(str(e)) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or state.get("role") != "actor":
        raise ExportError(f"{state_dir / STATE_FILE} holds no actor's model state (role "
                          f"{state.get('role') if isinstance(state, dict) else None!r}); only a policy exports")
    _load(model, state["model"], state_dir / STATE_FILE)


def _fsdp_state(state_dir: Path, base: Path, model, m: ModelPlan) -> None:
    """FSDP's sharded ``torch.distributed.checkpoint`` directory, read whole into the model (one process,
    no process group), through the engine's reader that never unpickles."""
    import torch.distributed.checkpoint as dcp

    from flowrl.engines.fsdp import META_FILE
    from flowrl.engines.fsdp_rank import DCP_DIR, _safe_load_planner, _safe_reader

    meta = _meta(state_dir / META_FILE)
    if meta.get("role") != "actor":
        raise ExportError(f"{state_dir / META_FILE}: a {meta.get('role')!r} engine's state; only a policy exports")
    reader = _safe_reader(str(state_dir / DCP_DIR))
    saved = set(reader.read_metadata().state_dict_metadata)  # "model.<name>": a LoRA engine saves its adapters only
    state = {"model": {k: v for k, v in model.state_dict().items() if f"model.{k}" in saved}}
    if not state["model"]:
        raise ExportError(f"{state_dir / DCP_DIR} holds none of the model's tensors; hint: export with the run's own "
                          "plan.json and base model")
    dcp.load(state, storage_reader=reader, planner=_safe_load_planner(), no_dist=True)  # one process, no group
    _load(model, state["model"], state_dir / DCP_DIR)


def _megatron_state(state_dir: Path, base: Path, model, m: ModelPlan) -> None:
    """Megatron's per-rank files (``mp_rank_TT_PPP[_cpCC]_dpDDD.pt``): the shards of every tp, pp and ep
    rank gathered (:func:`~flowrl.engines.megatron.convert.unshard_state`) and renamed to transformers'
    checkpoint names (:func:`~flowrl.engines.megatron.convert.megatron_to_hf`), as a resync does."""
    from flowrl.engines.base import EngineError, load_tensors_file
    from flowrl.engines.megatron.convert import ConversionError, ModelSpec, megatron_to_hf, unshard_state
    from flowrl.engines.megatron.engine import META_FILE

    meta = _meta(state_dir / META_FILE)
    layout = meta.get("layout")
    if meta.get("role") != "actor" or not isinstance(layout, dict):
        raise ExportError(f"{state_dir / META_FILE}: a {meta.get('role')!r} engine's state; only a policy exports")
    try:
        tp, pp, dp, cp, ep = (int(layout.get(k, 1)) for k in ("tp", "pp", "dp", "cp", "ep"))
    except (TypeError, ValueError):
        raise ExportError(f"{state_dir / META_FILE}: layout {layout!r} is not tp/pp/dp/cp/ep numbers") from None
    if min(tp, pp, dp, cp, ep) < 1 or tp * pp * dp * cp > 4096:
        raise ExportError(f"{state_dir / META_FILE}: layout {layout!r} is out of range")
    spec = ModelSpec.from_pretrained(base)
    shards: dict[tuple[int, ...], dict] = {}
    for t in range(tp):
        for p in range(pp):
            for d in range(dp):
                if ep == 1 and d > 0:
                    break  # data-parallel ranks hold the same weights
                cpart = "_cp00" if cp > 1 else ""
                file = state_dir / f"mp_rank_{t:02d}_{p:03d}{cpart}_dp{d:03d}.pt"
                if not file.is_file():
                    raise ExportError(f"{file} is missing: a Megatron checkpoint of layout {layout} has one file per rank")
                try:
                    saved = load_tensors_file(file)
                except EngineError as e:
                    raise ExportError(str(e)) from None
                if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
                    raise ExportError(f"{file} holds no model state")
                e = _ep_rank(saved, t, d, tp, cp, ep)
                shards.setdefault((t, p) if ep == 1 else (t, p, e), saved["model"])
    try:
        full = unshard_state(shards, spec, tp, pp, "actor", ep)
        hf = megatron_to_hf(full, spec, "actor")
    except ConversionError as e:
        raise ExportError(f"{state_dir}: {e}") from None
    _load_checkpoint_named(model, hf, state_dir)


def _ep_rank(saved: dict, tp_rank: int, dp_rank: int, tp: int, cp: int, ep: int) -> int:
    """The expert-parallel rank of a Megatron rank file: the one it recorded (``coords``), else Megatron's
    rank order for experts (``tp-cp-ep-dp-pp`` with expert tensor parallelism 1: ep varies fastest
    over the ranks of a stage, numbered tp fastest, then cp, then dp)."""
    coords = saved.get("coords")
    if isinstance(coords, dict) and isinstance(coords.get("ep"), int):
        return coords["ep"]
    if ep == 1:
        return 0
    return (tp_rank + tp * cp * dp_rank) % ep


def _meta(file: Path) -> dict:
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"{file} cannot be read ({type(e).__name__}: {_first_line(e)}); hint: it was damaged "
                          "or replaced: export another checkpoint (--step)") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{file} is not an engine's record (a JSON object)")
    return meta


READERS: tuple[tuple[str, Callable], ...] = (
    ("engine_state.pt", _torch_state),
    ("fsdp_engine.json", _fsdp_state),
    ("megatron_engine.json", _megatron_state),
)
"""The file a train engine's ``save`` writes -> the reader of its layout. Tested against each
engine's own file name (``STATE_FILE``, ``META_FILE``), so a renamed one cannot go unseen."""


def reader_for(state_dir: Path) -> Callable:
    """The reader of the layout saved in ``state_dir`` (by the file its engine writes)."""
    found = [read for name, read in READERS if (state_dir / name).is_file()]
    if len(found) != 1:
        raise ExportError(f"{state_dir} holds {'no' if not found else 'more than one'} train engine's state "
                          f"(one of {', '.join(n for n, _ in READERS)}); hint: it was damaged or replaced")
    return found[0]


def _load(model, state: dict, source: Path) -> None:
    """Load ``state`` (the model's own parameter names) into ``model``: every tensor, same shapes."""
    import torch

    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ExportError(f"{source} holds a model state with values that are not tensors")
    result = model.load_state_dict(state, strict=False, assign=True)
    # the tied head is the embedding; a LoRA engine may save its adapters alone (the base never changes)
    kept = _tied_names(model) | {n for n, p in model.named_parameters() if not p.requires_grad and _is_peft(model)}
    missing = [k for k in result.missing_keys if k not in kept]
    if missing or result.unexpected_keys:
        raise ExportError(f"{source} does not fit the model: missing {missing[:3]}, unexpected "
                          f"{list(result.unexpected_keys)[:3]}; hint: export with the run's own plan.json")


def _load_checkpoint_named(model, tensors: dict, source: Path) -> None:
    """Load tensors under transformers' checkpoint names (a family whose model holds some fused, such
    as a mixture of experts' experts, converted as ``from_pretrained`` converts them)."""
    converted = _converted(model, tensors) if set(tensors) - set(model.state_dict()) else tensors
    _load(model, converted, source)


def _converted(model, tensors: dict) -> dict:
    """Checkpoint-named tensors in ``model``'s own names: what ``from_pretrained`` would load, through a
    directory transformers itself reads (its conversions are the family's)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        model.config.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
        loaded, info = AutoModelForCausalLM.from_pretrained(d, dtype=next(model.parameters()).dtype,
                                                            output_loading_info=True)
        missing = [k for k in info.get("missing_keys", ()) if k not in _tied_names(loaded)]
        if missing:  # transformers would have initialised them at random: never exported
            raise ExportError(f"the gathered checkpoint lacks {sorted(missing)[:3]} of {type(loaded).__name__}")
        return {k: v.detach().clone() for k, v in loaded.state_dict().items()}


def _is_peft(model) -> bool:
    return callable(getattr(model, "get_base_model", None))


def _tied_names(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if isinstance(tied, (dict, list, set, tuple)) else ())


# ---- writing ------------------------------------------------------------------------------------


def checkpoint_tensors(model) -> dict:
    """``model``'s tensors under the names its family's checkpoints use: the conversions
    ``from_pretrained`` applied reverted (transformers 5 fuses a mixture of experts' experts in
    memory); tied weights once (the input embedding), as ``save_pretrained`` writes them."""
    state = model.state_dict()
    if getattr(model, "_weight_conversions", None):
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: t.detach() for name, t in state.items()}


def write_model_dir(base: Path, out: Path, tensors: dict, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """``out`` = ``base``'s config, generation config and tokenizer files + ``tensors`` as safetensors
    (shards of at most ``max_shard_bytes`` and an index when they do not fit one file); returns the
    files written."""
    files = copy_model_files(base, out)
    files += write_safetensors(out, tensors, max_shard_bytes=max_shard_bytes)
    _set_dtype(out / "config.json", tensors.values())
    if not (out / "generation_config.json").is_file():
        from transformers import AutoConfig, GenerationConfig

        GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(out))).save_pretrained(str(out))
        files.append("generation_config.json")
    return sorted(files)


def copy_model_files(base: Path, out: Path, *, config: bool = True) -> list[str]:
    """Copy ``base``'s files other than weights (config, generation config, tokenizer, chat template) into
    ``out``; links and sub-directories are not followed. ``config``: ``config.json`` too."""
    copied = []
    for file in sorted(base.iterdir()):
        if file.is_symlink() and not file.resolve().is_file():
            continue
        if not file.is_file() or file.name.endswith(WEIGHT_SUFFIXES) or (not config and file.name == "config.json"):
            continue
        if file.name.startswith("."):
            continue
        shutil.copyfile(file, out / file.name)
        copied.append(file.name)
    return copied


def _set_dtype(config_file: Path, tensors: Iterable) -> None:
    """``config.json``'s dtype = the floating tensors' (when they share one), what loaders read as "auto"."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()}
    if len(dtypes) != 1 or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
    config[key] = dtypes.pop()
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_adapter(model, base: Path, m: ModelPlan, out: Path) -> list[str]:
    """A PEFT adapter directory: the adapter tensors under PEFT's names, ``adapter_config.json`` naming the
    base (``base_model_name_or_path``), and the base's tokenizer files beside."""
    from flowrl.engines import lora as adapters

    cfg = adapters.config_of(m.args["lora"], str(base))
    adapters.write_adapter(str(out), cfg, adapters.adapter_tensors(model))
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(m.args.get("hub_id") or base)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    files = ["adapter_config.json", "adapter_model.safetensors"]
    return sorted(files + copy_model_files(base, out, config=False))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


__all__ = ["ExportError", "Exported", "READERS", "EXPORTS", "DEFAULT_SHARD_BYTES", "parse_size", "read_plan",
           "checkpoint_for", "exported_model", "export_run", "export_checkpoint", "reader_for",
           "checkpoint_tensors", "write_model_dir", "copy_model_files"]


# ---- exports a run makes itself (`export_every`) -------------------------------------------------


def exports_at(plan: ExecutionPlan, step: int) -> bool:
    """Whether the run exports after ``step`` (1-based): every ``export_every`` steps and after the last."""
    every = plan.run.export_every
    return bool(every) and (step % every == 0 or step == plan.run.steps)


def export_in_run(plan: ExecutionPlan, out: Path, ckpt: Path, log: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Export each policy the run trains from its checkpoint ``ckpt`` into ``out/exports/step_NNNNNN`` (one
    policy; ``.../<model>`` for several): a model directory, or a PEFT adapter directory for LoRA. Listed in
    the run directory's list before it is written (:func:`flowrl.runtime.rundir.own`); an export of the
    same step from before (a resumed run) is replaced."""
    from flowrl.runtime.materialize import materialize_models
    from flowrl.runtime.rundir import PATH, listed, own

    trained = [m for m in plan.models if m.train_engine is not None and m.role == "trainable"]
    step = step_of(ckpt) or 0
    written = []
    for m in trained:
        folder = out / EXPORTS / f"step_{step:06d}"
        target = folder / m.id if len(trained) > 1 else folder
        tmp = target.with_name(target.name + ".tmp")
        before = listed(out)
        for path in (target, tmp):  # an export of this step from before a resume: replaced if flowrl wrote it
            if os.path.lexists(path):
                if before.get(path.relative_to(out).as_posix()) != PATH or path.is_symlink():
                    raise ExportError(f"{path} exists and flowrl did not write it; move it away to export there")
                shutil.rmtree(path)
        own(out, target, tmp)
        base = materialize_models(_only(plan, m), lambda _: None)[m.id]
        done = export_checkpoint(plan, m, ckpt, Path(base), target)
        log(f"exported `{m.id}` after step {step} to {done.path}")
        written.append(done.path)
    return written


__all__ += ["exports_at", "export_in_run"]
