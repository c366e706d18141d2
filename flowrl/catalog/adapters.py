"""The catalogue of parameter-efficient adapters: ``hf(path, lora = lora(r = 16, alpha = 32, targets = [...]))``.

A model declared with ``lora = lora(...)`` trains low-rank adapters (LoRA, Hu et al. 2021) on top of
frozen base weights, as PEFT does (veRL's ``actor_rollout_ref.model.lora_rank / lora_alpha /
target_modules``, TRL's ``peft_config``): for each targeted linear layer ``y = W x``, the trainer
learns ``A`` [r, in] and ``B`` [out, r] (``B`` starts at zero) and computes
``y = W x + (alpha / r) B A x``. Only ``A`` and ``B`` have gradients and optimizer states, and a
resync sends only them. Like a loss, ``lora(...)`` is a configuration value: its record here says
its options; :attr:`~flowrl.catalog.engines.EngineSpec.lora` says what each engine does with it
(a train engine trains adapters or cannot; a rollout engine loads the adapter tensors, or receives
the weights merged ``W + (alpha / r) B A`` by the runtime before they reach it).

>>> from flowrl.catalog.models import tiny_facts
>>> facts = tiny_facts({})
>>> lora_modules(facts)
('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
>>> lora_params(facts, 8, ["q_proj", "v_proj"])  # 2 layers x (q: 8 x (128 + 128) + v: 8 x (128 + 64))
7168
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.catalog.models import ModelFacts
from flowrl.catalog.spec import KwSpec

ALL_LINEAR = "all-linear"
"""``targets = "all-linear"``: every linear layer of every decoder layer (PEFT's name for it), the
embeddings and the LM head excluded."""

LORA_MODES = ("train", "adapters", "merged")
"""What an engine does with a LoRA model (:attr:`~flowrl.catalog.engines.EngineSpec.lora`): a train
engine ``train`` s the adapters only; a rollout engine loads the adapter tensors as an adapter
(``adapters``: vLLM's LoRA) or gets the base weights with the adapters merged in by the runtime
(``merged``: ``W + (alpha / r) B A`` for each targeted layer, computed where the weights arrive)."""


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter configuration value such as ``lora(r = 16)``: its options, in positional order."""

    name: str
    params: tuple[tuple[str, KwSpec], ...]
    doc: str = ""


ADAPTERS: dict[str, AdapterSpec] = {a.name: a for a in (
    AdapterSpec("lora", (
        ("r", KwSpec("int", 8, min=1, doc="the adapters' rank")),
        ("alpha", KwSpec("float", 16.0, min=0.0, doc="the scale numerator: updates are (alpha / r) B A")),
        ("dropout", KwSpec("float", 0.0, min=0.0, max=0.9,
                           doc="dropout on the adapters' input in the update's forward (log-prob passes run "
                               "without it)")),
        ("targets", KwSpec("any", ALL_LINEAR,
                           doc=f"the linear layers adapted, by module name (a list such as [\"q_proj\", "
                               f"\"v_proj\"]), or \"{ALL_LINEAR}\""))),
        "LoRA: low-rank adapters on the targeted linear layers; the base weights stay frozen."),
)}
"""Adapter records by name (the values ``hf(..., lora = ...)`` and ``tiny(..., lora = ...)`` take)."""


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA as the runtime reads it from the plan (``ModelPlan.args["lora"]``)."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    """Module names (``q_proj``...), :data:`ALL_LINEAR` already expanded."""

    @property
    def scale(self) -> float:
        """``alpha / r``: what multiplies ``B A``."""
        return self.alpha / self.r

    @classmethod
    def from_plan(cls, options: dict, modules: tuple[str, ...]) -> "LoraConfig":
        """From the plan's ``{"name": "lora", "r": .., "alpha": .., "dropout": .., "targets": ..}``;
        ``modules``: the model's adaptable modules (:func:`lora_modules`), which ``"all-linear"`` means."""
        return cls(int(options["r"]), float(options["alpha"]), float(options.get("dropout", 0.0)),
                   expand_targets(options.get("targets", ALL_LINEAR), modules))

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


def lora_modules(facts: ModelFacts) -> tuple[str, ...]:
    """The linear modules of ``facts``' decoder layers a LoRA can target, in checkpoint order: the
    attention projections and a dense MLP's. A mixture of experts' experts and router are not
    adaptable here (transformers 5 holds the experts fused, not as linear layers); GPT-2-style
    families (two-matrix MLP, ``Conv1D`` layers) have none flowrl adapts."""
    if not facts.gated_mlp:
        return ()
    out = []
    for template, _ in facts.tensors():
        parts = template.split(".")
        # model.layers.{i}.self_attn.q_proj.weight / model.layers.{i}.mlp.gate_proj.weight
        if len(parts) == 6 and parts[-1] == "weight" and parts[-2].endswith("_proj"):
            out.append(parts[-2])
    return tuple(dict.fromkeys(out))


def expand_targets(targets, modules: tuple[str, ...]) -> tuple[str, ...]:
    """``targets`` as module names: :data:`ALL_LINEAR` -> ``modules``; a list as written."""
    if targets == ALL_LINEAR:
        return tuple(modules)
    if isinstance(targets, str):
        return (targets,)
    return tuple(str(t) for t in targets)


def lora_tensors(facts: ModelFacts, r: int, targets) -> list[tuple[str, tuple[int, int], int]]:
    """The adapter tensors of each targeted module: ``(name template, shape, layers that have it)``, ``A``
    [r, in] and ``B`` [out, r] under PEFT's names (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A
    .weight``); a dense MLP's modules only in the dense layers of a model with MoE layers."""
    names = set(expand_targets(targets, lora_modules(facts)))
    out = []
    for template, shape in facts.tensors():
        parts = template.split(".")
        if len(parts) == 6 and parts[-1] == "weight" and parts[-2] in names:
            layers = facts.layers - facts.moe_layers if parts[3] == "mlp" else facts.layers
            module = "base_model.model." + template[: -len(".weight")]
            out += [(f"{module}.lora_A.weight", (r, shape[1]), layers), (f"{module}.lora_B.weight", (shape[0], r), layers)]
    return out


def lora_params(facts: ModelFacts, r: int, targets) -> int:
    """Parameters of the adapters: ``r x (in + out)`` for each targeted module of each layer that has it."""
    return sum(layers * shape[0] * shape[1] for _, shape, layers in lora_tensors(facts, r, targets))


ADAPTER_BYTES = 4
"""Bytes per adapter parameter in the trainer and on the wire: PEFT keeps adapters in fp32 even on a
bf16 base model (its ``autocast_adapter_dtype``)."""


__all__ = ["ADAPTERS", "AdapterSpec", "ALL_LINEAR", "LORA_MODES", "LoraConfig", "lora_modules", "expand_targets",
           "lora_tensors", "lora_params", "ADAPTER_BYTES"]
