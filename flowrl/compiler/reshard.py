"""Resharding plans: how a model's weights move from a train layout to a rollout layout.

Each engine holds a tensor family as its record's weight layout says
(:attr:`~flowrl.catalog.engines.EngineSpec.weights`, a
:class:`~flowrl.catalog.engines.WeightLayout`):

=============  ===========================================================================
layout         attention q/k/v, MLP gate/up (fused?), sharded by tensor parallelism (tp)
=============  ===========================================================================
``megatron``   ``linear_qkv`` fused and *interleaved per KV-head group* (``[q_g; k_g; v_g]`` for
(megatron)     each group g), groups split across tp ranks; ``linear_fc1`` = ``[gate; up]``
               per rank; row-parallel ``linear_proj`` / ``linear_fc2`` split on dim 1;
               vocab-parallel embedding and output layer; pipeline stages own layer ranges
``vllm``       ``qkv_proj`` fused per rank as ``[q heads of rank; k; v]`` (KV heads replicated
(vllm, sglang) when tp exceeds them); ``gate_up_proj`` = ``[gate; up]`` per rank; the rest as
               Megatron
``hf`` (fsdp,  the checkpoint's own tensors (``q_proj``, ``k_proj``...), unsharded (FSDP's flat
torch, ...)    shards are gathered into full tensors first)
=============  ===========================================================================

Each layout maps its local rows to rows of the checkpoint (HF) tensors: a list of
segments. A resharding plan joins the source's segments with the destination's: every
overlap is a :class:`~flowrl.plan.ReshardPiece` (source rank and rows ->
destination rank and rows). It is the compiler's account of what each rollout rank needs
from which train rank, recorded in the plan (``ResyncPlan.reshard``) and printed by
``flowrl plan``. What executes: a resync gathers whole checkpoint tensors from the train
ranks (``named_weights``) and sends them to each rollout replica; a replica whose engine is
sharded across processes (vLLM, tp > 1) then sends each tp worker only the rows its pieces
read (:mod:`flowrl.engines.tp_shards`, the plan from the unsharded checkpoint to the engine's
layout; ``sync/rank_bytes/R/K`` in the metrics), and the worker's loader fuses them. The
train -> replica leg still carries whole tensors (no per-train-rank pieces), and the
estimated resync time counts those bytes (:func:`flowrl.cost.model.gather_s`,
``transfer_s``), not these pieces.
``tests/schedule/test_reshard_plan.py`` applies the pieces to real tensors and compares
them with the destination layout built directly, so the account is exact.

>>> from flowrl.catalog.models import tiny_facts
>>> plan = reshard_plan(tiny_facts({}), "megatron", 2, 1, "vllm", 1)
>>> t = next(t for t in plan.tensors if t.name.endswith("qkv_proj.weight"))
>>> t.action, t.src_shards, t.dst_shards, len(t.pieces)
('regroup', 2, 1, 6)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from flowrl.catalog.engines import ENGINES, WeightLayout
from flowrl.catalog.models import ModelFacts
from flowrl.plan import ReshardPiece, ReshardPlan, ReshardTensor


@dataclass(frozen=True)
class _Seg:
    """Local rows ``[start, start + length)`` of rank ``rank`` of tensor ``name`` are rows
    ``[part_start, part_start + length)`` of checkpoint tensor ``part``."""

    name: str
    rank: int
    start: int
    length: int
    part: str
    part_start: int


# Checkpoint (HF) names, per layer ({e}: per expert of a mixture of experts).
Q, K, V = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
O, GATE, UP, DOWN = "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
EGATE, EUP, EDOWN = "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"
ROUTER = "mlp.gate"


def layout_of(engine: str) -> WeightLayout:
    """The weight layout of an engine (its record's)."""
    return ENGINES[engine].weight_layout


def _hf(part: str) -> str:
    return f"model.layers.{{i}}.{part}"


def _qkv_segments(f: ModelFacts, engine: str, tp: int, suffix: str) -> list[_Seg]:
    hd, heads, kv = f.hd, f.heads, f.kv_heads
    q, k, v = _hf(Q) + suffix, _hf(K) + suffix, _hf(V) + suffix
    layout = layout_of(engine)
    if not layout.fused:
        return [_Seg(q, 0, 0, heads * hd, q, 0), _Seg(k, 0, 0, kv * hd, k, 0), _Seg(v, 0, 0, kv * hd, v, 0)]
    name = layout.names["qkv"] + suffix
    out = []
    if layout.qkv_grouped:  # per rank: its KV groups, each [q heads of the group; k; v]
        per_group = heads // kv
        groups = kv // tp
        for r in range(tp):
            row = 0
            for g in range(r * groups, (r + 1) * groups):
                for part, start, n in ((q, g * per_group * hd, per_group * hd), (k, g * hd, hd), (v, g * hd, hd)):
                    out.append(_Seg(name, r, row, n, part, start))
                    row += n
        return out
    q_rank = heads // tp
    for r in range(tp):  # vLLM: [q heads of the rank; its KV heads (replicated if tp > kv)]
        kv_first, kv_n = (r * kv // tp, kv // tp) if tp <= kv else (r // (tp // kv), 1)
        row = 0
        for part, start, n in ((q, r * q_rank * hd, q_rank * hd), (k, kv_first * hd, kv_n * hd),
                               (v, kv_first * hd, kv_n * hd)):
            out.append(_Seg(name, r, row, n, part, start))
            row += n
    return out


def _split_segments(f_rows: int, engine: str, tp: int, key: str, parts: list[str]) -> list[_Seg]:
    """Column/row-parallel tensors: each of ``parts`` split evenly over tp ranks, concatenated per rank."""
    layout = layout_of(engine)
    if not layout.fused:
        return [_Seg(p, 0, 0, f_rows, p, 0) for p in parts]
    name = layout.names[key] + (".weight" if not parts[0].endswith(".bias") else ".bias")
    # A vocabulary is padded (to the layout's ``vocab_pad``, then to tp) before it is split: the last
    # rank holds fewer rows, or none.
    pad = layout.vocab_pad if key in ("embed", "lm_head") else 1
    per = -(-(-(-f_rows // pad) * pad) // tp)
    out = []
    for r in range(tp):
        row = 0
        for p in parts:
            n = max(min(per, f_rows - r * per), 0)
            if n:
                out.append(_Seg(name, r, row, n, p, r * per))
            row += per
    return out


def families(f: ModelFacts) -> list[tuple[str, int, int, list[str], int, bool]]:
    """Tensor families: (key, sharded dim, rows along it, checkpoint parts, tensors per family, per layer).

    A mixture of experts' MLP is one family per expert (``expert_gate_up``, ``expert_down``: ``{e}`` in
    the names, ``moe_layers x experts`` tensors); its dense layers, if any, keep ``gate_up``/``down``.
    """
    out = [("qkv", 0, 0, [_hf(Q) + ".weight", _hf(K) + ".weight", _hf(V) + ".weight"], f.layers, True)]
    if f.qkv_bias:
        out.append(("qkv_bias", 0, 0, [_hf(Q) + ".bias", _hf(K) + ".bias", _hf(V) + ".bias"], f.layers, True))
    out.append(("o", 1, f.heads * f.hd, [_hf(O) + ".weight"], f.layers, True))
    dense, experts = f.layers - f.moe_layers, f.moe_layers * f.experts
    if dense:
        out += [("gate_up", 0, f.intermediate, [_hf(GATE) + ".weight", _hf(UP) + ".weight"], dense, True),
                ("down", 1, f.intermediate, [_hf(DOWN) + ".weight"], dense, True)]
    if experts:
        out += [("expert_gate_up", 0, f.expert_intermediate, [_hf(EGATE) + ".weight", _hf(EUP) + ".weight"],
                 experts, True),
                ("expert_down", 1, f.expert_intermediate, [_hf(EDOWN) + ".weight"], experts, True)]
    out.append(("embed", 0, f.vocab, ["model.embed_tokens.weight"], 1, False))
    if not f.tied:
        out.append(("lm_head", 0, f.vocab, ["lm_head.weight"], 1, False))
    return out


def segments(f: ModelFacts, engine: str, tp: int, key: str) -> list[_Seg]:
    """How ``engine`` at tensor parallelism ``tp`` holds tensor family ``key``."""
    fam = next(x for x in families(f) if x[0] == key)
    if key == "qkv":
        return _qkv_segments(f, engine, tp, ".weight")
    if key == "qkv_bias":
        return _qkv_segments(f, engine, tp, ".bias")
    return _split_segments(fam[2], engine, tp, key, fam[3])


def _join(src: list[_Seg], dst: list[_Seg]) -> list[tuple[str, ReshardPiece]]:
    """Every overlap of a destination segment with a source segment of the same checkpoint tensor."""
    by_part: dict[str, list[_Seg]] = {}
    for s in src:
        by_part.setdefault(s.part, []).append(s)
    out = []
    for d in dst:
        lo, hi = d.part_start, d.part_start + d.length
        for s in by_part.get(d.part, ()):
            a, b = max(lo, s.part_start), min(hi, s.part_start + s.length)
            if a >= b:
                continue
            out.append((d.name, ReshardPiece(s.name, s.rank, s.start + a - s.part_start, s.start + b - s.part_start,
                                             d.rank, d.start + a - lo, d.start + b - lo)))
    return out


def _action(src_engine: str, dst_engine: str, key: str, src_tp: int, dst_tp: int) -> str:
    fused = key in ("qkv", "qkv_bias", "gate_up", "expert_gate_up")
    src, dst = layout_of(src_engine), layout_of(dst_engine)
    same_layout = src.fused == dst.fused and not (key.startswith("qkv") and src.qkv_grouped != dst.qkv_grouped)
    if fused and (not same_layout or (src_tp != dst_tp and src.fused)):
        return "regroup"
    if src_tp == dst_tp:
        return "copy"
    return "gather" if src_tp > dst_tp else "split"


@lru_cache(maxsize=512)
def reshard_plan(f: ModelFacts, src_engine: str, src_tp: int, src_pp: int, dst_engine: str, dst_tp: int) -> ReshardPlan:
    """The plan moving ``f``'s weights from ``src_engine(tp=src_tp, pp=src_pp)`` to ``dst_engine(tp=dst_tp)``.

    Engines whose weight layout is unfused (fsdp, torch, hf_generate) count as tp = 1 with the
    checkpoint's unfused tensors.
    """
    s_tp = src_tp if layout_of(src_engine).fused else 1
    d_tp = dst_tp if layout_of(dst_engine).fused else 1
    tensors = []
    for key, dim, _rows, parts, count, _per_layer in families(f):
        dst = segments(f, dst_engine, d_tp, key)
        joined = _join(segments(f, src_engine, s_tp, key), dst)
        for dname in dict.fromkeys(d.name for d in dst):
            tensors.append(ReshardTensor(
                name=dname, parts=tuple(p for p in parts if any(d.part == p for d in dst if d.name == dname)),
                shape=_full_shape(f, key, dname, dst_engine, d_tp), dim=dim,
                action=_action(src_engine, dst_engine, key, s_tp, d_tp), src_shards=s_tp, dst_shards=d_tp,
                pieces=tuple(p for n, p in joined if n == dname), layers=count))
    for norm in ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight"):
        tensors.append(ReshardTensor(norm, (norm,), (f.hidden,), -1, "copy", s_tp, d_tp, (), f.layers))
    if f.moe_layers:  # the router, replicated
        router = _hf(ROUTER) + ".weight"
        tensors.append(ReshardTensor(router, (router,), (f.experts, f.hidden), -1, "copy", s_tp, d_tp, (),
                                     f.moe_layers))
    tensors.append(ReshardTensor("model.norm.weight", ("model.norm.weight",), (f.hidden,), -1, "copy", s_tp, d_tp,
                                 (), 1))
    stages = tuple([f.layers // max(src_pp, 1)] * max(src_pp, 1)) if f.layers % max(src_pp, 1) == 0 else ()
    return ReshardPlan(src=f"{src_engine}(tp={src_tp}, pp={src_pp})", dst=f"{dst_engine}(tp={dst_tp})",
                       src_tp=s_tp, src_pp=src_pp, dst_tp=d_tp, tensors=tuple(tensors), stage_layers=stages)


def rank_shardable(facts: dict) -> bool:
    """Whether a resync can give each tp rank of a ``rank_shards`` engine only its rows
    (:mod:`flowrl.engines.tp_shards`): a dense decoder with a gated MLP, whose checkpoint names the
    plan describes. ``facts``: :meth:`ModelFacts.to_dict`'s (a mixture of experts lists ``moe_layers``,
    a plain MLP ``gated_mlp = False``)."""
    return bool(facts) and facts.get("gated_mlp", True) and not facts.get("moe_layers")


def rank_elements(plan: ReshardPlan) -> tuple[int, ...]:
    """Elements each destination rank holds: the rows its pieces write (every layer) and every
    replicated tensor whole; their sum is the model once, plus what several ranks hold alike.

    >>> from flowrl.catalog.models import tiny_facts
    >>> f = tiny_facts({})
    >>> one, = rank_elements(reshard_plan(f, "torch", 1, 1, "vllm", 1))
    >>> one == f.params, sum(rank_elements(reshard_plan(f, "torch", 1, 1, "vllm", 2))) > one
    (True, True)
    """
    out = [0] * plan.dst_tp
    for t in plan.tensors:
        size = math.prod(t.shape)
        if t.dim < 0:
            out = [n + size * t.layers for n in out]
            continue
        row = size // t.shape[t.dim]
        for p in t.pieces:
            out[p.dst_rank] += (p.dst_stop - p.dst_start) * row * t.layers
    return tuple(out)


def _full_shape(f: ModelFacts, key: str, name: str, engine: str, tp: int) -> tuple[int, ...]:
    hd = f.hd
    layout = layout_of(engine)
    # a grouped qkv never replicates KV heads; a per-rank one does when tp exceeds them
    kv_rows = f.kv_heads * hd if layout.qkv_grouped or tp <= f.kv_heads else tp * hd
    if key == "qkv":
        if layout.fused:
            return ((f.heads * hd + 2 * kv_rows), f.hidden)
        return ((f.heads if ".q_proj" in name else f.kv_heads) * hd, f.hidden)
    if key == "qkv_bias":
        if layout.fused:
            return (f.heads * hd + 2 * kv_rows,)
        return ((f.heads if ".q_proj" in name else f.kv_heads) * hd,)
    if key == "o":
        return (f.hidden, f.heads * hd)
    if key == "gate_up":
        return ((2 if layout.fused else 1) * f.intermediate, f.hidden)
    if key == "down":
        return (f.hidden, f.intermediate)
    if key == "expert_gate_up":
        return ((2 if layout.fused else 1) * f.expert_intermediate, f.hidden)
    if key == "expert_down":
        return (f.hidden, f.expert_intermediate)
    return (f.vocab, f.hidden)


__all__ = ["reshard_plan", "rank_elements", "rank_shardable", "segments", "families", "layout_of"]
