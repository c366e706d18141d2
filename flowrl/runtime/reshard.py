"""Resharding plans: a training layout's tensor-parallel shards -> a rollout layout's, as data, and their execution.

A Llama-style model's weights are stored differently by each engine and split
differently at each tensor-parallel (TP) size. A **layout** is ``(style, tp)``:

| style | attention q, k, v | MLP gate, up | names |
|---|---|---|---|
| ``hf`` | three tensors, each split by heads | two tensors, each split by rows | transformers |
| ``vllm`` | ``qkv_proj`` = per rank ``[q_r; k_r; v_r]`` | ``gate_up_proj`` = per rank ``[gate_r; up_r]`` | transformers, fused |
| ``megatron`` | ``linear_qkv`` interleaved per query group: ``[q heads of group g; k_g; v_g]`` for each group | ``linear_fc1`` = per rank ``[gate_r; up_r]`` | Megatron-core local spec |

In every style, ``o_proj`` / ``down_proj`` (row-parallel) split their input
dimension (dim 1), embeddings and the LM head split the vocabulary (dim 0), and
norms are replicated. Note that a gathered ``[gate_r; up_r]`` tensor is *not*
``[gate; up]`` at a different TP size, and Megatron's QKV is not ``[q; k; v]`` at
any TP size: these are the silent-corruption cases resharding must get right.

:func:`plan_reshard` gives, per group of tensors (one layer's q/k/v, ...), a
:class:`TensorMove`: which source tensors are all-gathered over the source ranks,
how they are un-fused into the transformers tensors and re-fused into the target
form, and how each target rank gets its shard (kept locally, or scattered from rank
0 when the target has more ranks than the source). :func:`execute_reshard` runs a
plan with torch.distributed collectives; :func:`reshard_local` runs the same math in
one process (all ranks' shards in a list), and :func:`shard_state_dict` /
:func:`unshard_state_dict` convert between a transformers state dict and a layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

STYLES = ("hf", "vllm", "megatron")
"""Weight layouts this module converts between (see the module docstring)."""


class ReshardError(ValueError):
    """A layout that cannot hold the model (a TP size that does not divide heads, vocab, ...), or bad shards."""


@dataclass(frozen=True)
class LlamaDims:
    """The sizes of a Llama-style decoder that decide how its tensors split."""

    layers: int
    """Decoder layers."""
    hidden: int
    """Model width H."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (query groups); divides ``heads``."""
    head_dim: int
    """Width of one head."""
    intermediate: int
    """MLP width I (gate and up are ``[I, H]``, down is ``[H, I]``)."""
    vocab: int
    """Vocabulary size V (embedding and LM head are ``[V, H]``)."""
    tied: bool = False
    """LM head shares the embedding (no separate ``lm_head`` tensor)."""
    attention_bias: bool = False
    """q/k/v carry biases (Qwen2)."""

    @classmethod
    def from_config(cls, config: Any) -> "LlamaDims":
        """From a transformers ``LlamaConfig`` / ``Qwen2Config`` (or its ``to_dict()``)."""
        c = config if isinstance(config, dict) else config.to_dict()
        qkv_bias = c.get("model_type") == "qwen2"
        if (c.get("attention_bias") and not qkv_bias) or c.get("mlp_bias"):
            raise ReshardError(f"{c.get('model_type')}: attention_bias on o_proj / mlp_bias are not planned; "
                               "hint: resharding supports Llama without biases and Qwen2 (q/k/v biases)")
        heads = int(c["num_attention_heads"])
        return cls(layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                   tied=bool(c.get("tie_word_embeddings", False)),
                   attention_bias=qkv_bias)


@dataclass(frozen=True)
class Layout:
    """How one engine stores the weights: a style of :data:`STYLES` and a tensor-parallel size."""

    style: str
    tp: int

    def __str__(self) -> str:
        return f"{self.style}(tp={self.tp})"


# ---- the fusions: canonical (transformers) tensors <-> one stored tensor's per-rank shards -----------
# Each takes/returns full canonical tensors ``parts`` and a list of ``tp`` shards (rank order).


def _plain_to(parts: list[torch.Tensor], tp: int, dim: int | None, dims: LlamaDims) -> list[torch.Tensor]:
    (p,) = parts
    return [p] * tp if dim is None else list(p.chunk(tp, dim))


def _plain_from(shards: list[torch.Tensor], dim: int | None, dims: LlamaDims, n_parts: int) -> list[torch.Tensor]:
    return [shards[0]] if dim is None else [torch.cat(shards, dim)]


def _concat_to(parts: list[torch.Tensor], tp: int, dim: int | None, dims: LlamaDims) -> list[torch.Tensor]:
    """Per rank r: ``cat([chunk r of each part])`` along dim 0 (vLLM qkv/gate_up, Megatron fc1)."""
    chunks = [p.chunk(tp, 0) for p in parts]
    return [torch.cat([c[r] for c in chunks], 0) for r in range(tp)]


def _concat_from(shards: list[torch.Tensor], dim: int | None, dims: LlamaDims, n_parts: int) -> list[torch.Tensor]:
    sizes = _concat_sizes(shards[0].shape[0], n_parts, dims, len(shards))
    pieces = [s.split(sizes, 0) for s in shards]
    return [torch.cat([p[i] for p in pieces], 0) for i in range(n_parts)]


def _concat_sizes(rows: int, n_parts: int, dims: LlamaDims, tp: int) -> list[int]:
    """Rows of each part inside one rank's fused shard: q/k/v have different sizes, gate/up equal ones."""
    if n_parts == 3:
        return [dims.heads * dims.head_dim // tp, dims.kv_heads * dims.head_dim // tp,
                dims.kv_heads * dims.head_dim // tp]
    return [rows // n_parts] * n_parts


def _megatron_qkv_to(parts: list[torch.Tensor], tp: int, dim: int | None, dims: LlamaDims) -> list[torch.Tensor]:
    """Megatron's fused QKV: for each query group g, ``[q heads of g; k_g; v_g]``; ranks hold whole groups."""
    q, k, v = parts
    rest = q.shape[1:]
    groups, per_group = dims.kv_heads, dims.heads // dims.kv_heads
    fused = torch.cat([q.reshape(groups, per_group * dims.head_dim, *rest),
                       k.reshape(groups, dims.head_dim, *rest),
                       v.reshape(groups, dims.head_dim, *rest)], 1)
    return list(fused.reshape(-1, *rest).chunk(tp, 0))


def _megatron_qkv_from(shards: list[torch.Tensor], dim: int | None, dims: LlamaDims,
                       n_parts: int) -> list[torch.Tensor]:
    full = torch.cat(shards, 0)
    rest = full.shape[1:]
    groups, per_group, hd = dims.kv_heads, dims.heads // dims.kv_heads, dims.head_dim
    g = full.reshape(groups, (per_group + 2) * hd, *rest)
    q = g[:, : per_group * hd].reshape(-1, *rest)
    k = g[:, per_group * hd: (per_group + 1) * hd].reshape(-1, *rest)
    v = g[:, (per_group + 1) * hd:].reshape(-1, *rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


FUSIONS: dict[str, tuple[Callable, Callable]] = {
    "plain": (_plain_to, _plain_from),
    "concat": (_concat_to, _concat_from),
    "megatron_qkv": (_megatron_qkv_to, _megatron_qkv_from),
}
"""Fusion kind -> (canonical parts -> per-rank shards, per-rank shards -> canonical parts)."""


# ---- what each style stores -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stored:
    """How a style stores one canonical group: stored tensors, each holding some parts with a fusion."""

    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    """(name template, indices of the group's parts it holds, fusion kind)."""
    dim: int | None
    """Shard dimension of every stored tensor (None: replicated)."""


_HF = {
    "embed": ("model.embed_tokens.weight",),
    "qkv": ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight"),
    "qkv_bias": ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
                 "model.layers.{i}.self_attn.v_proj.bias"),
    "o": ("model.layers.{i}.self_attn.o_proj.weight",),
    "gate_up": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "down": ("model.layers.{i}.mlp.down_proj.weight",),
    "input_norm": ("model.layers.{i}.input_layernorm.weight",),
    "post_norm": ("model.layers.{i}.post_attention_layernorm.weight",),
    "final_norm": ("model.norm.weight",),
    "lm_head": ("lm_head.weight",),
}
"""Canonical group -> its transformers tensor names (the canonical parts, in order)."""

_DIMS = {"embed": 0, "qkv": 0, "qkv_bias": 0, "o": 1, "gate_up": 0, "down": 1, "input_norm": None,
         "post_norm": None, "final_norm": None, "lm_head": 0}
"""Canonical group -> shard dimension (the same in every style)."""


def _separate(group: str) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple((name, (i,), "plain") for i, name in enumerate(_HF[group]))


_MEGATRON_NAMES = {
    "embed": "embedding.word_embeddings.weight", "o": "decoder.layers.{i}.self_attention.linear_proj.weight",
    "down": "decoder.layers.{i}.mlp.linear_fc2.weight", "input_norm": "decoder.layers.{i}.input_layernorm.weight",
    "post_norm": "decoder.layers.{i}.pre_mlp_layernorm.weight", "final_norm": "decoder.final_layernorm.weight",
    "lm_head": "output_layer.weight",
}

STORAGE: dict[str, dict[str, tuple[tuple[str, tuple[int, ...], str], ...]]] = {
    "hf": {g: _separate(g) for g in _HF},
    "vllm": {**{g: _separate(g) for g in _HF},
             "qkv": (("model.layers.{i}.self_attn.qkv_proj.weight", (0, 1, 2), "concat"),),
             "qkv_bias": (("model.layers.{i}.self_attn.qkv_proj.bias", (0, 1, 2), "concat"),),
             "gate_up": (("model.layers.{i}.mlp.gate_up_proj.weight", (0, 1), "concat"),)},
    "megatron": {**{g: ((n, (0,), "plain"),) for g, n in _MEGATRON_NAMES.items()},
                 "qkv": (("decoder.layers.{i}.self_attention.linear_qkv.weight", (0, 1, 2), "megatron_qkv"),),
                 "qkv_bias": (("decoder.layers.{i}.self_attention.linear_qkv.bias", (0, 1, 2), "megatron_qkv"),),
                 "gate_up": (("decoder.layers.{i}.mlp.linear_fc1.weight", (0, 1), "concat"),)},
}
"""Style -> canonical group -> stored tensors ``(name template, part indices, fusion)``."""

_LAYER_GROUPS = ("qkv", "qkv_bias", "o", "gate_up", "down", "input_norm", "post_norm")


# ---- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a layout stores it."""

    name: str
    """Name in the layout's style."""
    parts: tuple[int, ...]
    """Indices of the canonical tensors of the group it holds (fused when more than one)."""
    fusion: str
    """Key of :data:`FUSIONS`."""
    shard_shape: tuple[int, ...]
    """Shape of one rank's shard."""


@dataclass(frozen=True)
class TensorMove:
    """How one canonical group (e.g. layer 3's q, k, v) goes from the source layout to the target layout."""

    group: str
    """``layers.{i}.{kind}`` or a global kind (``embed``, ``final_norm``, ``lm_head``)."""
    hf_names: tuple[str, ...]
    """The canonical (transformers) tensors of the group, in order."""
    dim: int | None
    """Shard dimension in both layouts (None: replicated)."""
    sources: tuple[StoredTensor, ...]
    """What each source rank holds."""
    targets: tuple[StoredTensor, ...]
    """What each target rank must end with."""
    steps: tuple[str, ...]
    """What happens, in order: ``keep``, ``all_gather``, ``unfuse``, ``fuse``, ``split``, ``scatter``, ``broadcast``."""

    @property
    def refused(self) -> bool:
        """Whether the group is un-fused and re-fused (the moves that corrupt weights silently when wrong)."""
        return any(step.startswith("unfuse") for step in self.steps)


@dataclass(frozen=True)
class ReshardPlan:
    """Every move from ``src`` to ``dst`` for a model of ``dims``; plain data (see :meth:`to_dict`)."""

    dims: LlamaDims
    src: Layout
    dst: Layout
    moves: tuple[TensorMove, ...] = field(default_factory=tuple)

    @property
    def world_size(self) -> int:
        """Ranks the execution needs: source ranks 0..src.tp-1 and target ranks 0..dst.tp-1, colocated."""
        return max(self.src.tp, self.dst.tp)

    def to_dict(self) -> dict:
        """JSON-able form (for the execution plan and ``flowrl plan --json``)."""
        import json

        plain = {"dims": asdict(self.dims), "src": asdict(self.src), "dst": asdict(self.dst),
                 "moves": [asdict(m) for m in self.moves]}
        return json.loads(json.dumps(plain))  # tuples -> lists: the dict equals its JSON round trip

    def describe(self) -> str:
        """One line per move: ``group: sources -> targets: steps``, deterministic (for golden tests)."""
        lines = [f"reshard {self.src} -> {self.dst}: {len(self.moves)} groups, {self.world_size} ranks"]
        for m in self.moves:
            src = ", ".join(f"{s.name}{list(s.shard_shape)}" for s in m.sources)
            dst = ", ".join(f"{t.name}{list(t.shard_shape)}" for t in m.targets)
            lines.append(f"  {m.group}: {src} -> {dst}: {' · '.join(m.steps)}")
        return "\n".join(lines)


def plan_reshard(dims: LlamaDims, src: Layout, dst: Layout) -> ReshardPlan:
    """The moves that turn ``src``-layout shards into ``dst``-layout shards.

    Raises:
        ReshardError: an unknown style, or a TP size that does not divide the heads,
            query groups, MLP width or vocabulary, with the numbers and a hint.
    """
    for layout in (src, dst):
        _check_layout(dims, layout)
    groups = [("embed", None)] + [(g, i) for i in range(dims.layers) for g in _LAYER_GROUPS
                                  if g != "qkv_bias" or dims.attention_bias] + [("final_norm", None)]
    if not dims.tied:
        groups.append(("lm_head", None))
    moves = tuple(_move(dims, src, dst, kind, layer) for kind, layer in groups)
    return ReshardPlan(dims, src, dst, moves)


def _check_layout(dims: LlamaDims, layout: Layout) -> None:
    if layout.style not in STORAGE:
        raise ReshardError(f"layout style {layout.style!r}; hint: one of {', '.join(STYLES)}")
    if not isinstance(layout.tp, int) or layout.tp < 1:
        raise ReshardError(f"{layout}: tp must be an int >= 1")
    if dims.heads % dims.kv_heads:
        raise ReshardError(f"kv_heads={dims.kv_heads} does not divide heads={dims.heads}")
    for what, n in (("kv_heads (query groups)", dims.kv_heads), ("heads", dims.heads),
                    ("intermediate", dims.intermediate), ("vocab", dims.vocab)):
        if n % layout.tp:
            raise ReshardError(f"{layout}: tp={layout.tp} does not divide {what}={n}; hint: pick a tp that divides "
                               f"it (replicating KV heads and padding the vocabulary are not supported)")


def _part_shapes(dims: LlamaDims, kind: str) -> list[tuple[int, ...]]:
    """Full shapes of the canonical tensors of a group."""
    h, q, kv = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    return {"embed": [(dims.vocab, h)], "lm_head": [(dims.vocab, h)], "qkv": [(q, h), (kv, h), (kv, h)],
            "qkv_bias": [(q,), (kv,), (kv,)], "o": [(h, q)], "gate_up": [(dims.intermediate, h)] * 2,
            "down": [(h, dims.intermediate)], "input_norm": [(h,)], "post_norm": [(h,)],
            "final_norm": [(h,)]}[kind]


def _stored(dims: LlamaDims, layout: Layout, kind: str, layer: int | None) -> tuple[StoredTensor, ...]:
    shapes = _part_shapes(dims, kind)
    dim = _DIMS[kind]
    out = []
    for template, parts, fusion in STORAGE[layout.style][kind]:
        shape = list(shapes[parts[0]])
        if len(parts) > 1:  # fused along dim 0
            shape[0] = sum(shapes[p][0] for p in parts)
        if dim is not None:
            shape[dim] //= layout.tp
        out.append(StoredTensor(template.format(i=layer), parts, fusion, tuple(shape)))
    return tuple(out)


def _move(dims: LlamaDims, src: Layout, dst: Layout, kind: str, layer: int | None) -> TensorMove:
    group = kind if layer is None else f"layers.{layer}.{kind}"
    hf_names = tuple(n.format(i=layer) for n in _HF[kind])
    sources, targets = _stored(dims, src, kind, layer), _stored(dims, dst, kind, layer)
    dim = _DIMS[kind]
    move = TensorMove(group, hf_names, dim, sources, targets, ())
    return TensorMove(group, hf_names, dim, sources, targets, _steps(move, src, dst))


def _steps(move: TensorMove, src: Layout, dst: Layout) -> tuple[str, ...]:
    same_form = [(s.parts, s.fusion) for s in move.sources] == [(t.parts, t.fusion) for t in move.targets]
    if same_form and src.tp == dst.tp:
        return ("keep",)
    if move.dim is None:
        return ("keep",) if dst.tp <= src.tp else (f"broadcast from rank 0 to {dst.tp} ranks",)
    steps = [f"all_gather dim {move.dim} over {src.tp} ranks"] if src.tp > 1 else []
    # A per-rank concatenation ([gate_r; up_r]) depends on tp, so a tp change re-fuses it
    # even when both layouts use the same fusion; plain and Megatron-QKV tensors only re-split.
    tp_dependent = any(t.fusion == "concat" for t in move.sources + move.targets)
    if not same_form or tp_dependent:
        steps.append(f"unfuse {'+'.join(sorted({s.fusion for s in move.sources}))}(tp={src.tp})")
        steps.append(f"fuse {'+'.join(sorted({t.fusion for t in move.targets}))}(tp={dst.tp})")
    if dst.tp == 1:
        steps.append("rank 0 keeps the whole tensor")
    elif dst.tp <= src.tp:
        steps.append(f"split dim {move.dim} into {dst.tp}, each rank keeps its own")
    else:
        steps.append(f"scatter dim {move.dim} from rank 0 to {dst.tp} ranks")
    return tuple(steps)


# ---- the math, shared by the local and the distributed executor -------------------------------------
def _unfuse(move: TensorMove, dims: LlamaDims, shards: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Source shards (every rank's, per stored name) -> the group's full transformers tensors."""
    parts: list[torch.Tensor | None] = [None] * len(move.hf_names)
    for s in move.sources:
        for index, tensor in zip(s.parts, FUSIONS[s.fusion][1](shards[s.name], move.dim, dims, len(s.parts))):
            parts[index] = tensor
    return parts  # type: ignore[return-value]


def _fuse(move: TensorMove, dims: LlamaDims, parts: list[torch.Tensor], tp: int) -> dict[str, list[torch.Tensor]]:
    """The group's full transformers tensors -> every target rank's shard, per stored name."""
    return {t.name: [x.contiguous() for x in FUSIONS[t.fusion][0]([parts[p] for p in t.parts], tp, move.dim, dims)]
            for t in move.targets}


def _check_shards(move: TensorMove, shards: dict[str, torch.Tensor], rank: int) -> None:
    for s in move.sources:
        got = shards.get(s.name)
        if got is None:
            raise ReshardError(f"rank {rank} lacks source shard {s.name!r}; hint: pass every tensor of the "
                               "source layout this rank holds")
        if tuple(got.shape) != s.shard_shape:
            raise ReshardError(f"rank {rank}: shard {s.name!r} has shape {list(got.shape)}, the plan expects "
                               f"{list(s.shard_shape)}; hint: the model dims or source tp do not match the shards")


def reshard_local(plan: ReshardPlan, shards: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Run ``plan`` in one process: ``shards[r]`` is source rank r's dict; returns each target rank's dict."""
    if len(shards) != plan.src.tp:
        raise ReshardError(f"reshard_local got {len(shards)} source ranks, the plan's source is {plan.src}")
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(plan.dst.tp)]
    for move in plan.moves:
        for r, d in enumerate(shards):
            _check_shards(move, d, r)
        parts = _unfuse(move, plan.dims, {s.name: [d[s.name] for d in shards] for s in move.sources})
        for name, per_rank in _fuse(move, plan.dims, parts, plan.dst.tp).items():
            for r, tensor in enumerate(per_rank):
                out[r][name] = tensor
    return out


def shard_state_dict(state: dict[str, torch.Tensor], dims: LlamaDims, layout: Layout) -> list[dict[str, torch.Tensor]]:
    """A transformers state dict -> every rank's tensors in ``layout`` (``[tp]`` dicts)."""
    plan = plan_reshard(dims, Layout("hf", 1), layout)
    return reshard_local(plan, [state])


def unshard_state_dict(shards: list[dict[str, torch.Tensor]], dims: LlamaDims,
                       layout: Layout) -> dict[str, torch.Tensor]:
    """Every rank's tensors in ``layout`` -> one transformers state dict."""
    return reshard_local(plan_reshard(dims, layout, Layout("hf", 1)), shards)[0]


# ---- distributed execution ----------------------------------------------------------------------
def execute_reshard(plan: ReshardPlan, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``plan`` with torch.distributed collectives on the default process group.

    Every rank of the default group (world size >= ``plan.world_size``; source and
    target ranks colocated: rank r holds source shard r if r < src.tp and gets target
    shard r if r < dst.tp) calls this with the source tensors it holds (``{}`` on a
    rank >= src.tp). Per group: an ``all_gather`` over the source ranks (src.tp > 1),
    un-fuse and re-fuse on every source rank, then each target rank keeps its shard
    (dst.tp <= src.tp) or rank 0 ``scatter``s them (dst.tp > src.tp; ``broadcast``
    for replicated tensors). Works over gloo (CPU) and NCCL (CUDA tensors).

    Returns:
        This rank's tensors in the target layout (``{}`` on a rank >= dst.tp).
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world < plan.world_size:
        raise ReshardError(f"reshard {plan.src} -> {plan.dst} needs {plan.world_size} ranks, the group has {world}")
    src_group = _subgroup(plan.src.tp, world) if plan.src.tp > 1 else None
    dst_group = _subgroup(plan.dst.tp, world) if plan.dst.tp > plan.src.tp else None
    out: dict[str, torch.Tensor] = {}
    for move in plan.moves:
        targets = None
        if rank < plan.src.tp:
            _check_shards(move, shards, rank)
            if move.steps == ("keep",) and plan.src.tp == plan.dst.tp:
                out.update({t.name: shards[s.name] for s, t in zip(move.sources, move.targets)})
                continue
            gathered = {s.name: _all_gather(shards[s.name], move.dim, plan.src.tp, src_group) for s in move.sources}
            targets = _fuse(move, plan.dims, _unfuse(move, plan.dims, gathered), plan.dst.tp)
        elif move.steps == ("keep",) and plan.src.tp == plan.dst.tp:
            continue
        if plan.dst.tp <= plan.src.tp:
            if rank < plan.dst.tp:
                out.update({name: per_rank[rank] for name, per_rank in targets.items()})
        elif rank < plan.dst.tp:
            out.update(_deliver(move, targets, rank, dst_group))
    return out


def _subgroup(size: int, world: int):
    """Process group of ranks 0..size-1 (None = the whole default group); every rank must call it."""
    import torch.distributed as dist

    if size == world:
        return None
    return dist.new_group(list(range(size)))


def _all_gather(tensor: torch.Tensor, dim: int | None, tp: int, group) -> list[torch.Tensor]:
    """Every source rank's shard of one stored tensor, in rank order."""
    import torch.distributed as dist

    if tp == 1 or dim is None:  # replicated tensors are equal on every rank: no need to move them
        return [tensor] * (tp if dim is None else 1)
    out = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _deliver(move: TensorMove, targets: dict[str, list[torch.Tensor]] | None, rank: int, group) -> dict:
    """Rank 0 sends each target rank its shard (scatter; broadcast for replicated tensors)."""
    import torch.distributed as dist

    out = {}
    for t in move.targets:
        sample = targets[t.name][0] if targets is not None else None
        dtype = sample.dtype if sample is not None else None
        dtype = _agree_dtype(dtype, group)
        recv = torch.empty(t.shard_shape, dtype=dtype)
        if move.dim is None:
            if rank == 0:
                recv.copy_(sample)
            dist.broadcast(recv, src=0, group=group)
        else:
            dist.scatter(recv, targets[t.name] if rank == 0 else None, src=0, group=group)
        out[t.name] = recv
    return out


_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _agree_dtype(dtype: torch.dtype | None, group) -> torch.dtype:
    """Rank 0's dtype for the receivers' buffers (they hold no source shard to copy it from)."""
    import torch.distributed as dist

    if dtype is not None and dtype not in _DTYPE_CODES:
        raise ReshardError(f"cannot reshard {dtype} weights; hint: floating dtypes {_DTYPE_CODES}")
    code = torch.tensor([_DTYPE_CODES.index(dtype) if dtype is not None else -1], dtype=torch.int64)
    dist.broadcast(code, src=0, group=group)
    return _DTYPE_CODES[int(code)]
