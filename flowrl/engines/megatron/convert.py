"""transformers Llama / Llama 3.x / Mistral / Qwen2 / Qwen3 / Qwen3-MoE checkpoints <-> Megatron-core ``GPTModel``
state dicts.

Pure tensor bookkeeping (no process groups, no Megatron import), in three layers:

1. :func:`hf_to_megatron` / :func:`megatron_to_hf`: transformers naming <-> the *full*
   (tp=1, pp=1) Megatron layout, with global layer indices.
2. :func:`shard_state` / :func:`unshard_state`: the full Megatron layout <-> the local
   state dict of one (tp_rank, pp_rank, ep_rank), with stage-local layer indices, rank-local
   expert indices and the vocabulary padded to a multiple of ``tp``.
3. :func:`merge_tp` / :func:`split_tp`: one tensor's TP layout (used by the engine to
   gather shards with ``all_gather``).

Layouts (H hidden, d head_dim, nq query heads, nkv KV heads = query groups, F ffn):

* ``linear_qkv.weight`` ``[(nq + 2 nkv) d, H]`` is interleaved *per query group*: for
  each group g, its ``nq/nkv`` query heads, then k_g, then v_g. A TP shard is a
  contiguous block of ``nkv/tp`` whole groups (so ``nkv % tp == 0``).
* ``linear_fc1.weight`` ``[2F, H]`` is ``[gate; up]`` (SwiGLU: ``silu(gate) * up``);
  a TP shard is ``[gate_r; up_r]`` of that rank's ``F/tp`` rows of each.
* A mixture of experts (Qwen3-MoE; Megatron's ``SequentialMLP``): HF ``mlp.gate.weight [E, H]``
  is ``mlp.router.weight``; expert e's ``gate_proj``/``up_proj``/``down_proj`` are
  ``mlp.experts.local_experts.{e}.linear_fc1`` (``[gate; up]``) and ``linear_fc2``. In the full
  layout e is the global expert index; expert-parallel rank r of ``ep`` holds experts
  ``r E/ep .. (r+1) E/ep - 1``, numbered from 0 (Megatron's local numbering). Expert tensors are
  not split over TP (expert tensor parallelism 1); the router is replicated.
* Column-parallel (split dim 0): qkv, fc1, word embeddings, output layer.
  Row-parallel (split dim 1): ``linear_proj`` (o_proj), ``linear_fc2`` (down_proj).
  Norms (Qwen3's per-head ``q_layernorm``/``k_layernorm`` [d] too) and the critic's value
  head are replicated.

Which architectures convert, and which of their variants (RoPE scalings, sliding windows),
is read from their records (:mod:`flowrl.catalog.architectures`), as ``flowrl check`` reads it.

The conversion is a permutation and concatenation of whole rows/columns, so a round
trip HF -> Megatron(tp, pp) -> HF is bit-exact (``tests/megatron/test_convert.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowrl.catalog.architectures import (
    ARCHITECTURES,
    architecture_of,
    conversion_issue,
    moe_layer_pattern,
    rope_parameters,
)
from flowrl.catalog.models import config_value
from flowrl.engines.base import EngineConfigError

StateDict = dict[str, torch.Tensor]


class ConversionError(EngineConfigError):
    """A checkpoint or layout the HF <-> Megatron conversion cannot handle (the message says why)."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a converted decoder (Llama, Llama 3.x, Mistral, Qwen2, Qwen3), read from a
    transformers ``config.json`` through its architecture's record
    (:mod:`flowrl.catalog.architectures`: the keys, biases, QK-norm and RoPE scalings)."""

    arch: str
    """The family (``config.json``'s ``model_type``): ``llama``, ``mistral``, ``qwen2``, ``qwen3``."""
    vocab_size: int
    """Vocabulary size of the checkpoint (before Megatron's TP padding)."""
    hidden: int
    """Hidden size H."""
    layers: int
    """Number of decoder layers."""
    heads: int
    """Query heads nq."""
    kv_heads: int
    """Key/value heads nkv (= Megatron's ``num_query_groups``)."""
    head_dim: int
    """Per-head size d (Megatron's ``kv_channels``); Qwen3's need not be H / nq."""
    ffn: int
    """MLP intermediate size F."""
    rms_eps: float
    """RMSNorm epsilon (the layer norms and, with QK-norm, the query/key norms)."""
    rope_theta: float
    """Rotary base."""
    max_position: int
    """Longest sequence the rotary table covers."""
    tie_embeddings: bool
    """Whether ``lm_head`` shares the input embedding matrix."""
    qkv_bias: bool
    """Whether q/k/v projections have a bias (Qwen2)."""
    qk_norm: bool = False
    """Whether queries and keys are RMS-normalised per head before RoPE (Qwen3)."""
    rope: tuple = (("rope_type", "default"),)
    """The RoPE settings as sorted ``(key, value)`` pairs (:func:`rope_parameters`): its type
    (``default``, ``linear``, ``llama3``) and the scaling's options; see :func:`rope_inv_freq`."""
    experts: int = 0
    """Experts per MoE layer E (0: a dense model)."""
    experts_per_token: int = 0
    """Experts the router picks per token (top-k)."""
    expert_ffn: int = 0
    """Each expert's SwiGLU width (``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """Whether the top-k routing weights are renormalised to sum to 1 (Qwen3-MoE's ``norm_topk_prob``;
    transformers' default, when the config does not say, is False)."""
    moe_pattern: tuple[int, ...] = ()
    """Per layer, 1 if its MLP is a mixture of experts, 0 if dense (empty for a dense model)."""

    @property
    def moe(self) -> bool:
        """The model has mixture-of-experts layers."""
        return self.experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether global layer ``i``'s MLP is a mixture of experts."""
        return bool(self.moe_pattern) and bool(self.moe_pattern[i])

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> "ModelSpec":
        """Read a transformers config dict; raise :class:`ConversionError` for anything unsupported."""
        cfg = dict(cfg)
        record = architecture_of(cfg)
        converted = sorted(a.name for a in ARCHITECTURES.values() if a.converted)
        if record is None or not record.converted:
            what = record.name if record else (cfg.get("architectures") or [cfg.get("model_type")])[0]
            raise ConversionError(
                f"{what!r} checkpoints are not converted to Megatron's layout; it converts {', '.join(converted)}"
                + (f" ({record.name}: {record.doc})" if record else ""))
        issue = conversion_issue(cfg)
        if issue:
            raise ConversionError(f"this {record.name} checkpoint cannot be converted to Megatron's layout: {issue}")

        def fact(name: str, default: Any = KeyError) -> Any:
            key = record.key(name)
            if key and cfg.get(key) is not None:
                return cfg[key]
            if default is KeyError:
                raise ConversionError(f"config.json has no {key!r}; is it a {record.name} config?")
            return default

        heads, hidden = int(fact("heads")), int(fact("hidden"))
        rope = rope_parameters(cfg)
        layers = int(fact("layers"))
        moe: dict[str, Any] = {}
        if record.moe:
            moe = dict(experts=int(config_value(cfg, "experts")),
                       experts_per_token=int(config_value(cfg, "experts_per_token")),
                       expert_ffn=int(config_value(cfg, "expert_intermediate")),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # transformers' default
                       moe_pattern=moe_layer_pattern(cfg, layers))
        return ModelSpec(
            arch=record.family,
            vocab_size=int(cfg["vocab_size"]),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(fact("kv_heads", None) or heads),
            head_dim=int(fact("head_dim", None) or hidden // heads),
            ffn=int(fact("intermediate")),
            rms_eps=float(fact("norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            max_position=int(fact("max_positions", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", record.tied_default)),
            qkv_bias=record.qkv_bias,
            qk_norm=record.qk_norm,
            rope=tuple(sorted(rope.items())),
            **moe,
        )

    @staticmethod
    def from_pretrained(path: str | Path) -> "ModelSpec":
        """Read ``path/config.json`` (a ``save_pretrained`` directory)."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConversionError(f"no config.json in {str(path)!r}; pass a transformers save_pretrained directory")
        return ModelSpec.from_hf_config(json.loads(file.read_text()))

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one KV head."""
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: tensor-, pipeline- and expert-parallel sizes and ranks, and the vocabulary padding."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    vocab_divisible_by: int = 1
    """The padded vocabulary is a multiple of ``vocab_divisible_by * tp_size`` (Megatron's
    ``make_vocab_size_divisible_by``)."""
    ep_size: int = 1
    """Expert-parallel size: each rank of an expert-parallel group holds ``experts / ep_size`` experts."""
    ep_rank: int = 0


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> None:
    """Raise :class:`ConversionError` if the model cannot be split ``tp`` x ``pp`` ways, its experts ``ep`` ways."""
    if ep > 1 and not spec.moe:
        raise ConversionError(f"ep={ep} splits a mixture of experts, and this {spec.arch} model has none; use ep=1")
    if spec.moe and spec.experts % ep:
        raise ConversionError(f"the model's {spec.experts} experts per layer are not divisible by ep={ep}; "
                              "choose an ep that divides the experts")
    problems = (
        (spec.heads % tp == 0, f"num_attention_heads={spec.heads} is not divisible by tp={tp}"),
        (spec.kv_heads % tp == 0, f"num_key_value_heads={spec.kv_heads} is not divisible by tp={tp}"),
        (spec.moe or spec.ffn % tp == 0, f"intermediate_size={spec.ffn} is not divisible by tp={tp}"),
        (spec.layers % pp == 0, f"num_hidden_layers={spec.layers} is not divisible by pp={pp}"),
    )
    for ok, message in problems:
        if not ok:
            raise ConversionError(f"{message}; choose tp/pp that divide the model's heads, KV heads, MLP and layers")


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp_size``.

    >>> padded_vocab_size(17, 2)
    18
    >>> padded_vocab_size(17, 2, 128)
    256
    """
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global indices of the decoder layers pipeline stage ``pp_rank`` holds (even split).

    >>> list(layer_range(4, 2, 1))
    [2, 3]
    """
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


# ------------------------------------------------------------ HF <-> full Megatron

_LAYER_NORMS = {  # Megatron suffix -> HF suffix, inside a layer
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
"""Layer tensors that map one to one (same layout)."""

_QK_NORMS = {  # Qwen3's per-head query/key RMSNorm weights [d], replicated over TP
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def _one_to_one(spec: ModelSpec) -> dict[str, str]:
    """Megatron suffix -> HF suffix of the layer tensors ``spec``'s family maps one to one."""
    return {**_LAYER_NORMS, **(_QK_NORMS if spec.qk_norm else {})}


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q [nq d, ...], k/v [nkv d, ...] -> Megatron's per-group interleaved [(nq + 2 nkv) d, ...]."""
    rest = q.shape[1:]
    q = q.reshape(spec.kv_heads, spec.heads_per_group * spec.head_dim, *rest)
    k = k.reshape(spec.kv_heads, spec.head_dim, *rest)
    v = v.reshape(spec.kv_heads, spec.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    rest = qkv.shape[1:]
    qd = spec.heads_per_group * spec.head_dim
    groups = qkv.reshape(spec.kv_heads, qd + 2 * spec.head_dim, *rest)
    q, k, v = torch.split(groups, [qd, spec.head_dim, spec.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], spec: ModelSpec, role: str = "actor") -> StateDict:
    """transformers state dict -> full (tp=1, pp=1) Megatron ``GPTModel`` state dict.

    ``hf`` uses the names of ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (actor) or of
    flowrl's critic (base model under ``model.`` plus ``value_head.weight [1, H]`` and
    ``value_head.bias [1]``). Output tensors are the input tensors or concatenations of
    them (no arithmetic). A tied checkpoint may omit ``lm_head.weight``.
    """
    _require(hf, ["model.embed_tokens.weight", "model.norm.weight"])
    out: StateDict = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    for i in range(spec.layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mg, name in _one_to_one(spec).items():
            out[dst + mg] = _get(hf, src + name)
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            _get(hf, attn + "q_proj.weight"), _get(hf, attn + "k_proj.weight"), _get(hf, attn + "v_proj.weight"), spec
        )
        if spec.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                _get(hf, attn + "q_proj.bias"), _get(hf, attn + "k_proj.bias"), _get(hf, attn + "v_proj.bias"), spec
            )
        if spec.is_moe_layer(i):
            out.update(_experts_to_megatron(hf, spec, src, dst))
            continue
        out[dst + "mlp.linear_fc2.weight"] = _get(hf, src + "mlp.down_proj.weight")
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [_get(hf, src + "mlp.gate_proj.weight"), _get(hf, src + "mlp.up_proj.weight")], dim=0
        )
    if role == "critic":
        out["output_layer.weight"] = _get(hf, "value_head.weight")
        out["output_layer.bias"] = _get(hf, "value_head.bias")
    elif not spec.tie_embeddings:
        out["output_layer.weight"] = _get(hf, "lm_head.weight")
    return out


def megatron_to_hf(mg: Mapping[str, torch.Tensor], spec: ModelSpec, role: str = "actor") -> StateDict:
    """Megatron state dict (global layer numbers) -> transformers naming (inverse of :func:`hf_to_megatron`).

    ``mg`` may hold only part of the model (one pipeline stage's tensors): each tensor
    present is converted, nothing is required. An actor with tied embeddings gets
    ``lm_head.weight`` = the embedding (what transformers' ``state_dict()`` shows and
    vLLM accepts); a critic's output layer becomes ``value_head.*``.
    """
    out: StateDict = {}
    if "embedding.word_embeddings.weight" in mg:
        out["model.embed_tokens.weight"] = mg["embedding.word_embeddings.weight"]
        if spec.tie_embeddings and role == "actor":
            out["lm_head.weight"] = mg["embedding.word_embeddings.weight"]
    if "decoder.final_layernorm.weight" in mg:
        out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    for i in sorted({idx for idx in map(_layer_index, mg) if idx is not None}):
        out.update(_layer_to_hf(mg, spec, i))
    head = {"weight": "value_head.weight", "bias": "value_head.bias"} if role == "critic" else {
        "weight": "lm_head.weight"}
    for suffix, hf_name in head.items():
        if f"output_layer.{suffix}" in mg:
            out[hf_name] = mg[f"output_layer.{suffix}"]
    return out


def _layer_to_hf(mg: Mapping[str, torch.Tensor], spec: ModelSpec, i: int) -> StateDict:
    """Decoder layer ``i``'s tensors (all of them must be in ``mg``) in transformers naming."""
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {dst + hf_name: _get(mg, src + name) for name, hf_name in _one_to_one(spec).items()}
    q, k, v = _split_qkv(_get(mg, src + "self_attention.linear_qkv.weight"), spec)
    out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v})
    if spec.qkv_bias:
        qb, kb, vb = _split_qkv(_get(mg, src + "self_attention.linear_qkv.bias"), spec)
        out.update({dst + "self_attn.q_proj.bias": qb, dst + "self_attn.k_proj.bias": kb,
                    dst + "self_attn.v_proj.bias": vb})
    if spec.is_moe_layer(i):
        out.update(_experts_to_hf(mg, spec, src, dst))
        return out
    gate, up = torch.chunk(_get(mg, src + "mlp.linear_fc1.weight"), 2, dim=0)
    out[dst + "mlp.gate_proj.weight"] = gate
    out[dst + "mlp.up_proj.weight"] = up
    out[dst + "mlp.down_proj.weight"] = _get(mg, src + "mlp.linear_fc2.weight")
    return out


_EXPERT = "mlp.experts.local_experts."
"""Megatron's prefix of a MoE layer's experts (``SequentialMLP``), inside a layer."""


def _experts_to_megatron(hf: Mapping[str, torch.Tensor], spec: ModelSpec, src: str, dst: str) -> StateDict:
    """One MoE layer's router and experts, HF -> Megatron (global expert numbers)."""
    out = {dst + "mlp.router.weight": _get(hf, src + "mlp.gate.weight")}
    for e in range(spec.experts):
        hf_e, mg_e = f"{src}mlp.experts.{e}.", f"{dst}{_EXPERT}{e}."
        out[mg_e + "linear_fc1.weight"] = torch.cat(
            [_get(hf, hf_e + "gate_proj.weight"), _get(hf, hf_e + "up_proj.weight")], dim=0)
        out[mg_e + "linear_fc2.weight"] = _get(hf, hf_e + "down_proj.weight")
    return out


def _experts_to_hf(mg: Mapping[str, torch.Tensor], spec: ModelSpec, src: str, dst: str) -> StateDict:
    """Inverse of :func:`_experts_to_megatron` (every expert must be in ``mg``)."""
    out = {dst + "mlp.gate.weight": _get(mg, src + "mlp.router.weight")}
    for e in range(spec.experts):
        hf_e, mg_e = f"{dst}mlp.experts.{e}.", f"{src}{_EXPERT}{e}."
        gate, up = torch.chunk(_get(mg, mg_e + "linear_fc1.weight"), 2, dim=0)
        out[hf_e + "gate_proj.weight"], out[hf_e + "up_proj.weight"] = gate, up
        out[hf_e + "down_proj.weight"] = _get(mg, mg_e + "linear_fc2.weight")
    return out


def expert_index(name: str) -> int | None:
    """``decoder.layers.{i}.mlp.experts.local_experts.{e}.…`` -> e; None for other tensors."""
    if _EXPERT not in name:
        return None
    return int(name.split(_EXPERT, 1)[1].split(".", 1)[0])


def _renumber_expert(name: str, index: int) -> str:
    head, tail = name.split(_EXPERT, 1)
    return f"{head}{_EXPERT}{index}.{tail.split('.', 1)[1]}"


def expert_range(spec: ModelSpec, ep_size: int, ep_rank: int) -> range:
    """Global indices of the experts expert-parallel rank ``ep_rank`` holds (Megatron's even split).

    >>> spec = ModelSpec("qwen3_moe", 8, 64, 1, 2, 2, 32, 64, 1e-6, 1e4, 64, False, False, experts=8)
    >>> list(expert_range(spec, 2, 1))
    [4, 5, 6, 7]
    """
    per_rank = spec.experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def experts_to_global(local: Mapping[str, torch.Tensor], spec: ModelSpec, ep_size: int, ep_rank: int) -> StateDict:
    """Rank-local expert numbering -> global (expert 0 of ep rank 1 of 2, with 8 experts -> 4)."""
    offset = expert_range(spec, ep_size, ep_rank).start
    out: StateDict = {}
    for name, tensor in local.items():
        e = expert_index(name)
        out[name if e is None else _renumber_expert(name, e + offset)] = tensor
    return out


# ------------------------------------------------------------------------- RoPE


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """The rotary frequencies ``[head_dim / 2]`` (radians per position, float32) of ``spec``'s RoPE,
    as transformers computes them (``modeling_rope_utils``): plain RoPE (``theta^(-2i/d)``),
    ``linear`` (divided by ``factor``) or ``llama3`` (Llama 3.x: wavelengths above
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, below
    ``... / high_freq_factor`` kept, a linear blend in between).

    Megatron's own RoPE knows plain RoPE and Llama 3's scaling with its 8192-token defaults
    only, so the engine sets these frequencies on its rotary module
    (:func:`set_rope_frequencies`).

    >>> spec = ModelSpec("llama", 8, 64, 1, 2, 2, 32, 64, 1e-6, 10000.0, 64, False, False)
    >>> rope_inv_freq(spec)[:2]
    tensor([1.0000, 0.5623])
    """
    params = dict(spec.rope)
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv
    factor = float(params["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, blended, scaled)
    raise ConversionError(f"rope_type {kind!r} is not converted; the converters take default, linear, llama3")


def set_rope_frequencies(model: torch.nn.Module, spec: ModelSpec) -> int:
    """Give every rotary module of a Megatron model (an ``inv_freq`` attribute) ``spec``'s
    frequencies (:func:`rope_inv_freq`); returns how many it set. Call before the first forward:
    Megatron caches the rotary table per sequence length."""
    count = 0
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            module.inv_freq = rope_inv_freq(spec).to(inv.device)
            count += 1
    return count


# ------------------------------------------------------------- TP / PP sharding

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_FC1 = "mlp.linear_fc1.weight"


def tp_rule(name: str, role: str = "actor") -> str:
    """How tensor ``name`` (Megatron naming) is split across TP ranks.

    ``"vocab"`` (dim 0, padded vocabulary), ``"column"`` (dim 0), ``"row"`` (dim 1),
    ``"fc1"`` (dim 0, gate and up halves split separately) or ``"replicated"``.
    """
    if name.startswith("output_layer.") and role == "critic":
        return "replicated"  # the value head is a tiny Linear(H, 1), kept whole on every rank
    if _EXPERT in name or name.endswith("mlp.router.weight"):
        return "replicated"  # expert tensor parallelism 1: experts are whole, split over EP instead
    if name in _VOCAB:
        return "vocab"
    if name.endswith(_FC1):
        return "fc1"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def split_tp(name: str, full: torch.Tensor, spec: ModelSpec, layout: Layout, role: str = "actor") -> torch.Tensor:
    """TP shard ``layout.tp_rank`` of one full Megatron tensor (a contiguous copy)."""
    rule, tp, r = tp_rule(name, role), layout.tp_size, layout.tp_rank
    if rule == "replicated" or (tp == 1 and rule != "vocab"):
        return full.clone()
    if rule == "vocab":
        padded = padded_vocab_size(spec.vocab_size, tp, layout.vocab_divisible_by)
        # Padding rows are zero: the engine masks their logits, so they never matter.
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return torch.chunk(full, tp, dim=0)[r].clone()
    if rule == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, dim=0)[r], torch.chunk(up, tp, dim=0)[r]]).clone()
    return torch.chunk(full, tp, dim=1 if rule == "row" else 0)[r].clone()


def merge_tp(name: str, shards: list[torch.Tensor], spec: ModelSpec, role: str = "actor") -> torch.Tensor:
    """The full Megatron tensor from its TP shards in rank order (inverse of :func:`split_tp`)."""
    rule = tp_rule(name, role)
    if rule == "replicated":
        return shards[0]
    if rule == "vocab":
        return torch.cat(shards, dim=0)[: spec.vocab_size]
    if rule == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if rule == "row" else 0)


def _layer_index(name: str) -> int | None:
    """``decoder.layers.{i}.…`` -> i; None for tensors outside the layer stack."""
    if not name.startswith("decoder.layers."):
        return None
    return int(name.split(".")[2])


def _renumber(name: str, index: int) -> str:
    parts = name.split(".")
    parts[2] = str(index)
    return ".".join(parts)


def stage_owns(name: str, spec: ModelSpec, layout: Layout, role: str = "actor") -> bool:
    """Whether pipeline stage ``layout.pp_rank`` holds full-model tensor ``name``."""
    first, last = layout.pp_rank == 0, layout.pp_rank == layout.pp_size - 1
    index = _layer_index(name)
    if index is not None:
        return index in layer_range(spec.layers, layout.pp_size, layout.pp_rank)
    if name.startswith("embedding."):
        return first
    if name == "output_layer.weight" and spec.tie_embeddings and role == "actor":
        return False  # tied: the output layer reads the embedding (pp=1 only)
    return last  # final norm and output layer / value head


def shard_state(full: Mapping[str, torch.Tensor], spec: ModelSpec, layout: Layout, role: str = "actor") -> StateDict:
    """Full Megatron state dict -> the local state dict of one (tp_rank, pp_rank, ep_rank).

    Layers are renumbered from 0 within the stage and experts from 0 within the expert-parallel
    rank (Megatron's local numbering); vocabulary tensors are padded to the TP multiple and split.
    """
    offset = layer_range(spec.layers, layout.pp_size, layout.pp_rank).start
    experts = expert_range(spec, layout.ep_size, layout.ep_rank) if spec.moe else range(0)
    out: StateDict = {}
    for name, tensor in full.items():
        if not stage_owns(name, spec, layout, role):
            continue
        e = expert_index(name)
        if e is not None:
            if e not in experts:
                continue
            name_here = _renumber_expert(name, e - experts.start)
        else:
            name_here = name
        index = _layer_index(name)
        local = name_here if index is None else _renumber(name_here, index - offset)
        out[local] = split_tp(name, tensor, spec, layout, role)
    return out


def to_global_names(local: Mapping[str, torch.Tensor], spec: ModelSpec, pp_size: int, pp_rank: int) -> StateDict:
    """Stage-local layer numbering -> global (``decoder.layers.0`` of stage 1 of 2 in a 4-layer model -> 2)."""
    offset = layer_range(spec.layers, pp_size, pp_rank).start
    out: StateDict = {}
    for name, tensor in local.items():
        index = _layer_index(name)
        out[name if index is None else _renumber(name, index + offset)] = tensor
    return out


def unshard_state(
    shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]], spec: ModelSpec, tp: int, pp: int,
    role: str = "actor", ep: int = 1,
) -> StateDict:
    """``{(tp_rank, pp_rank): local state dict}`` of every rank (``(tp_rank, pp_rank, ep_rank)``
    with ``ep > 1``) -> the full Megatron state dict."""
    key = (lambda t, p, e: (t, p)) if ep == 1 else (lambda t, p, e: (t, p, e))
    missing = [key(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep) if key(t, p, e) not in shards]
    if missing:
        raise ConversionError(f"unshard_state: no shard for {'(tp_rank, pp_rank' + (', ep_rank)' if ep > 1 else ')')}"
                              f" in {missing}")
    full: StateDict = {}
    for p in range(pp):
        for e in range(ep):
            names = [n for n in shards[key(0, p, e)] if not n.endswith("._extra_state")]
            stage = {n: merge_tp(n, [shards[key(t, p, e)][n] for t in range(tp)], spec, role) for n in names}
            full.update(to_global_names(experts_to_global(stage, spec, ep, e), spec, pp, p))
    return full


def _require(sd: Mapping[str, torch.Tensor], names: list[str]) -> None:
    for name in names:
        _get(sd, name)


def _get(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        sample = ", ".join(sorted(sd)[:4])
        raise ConversionError(f"checkpoint has no tensor {name!r} (it has e.g. {sample}); is it a model of the "
                              "family its config.json names?")
    return sd[name]
