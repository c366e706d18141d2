"""LoRA adapters in the engines: PEFT in the trainer, adapter tensors on the wire, an adapter directory
for vLLM, or the adapters merged into the base weights for engines that load none.

A model declared with ``lora = lora(r, alpha, dropout, targets)`` (:mod:`flowrl.catalog.adapters`)
reaches the runtime as the plan's ``ModelPlan.args["lora"]``. Here:

* :func:`wrap` puts PEFT's LoRA layers on a transformers model (only ``lora_A`` [r, in] and ``lora_B``
  [out, r] train; ``lora_B`` starts at zero, so the wrapped model is the base model until the first
  update);
* :func:`adapter_tensors` is what a resync sends: PEFT's saved names
  (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), the adapters only;
* :func:`write_adapter` writes them as a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``), what vLLM's ``LoRARequest`` loads;
* :class:`Merger` turns them into the targeted base weights with ``(alpha / r) B A`` added, in
  checkpoint names, for a rollout engine that loads no adapters (its record's ``lora = "merged"``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

from flowrl.catalog.adapters import LoraConfig, lora_modules
from flowrl.catalog.models import from_config
from flowrl.engines.base import EngineConfigError

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's checkpoint name in an adapter's tensor names."""

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Modules engines with a fused weight layout (vLLM, SGLang: ``qkv_proj``, ``gate_up_proj``) load as one
tensor: an in-place update must send every member (one sent alone leaves the others undefined), so
:class:`Merger` sends the base weight of an untargeted member along with a targeted one."""


def config_of(options: dict, model_path: str) -> LoraConfig:
    """The plan's LoRA options for the checkpoint in ``model_path`` (``"all-linear"`` expanded to its
    modules; :class:`EngineConfigError` naming the modules if a target is not one)."""
    modules = lora_modules(from_config(model_path))
    cfg = LoraConfig.from_plan(options, modules)
    bad = [t for t in cfg.targets if t not in modules]
    if bad or not cfg.targets:
        raise EngineConfigError(f"LoRA targets {bad or '[]'} are not linear modules of {model_path}; "
                                f"its modules: {', '.join(modules) or 'none'}")
    return cfg


def wrap(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """``model`` with PEFT LoRA layers on ``cfg.targets``; every base weight frozen. ``lora_A``'s
    initialisation (Kaiming-uniform) is seeded by ``seed`` without moving the global generator."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.targets), bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_cfg)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (``model`` itself when it has none): what FSDP shards
    by decoder layer (its ``model.layers``) and at the root; the LoRA layers live inside it."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def adapters_disabled(model: torch.nn.Module):
    """A context in which a PEFT model computes as its base model: every LoRA layer skipped (PEFT's
    ``disable_adapter``), the same weights in memory. A frozen reference ``frozen(policy)`` of a LoRA
    policy is its base: its log-prob pass runs here, on the policy's engine, with no copy of the weights."""
    return model.disable_adapter()


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapters of a PEFT model under PEFT's saved names (detached views: consume them before
    the next update)."""
    from peft import get_peft_model_state_dict

    return [(name, tensor.detach()) for name, tensor in get_peft_model_state_dict(model).items()]


def peft_config_dict(cfg: LoraConfig) -> dict:
    """The ``adapter_config.json`` of an adapter (the keys PEFT writes that loaders read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.r, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": list(cfg.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "base_model_name_or_path": None, "inference_mode": True}


def write_adapter(path: str, cfg: LoraConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Write a PEFT adapter directory at ``path`` (created); returns ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors},
              os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config_dict(cfg), f, indent=1)
    return path


def merged_state(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict (``base_model.model.<module>.base_layer.weight``, its
    ``<module>.lora_A.<adapter>.weight`` [r, in] and ``lora_B`` [out, r], the other tensors under
    ``base_model.model.``) as the checkpoint's tensors with the adapters merged in: ``W + (alpha / r) B A``
    (computed in float32, cast to ``W``'s dtype), what PEFT's ``merge_and_unload`` gives."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        for which in ("lora_A", "lora_B"):
            if f".{which}." in name:
                parts.setdefault(name.split(f".{which}.")[0], {})[which] = t
    out = {}
    for name, t in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." in name:
            module, rest = name.split(".base_layer.", 1)
            ab = parts.get(module, {})
            if rest == "weight" and set(ab) == {"lora_A", "lora_B"}:
                t = (t.float() + ab["lora_B"].float() @ ab["lora_A"].float() * cfg.scale).to(t.dtype)
            name = f"{module}.{rest}"
        out[name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name] = t
    return out


def split_name(name: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    (``model.layers.0.self_attn.q_proj``, ``A``); :class:`EngineConfigError` for another name."""
    for suffix in _SUFFIXES:
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
            return name[len(PEFT_PREFIX): -len(suffix)], suffix[6]
    raise EngineConfigError(f"{name!r} is not a LoRA adapter tensor (PEFT names: "
                            f"{PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")


class Merger:
    """The base weights of a LoRA's targeted modules, kept to merge adapters into.

    ``merged(tensors)`` gives ``(checkpoint name, W + (alpha / r) B A)`` for each module the adapter
    tensors name (and the base weights of the other members of its :data:`FUSED_GROUPS`): ``W`` [out, in] the checkpoint's (read once, from ``model_path``'s safetensors), ``A``
    [r, in], ``B`` [out, r]; computed in float32 and cast to ``W``'s dtype.
    """

    def __init__(self, model_path: str, cfg: LoraConfig):
        from safetensors import safe_open

        self.cfg = cfg
        self.base: dict[str, torch.Tensor] = {}
        kept = set(cfg.targets) | {m for group in FUSED_GROUPS if set(group) & set(cfg.targets) for m in group}
        for file in sorted(os.listdir(model_path)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(model_path, file), framework="pt") as f:
                    for key in f.keys():
                        if key.endswith(".weight") and key.split(".")[-2] in kept:
                            self.base[key[: -len(".weight")]] = f.get_tensor(key)
        if not self.base:
            raise EngineConfigError(f"no weights of the LoRA targets {list(cfg.targets)} in {model_path}'s "
                                    "safetensors files")

    def merged(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            module, which = split_name(name)
            parts.setdefault(module, {})[which] = tensor
        out = []
        for module, ab in parts.items():
            if module not in self.base or set(ab) != {"A", "B"}:
                raise EngineConfigError(f"adapter of {module!r}: got {sorted(ab)} of A and B, base weight "
                                        f"{'known' if module in self.base else 'unknown'}")
            w = self.base[module]
            delta = ab["B"].float() @ ab["A"].float() * self.cfg.scale  # [out, r] @ [r, in]
            out.append((f"{module}.weight", (w.float() + delta).to(w.dtype)))
        for module in list(parts):  # the untargeted members of each fused group sent, as they are
            parent, name = module.rsplit(".", 1)
            for group in FUSED_GROUPS:
                if name in group:
                    out += [(f"{parent}.{m}.weight", self.base[f"{parent}.{m}"]) for m in group
                            if f"{parent}.{m}" not in parts]
        return out


__all__ = ["PEFT_PREFIX", "FUSED_GROUPS", "config_of", "wrap", "base_model", "adapters_disabled", "adapter_tensors",
           "merged_state", "peft_config_dict", "write_adapter", "split_name", "Merger"]
