"""The executed reshard plan: what each tensor-parallel rank of a rollout engine is sent of a resync.

A resync arrives as full checkpoint (transformers) tensors, gathered from the train ranks.
:func:`rank_rows` reads the compiler's plan (:func:`flowrl.compiler.reshard.reshard_plan`
from the unsharded checkpoint layout to the engine's) and keeps, for each checkpoint tensor,
the rows (along its sharded dimension) that each destination rank's pieces read;
:func:`slice_for_ranks` cuts a resync's tensors into those rows, so each rank is sent only its
shards (``sum over ranks == model bytes`` plus what every rank holds whole: norms, and KV heads
replicated when tp exceeds them). Tensors the plan does not shard go whole to every rank.

A rank rebuilds, from its slices, checkpoint-shaped tensors whose own rows are exact and the
rest zero (:func:`full_from_slices`), and hands them to the engine's loader, which reads only
its own rows: vLLM's weight loaders narrow each checkpoint tensor to the rank's rows and fuse
them (q/k/v -> qkv_proj). Why not the fused shard itself: vLLM's documented reload of weights
"already sharded" (``reload_weights(is_checkpoint_format=False)``) copies into the parameters in
*kernel* format, and on CPU its linear layers drop the fused weight after loading
(``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``: a oneDNN / sgl prepacked copy
replaces it), so there is no fused parameter to copy a shard into; the checkpoint-format reload
redoes that prepacking.

>>> import torch
>>> from flowrl.catalog.models import ModelFacts
>>> f = ModelFacts("t", hidden=8, layers=1, heads=2, kv_heads=2, intermediate=8, vocab=100, tied=False,
...                qkv_bias=False, dtype_bytes=4)
>>> rows = rank_rows(f, "vllm", 2)
>>> rows["model.embed_tokens.weight"]   # vLLM pads 100 to 128: rank 0 rows 0-63, rank 1 64-99
(0, (((0, 64),), ((64, 100),)))
>>> rows["model.layers.{i}.self_attn.o_proj.weight"]   # row-parallel: split on dim 1
(1, (((0, 4),), ((4, 8),)))
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from flowrl.catalog.models import ModelFacts
from flowrl.compiler.reshard import reshard_plan

_LAYER = re.compile(r"\.layers\.\d+\.")


def rank_rows(facts: ModelFacts, engine: str, tp: int) -> dict[str, tuple[int, tuple[tuple[tuple[int, int], ...], ...]]]:
    """Checkpoint tensor (``{i}`` for the layer) -> (sharded dim, per destination rank its merged row ranges).

    From the plan moving the unsharded checkpoint (``torch``, tp = 1) to ``engine(tp)``; only tensors
    the plan shards are listed (replicated ones go whole to every rank).
    """
    plan = reshard_plan(facts, "torch", 1, 1, engine, tp)
    ranges: dict[str, tuple[int, list[list[tuple[int, int]]]]] = {}
    for t in plan.tensors:
        if t.dim < 0:
            continue
        for p in t.pieces:
            dim, per_rank = ranges.setdefault(p.src_name, (t.dim, [[] for _ in range(plan.dst_tp)]))
            per_rank[p.dst_rank].append((p.src_start, p.src_stop))
    return {name: (dim, tuple(_merged(r) for r in per_rank)) for name, (dim, per_rank) in ranges.items()}


def _merged(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in sorted(set(spans)):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def slice_for_ranks(named_tensors: Iterable[tuple[str, torch.Tensor]], rows: dict, tp: int
                    ) -> list[dict[str, torch.Tensor]]:
    """Per rank, ``{key: tensor}`` to send it: ``name`` for a tensor sent whole, ``name#dim:start:stop``
    for its rows ``[start, stop)`` along ``dim`` (a copy with storage of its own: safetensors refuses
    tensors that share memory)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in named_tensors:
        entry = rows.get(_LAYER.sub(".layers.{i}.", name))
        if entry is None:
            for rank in out:
                rank[name] = tensor
            continue
        dim, per_rank = entry
        for rank, spans in zip(out, per_rank):
            for a, b in spans or ((0, 0),):  # no rows (a padded vocabulary's last ranks): the loader still reads it
                piece = tensor.narrow(dim, a, b - a)  # a view: its own storage by one copy (clone or contiguous)
                rank[f"{name}#{dim}:{a}:{b}"] = piece.clone() if piece.is_contiguous() else piece.contiguous()
    return out


def full_from_slices(sent: dict[str, torch.Tensor], shapes: dict[str, list[int]]) -> list[tuple[str, torch.Tensor]]:
    """A rank's checkpoint-shaped tensors from what :func:`slice_for_ranks` sent it: its rows exact, the
    rest zero. ``shapes``: full shape of every sliced tensor."""
    full: dict[str, torch.Tensor] = {}
    for key, piece in sent.items():
        name, _, where = key.partition("#")
        if not where:
            full[name] = piece
            continue
        dim, a, b = (int(x) for x in where.split(":"))
        if name not in full:
            full[name] = torch.zeros(shapes[name], dtype=piece.dtype)
        full[name].narrow(dim, a, b - a).copy_(piece)
    return list(full.items())


__all__ = ["rank_rows", "slice_for_ranks", "full_from_slices"]
