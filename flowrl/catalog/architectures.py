"""The catalogue of model architectures: one record per transformers decoder class flowrl knows.

A record says how the family's ``config.json`` names each fact, what its layers hold
(q/k/v biases, QK-norm, a gated MLP, tied embeddings by default), how it encodes positions
and which RoPE scalings the weight converters take, and which engines run it. Three readers
share it, so they cannot disagree:

* the compiler's model facts (:func:`flowrl.catalog.models.from_config`: which keys it reads,
  whether q/k/v carry biases, whether the converters can take the checkpoint);
* the engines' architecture lists (:attr:`flowrl.catalog.engines.EngineSpec.architectures`:
  an engine that rebuilds the model from its weights by family, Megatron, runs exactly the
  records that name it);
* the HF <-> Megatron weight conversion (:mod:`flowrl.engines.megatron.convert`).

A mixture-of-experts family (Qwen3-MoE) names its expert facts too (``experts``,
``experts_per_token``, ``expert_intermediate``): the compiler counts every expert's weights
in the model's size; the engines that load any decoder run it, and Megatron (its converter maps the
router and experts to Megatron-core's ``SequentialMLP``, sharded over expert parallelism); fsdp does
not (its wrapping is Llama's).

:data:`TINY_ARCHS` are the variants ``tiny(arch = ...)`` builds locally (one per family, plus
Llama 3.x's RoPE scaling), read by ``flowrl check`` and by :mod:`flowrl.models.families`.

>>> ARCHITECTURES["Qwen3ForCausalLM"].qk_norm, ARCHITECTURES["GPT2LMHeadModel"].positions
(True, 'absolute')
>>> architecture_of({"architectures": ["MistralForCausalLM"]}).family
'mistral'
>>> conversion_issue({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}})
"rope_type 'yarn' (the converters take 'default', 'linear', 'llama3')"
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE variants whose only effect is the rotary frequencies (no attention scaling, no
position-dependent switch), so a converter reproduces them by setting the frequencies:
plain RoPE, linear position interpolation, and Llama 3.x's frequency-band scaling."""

_LOADERS = frozenset({"torch", "hf_generate", "vllm", "sglang"})
"""Engines that load any decoder transformers loads (their ``architectures`` is None)."""
_LLAMA_LIKE = _LOADERS | {"fsdp", "megatron"}
"""Engines that run Llama-style decoders: fsdp wraps each of ``model.model.layers`` in FSDP, and
Megatron converts the weights (:mod:`flowrl.engines.megatron.convert`)."""

_LLAMA_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size",
               "max_positions": "max_position_embeddings", "head_dim": "head_dim", "norm_eps": "rms_norm_eps",
               "activation": "hidden_act"}
_MOE_KEYS = {**_LLAMA_KEYS, "experts": "num_experts", "experts_per_token": "num_experts_per_tok",
             "expert_intermediate": "moe_intermediate_size"}
_GPT2_KEYS = {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "intermediate": "n_inner",
              "max_positions": "n_positions", "norm_eps": "layer_norm_epsilon", "activation": "activation_function"}


@dataclass(frozen=True)
class ArchitectureSpec:
    """One transformers decoder architecture (``config.json``'s ``architectures[0]``)."""

    name: str
    """The transformers class, e.g. ``LlamaForCausalLM``."""
    family: str
    """``config.json``'s ``model_type`` (``llama``, ``qwen3``, ``gpt2``...)."""
    doc: str
    engines: frozenset[str]
    """Engines that run it. An engine whose ``EngineSpec.architectures`` is read from these
    records (:func:`architectures_run_by`: Megatron, which converts weights by family; fsdp, which
    wraps Llama-style layer stacks) runs exactly the architectures naming it; the others load any
    decoder transformers loads."""
    config_keys: dict[str, str]
    """Fact (``hidden``, ``layers``, ``heads``, ``kv_heads``, ``intermediate``, ``max_positions``,
    ``head_dim``, ``norm_eps``, ``activation``; mixtures of experts: ``experts``,
    ``experts_per_token``, ``expert_intermediate``) -> the key this family's ``config.json``
    holds it under; a fact without a key is not in the family's config (GPT-2 has no KV
    heads, dense families no experts)."""
    positions: str = "rope"
    """``rope`` (rotary, computed from positions: any padding works) or ``absolute`` (a
    learned position table, GPT-2)."""
    rope_types: tuple[str, ...] = ROPE_TYPES
    """RoPE scalings (``rope_type``) the converters take; empty for absolute positions."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Queries and keys are RMS-normalised per head before RoPE (Qwen3: ``q_norm``/``k_norm``)."""
    gated_mlp: bool = True
    """SwiGLU MLP (gate, up, down: three matrices); else two (GPT-2's ``c_fc``, ``c_proj``)."""
    activation: str = "silu"
    """The MLP activation the converters take (``hidden_act``)."""
    tied_default: bool = False
    """``tie_word_embeddings`` when the config does not say (GPT-2 ties its LM head)."""
    window_flag: str | None = None
    """Config key that switches the sliding window on (Qwen2/3's ``use_sliding_window``); None:
    the window applies whenever ``sliding_window`` is set (Mistral)."""
    has_window: bool = False
    """The family has a ``sliding_window`` option."""
    dense_layer_keys: tuple[str, ...] = ()
    """Mixtures of experts: config keys that make some layers dense (Qwen3-MoE's ``mlp_only_layers``,
    a list of layer indices, and ``decoder_sparse_step``: layer i has experts when (i + 1) divides
    by it), read by :func:`moe_layers`."""

    @property
    def moe(self) -> bool:
        """The family's MLPs are mixtures of experts (its config names ``experts``)."""
        return "experts" in self.config_keys

    def key(self, fact: str) -> str | None:
        """The config key of ``fact`` in this family, or None."""
        return self.config_keys.get(fact)

    @property
    def converted(self) -> bool:
        """Weights convert to Megatron's layout (:mod:`flowrl.engines.megatron.convert`)."""
        return "megatron" in self.engines


ARCHITECTURES: dict[str, ArchitectureSpec] = {a.name: a for a in (
    ArchitectureSpec(
        "LlamaForCausalLM", "llama", "Llama 2/3.x: RMSNorm, SwiGLU, GQA, RoPE (Llama 3.x scales it: rope_type llama3)",
        _LLAMA_LIKE, _LLAMA_KEYS),
    ArchitectureSpec(
        "MistralForCausalLM", "mistral", "Mistral: Llama's layers; a sliding window when `sliding_window` is set",
        _LLAMA_LIKE, _LLAMA_KEYS, has_window=True),
    ArchitectureSpec(
        "Qwen2ForCausalLM", "qwen2", "Qwen2/2.5: Llama's layers with q/k/v biases",
        _LLAMA_LIKE, _LLAMA_KEYS, qkv_bias=True, has_window=True, window_flag="use_sliding_window"),
    ArchitectureSpec(
        "Qwen3ForCausalLM", "qwen3", "Qwen3 (dense): no q/k/v biases, per-head RMSNorm of queries and keys (QK-norm)",
        _LLAMA_LIKE, _LLAMA_KEYS, qk_norm=True, has_window=True, window_flag="use_sliding_window"),
    ArchitectureSpec(
        "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE: Qwen3's attention (QK-norm); each MLP a router over "
        "`num_experts` SwiGLU experts, `num_experts_per_tok` of them per token",
        _LOADERS | {"megatron"}, _MOE_KEYS, qk_norm=True, has_window=True, window_flag="use_sliding_window",
        dense_layer_keys=("mlp_only_layers", "decoder_sparse_step")),
    ArchitectureSpec(
        "GPT2LMHeadModel", "gpt2", "GPT-2: LayerNorm, GELU (tanh) MLP, learned absolute positions, tied LM head",
        _LOADERS, _GPT2_KEYS, positions="absolute", rope_types=(), gated_mlp=False, activation="gelu_new",
        tied_default=True),
)}
"""Architectures by transformers class name."""

_BY_FAMILY = {a.family: a for a in ARCHITECTURES.values()}


def architecture_of(cfg: dict) -> ArchitectureSpec | None:
    """The record of a ``config.json`` (by ``architectures[0]``, else ``model_type``); None if unknown."""
    archs = cfg.get("architectures") or []
    if archs and str(archs[0]) in ARCHITECTURES:
        return ARCHITECTURES[str(archs[0])]
    return _BY_FAMILY.get(str(cfg.get("model_type") or ""))


def architectures_run_by(engine: str) -> frozenset[str]:
    """The architectures whose records name ``engine``."""
    return frozenset(a.name for a in ARCHITECTURES.values() if engine in a.engines)


def rope_parameters(cfg: dict) -> dict:
    """A config's RoPE settings in one dict (``rope_type``, ``rope_theta``, the scaling's options),
    whichever way the config writes them: transformers 5's ``rope_parameters``, or the hub's
    ``rope_theta`` + ``rope_scaling`` (whose older spelling of ``rope_type`` is ``type``).

    >>> rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    {'rope_type': 'linear', 'rope_theta': 500000.0, 'factor': 2.0}
    """
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    params = {**scaling, **params}
    out = {"rope_type": str(params.pop("rope_type", None) or "default"),
           "rope_theta": float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))}
    params.pop("type", None)
    return {**out, **params}


def sliding_window(cfg: dict) -> int | None:
    """The attention window a config applies (tokens), or None when attention is global."""
    arch = architecture_of(cfg)
    if arch is None or not arch.has_window or not cfg.get("sliding_window"):
        return None
    if arch.window_flag is not None and not cfg.get(arch.window_flag):
        return None
    return int(cfg["sliding_window"])


def moe_layers(cfg: dict, layers: int) -> int:
    """How many of a config's ``layers`` layers hold experts (0 for a dense family).

    >>> moe_layers({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [0]}, 4)
    3
    >>> moe_layers({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 2}, 4)
    2
    """
    return sum(moe_layer_pattern(cfg, layers))


def moe_layer_pattern(cfg: dict, layers: int) -> tuple[int, ...]:
    """Per layer, 1 if a config's layer holds experts, 0 if its MLP is dense (all 0 for a dense family).

    >>> moe_layer_pattern({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [0]}, 3)
    (0, 1, 1)
    """
    arch = architecture_of(cfg)
    if arch is None or not arch.moe:
        return (0,) * layers
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()} if "mlp_only_layers" in arch.dense_layer_keys else set()
    step = int(cfg.get("decoder_sparse_step") or 1) if "decoder_sparse_step" in arch.dense_layer_keys else 1
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))


def expert_layout_problems(experts: int, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1,
                           ep: int = 1) -> list[tuple[str, str]]:
    """Why Megatron cannot split a model with ``experts`` experts per MoE layer (0: dense) over this
    layout: ``(option, reason)`` pairs, empty when it can. Read by the engine and by ``flowrl check``.

    Expert parallelism carves ``ep`` groups out of the data-parallel ranks (each rank keeps its own
    batch rows and sends each token to the rank holding its experts), so ``ep`` divides ``dp``; each
    rank holds ``experts / ep`` whole experts (expert tensor parallelism 1). MoE layers run with
    tp = 1: Megatron-core 0.19's ``MoELayer.forward`` raises in training with tp > 1 unless
    sequence parallelism is on, which this engine does not use. (pp and cp work, tested with ep = 1.)

    >>> expert_layout_problems(8, dp=2, ep=2)
    []
    >>> expert_layout_problems(8, cp=2, pp=2)
    []
    >>> expert_layout_problems(6, dp=4, ep=4)[0][1]
    "the model's 6 experts per MoE layer do not divide by ep = 4"
    """
    problems = []
    if ep > 1 and not experts:
        problems.append(("ep", f"ep = {ep} splits experts, and the model is dense (no mixture of experts)"))
    if experts and experts % ep:
        problems.append(("ep", f"the model's {experts} experts per MoE layer do not divide by ep = {ep}"))
    if ep > 1 and dp % ep:
        problems.append(("ep", f"ep = {ep} does not divide dp = {dp} (expert-parallel groups are made of "
                               "data-parallel ranks)"))
    if experts and tp > 1:
        problems.append(("tp", f"tp = {tp} with a mixture of experts (Megatron-core's MoE layers train with tp > 1 "
                               "only under sequence parallelism, which the engine does not use); split the experts "
                               "with ep and the batch with dp"))
    return problems


def conversion_issue(cfg: dict) -> str:
    """Why the weight converters cannot take a config of a converted architecture ("" if they can).

    The converters rebuild the model from its family's record: an unknown RoPE scaling, another
    activation, extra biases or a sliding window shorter than the context would be dropped
    silently, so they are refused by name.
    """
    arch = architecture_of(cfg)
    if arch is None:
        return ""
    problems = []
    if arch.positions == "rope":
        rope = rope_parameters(cfg)["rope_type"]
        if rope not in arch.rope_types:
            problems.append(f"rope_type {rope!r} (the converters take {', '.join(map(repr, arch.rope_types))})")
    act = cfg.get(arch.key("activation") or "", arch.activation)
    if act != arch.activation:
        problems.append(f"{arch.key('activation')} {act!r} ({arch.family} converts {arch.activation!r})")
    if cfg.get("mlp_bias") or (cfg.get("attention_bias") and not arch.qkv_bias):
        problems.append("mlp_bias / attention_bias (the converters take bias-free projections"
                        + (" besides q/k/v" if arch.qkv_bias else "") + ")")
    layers = int(cfg.get(arch.key("layers") or "") or 0)
    if arch.moe and not all(moe_layer_pattern(cfg, layers)):
        # Megatron's layer spec here makes every layer a MoE layer (one spec for the whole stack)
        problems.append(f"{' / '.join(arch.dense_layer_keys)} make some layers dense (the converters take "
                        "mixtures of experts whose every layer is sparse)")
    window = sliding_window(cfg)
    positions = cfg.get(arch.key("max_positions") or "")
    if window is not None and positions and window < int(positions):
        problems.append(f"sliding_window {window} < {arch.key('max_positions')} {positions} "
                        "(converted models attend to the whole context)")
    return "; ".join(problems)


@dataclass(frozen=True)
class TinyArch:
    """A variant ``tiny(arch = ...)`` builds locally: an architecture and the config entries that
    make it that variant (beyond the shape the tiny model's options give)."""

    name: str
    architecture: str
    """A key of :data:`ARCHITECTURES`."""
    doc: str
    config: dict = field(default_factory=dict)
    """``config.json`` entries of the variant (RoPE scaling, head size...)."""

    @property
    def spec(self) -> ArchitectureSpec:
        return ARCHITECTURES[self.architecture]


TINY_ARCHS: dict[str, TinyArch] = {t.name: t for t in (
    TinyArch("llama", "LlamaForCausalLM", "Llama with plain RoPE"),
    TinyArch("llama3", "LlamaForCausalLM", "Llama 3.x: RoPE scaled by frequency band (rope_type llama3)",
             # original_max_position_embeddings 32 puts the tiny head's frequencies in all three bands
             # (kept, smoothed, divided by the factor) within a 128-token context.
             {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    TinyArch("qwen2", "Qwen2ForCausalLM", "Qwen2: q/k/v biases"),
    TinyArch("qwen3", "Qwen3ForCausalLM", "Qwen3: QK-norm, head size 64 whatever hidden / heads",
             {"head_dim": 64}),
    TinyArch("mistral", "MistralForCausalLM", "Mistral without a sliding window (v0.2 and later)",
             {"sliding_window": None}),
    TinyArch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE: 8 experts of width 64, 2 per token (weights "
             "renormalised over the 2), head size 64; every layer sparse",
             # An expert width that divides by 32: vLLM's CPU MoE kernel pads others, and then its
             # in-place reload fails (flowrl.catalog.models.CPU_MOE_ALIGN).
             {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
              "norm_topk_prob": True}),
    TinyArch("gpt2", "GPT2LMHeadModel", "GPT-2: learned positions, LayerNorm, gelu_new, dropout 0.1 in its config"),
)}
"""``tiny(arch = ...)`` variants by name."""


__all__ = ["ArchitectureSpec", "ARCHITECTURES", "ROPE_TYPES", "TinyArch", "TINY_ARCHS", "architecture_of",
           "architectures_run_by", "rope_parameters", "sliding_window", "moe_layers", "moe_layer_pattern",
           "conversion_issue", "expert_layout_problems"]
