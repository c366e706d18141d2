"""Context parallelism (cp > 1) without Transformer Engine: all-gather K/V attention.

Megatron-core's CP ring attention lives in Transformer Engine (``TEDotProductAttention``);
its local ``DotProductAttention`` asserts ``context_parallel_size == 1``. Transformer
Engine needs CUDA, so this module brings CP to the local layer spec with the scheme
Llama 3 was trained with: every CP rank all-gathers the keys and values of the whole
sequence and computes causal attention for its own queries at their *global* positions.

**Layout** (Megatron's, load-balanced for causal attention): a sequence of width ``T``
(a multiple of ``2 * cp``) is cut into ``2 * cp`` chunks of ``T / (2 cp)`` tokens, and CP
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (:func:`cp_token_index`). It is the
layout of ``megatron.core.utils.get_batch_on_this_cp_rank`` and of the RoPE slice
``get_pos_emb_on_this_cp_rank``, so the rotary embeddings Megatron applies to the local
queries and keys are those of their global positions.

**Gradients.** :func:`gather_sequence` all-gathers a sequence-sharded tensor into global
order. Its backward depends on who consumes the gathered tensor:

* ``"sum"`` (keys/values): each rank's attention uses the gathered K/V for *its own*
  queries, so the gradient of rank r's K/V shard is the sum over ranks of their
  gradients at r's positions (a reduce-scatter; done as all-reduce + slice, which gloo
  supports).
* ``"own"`` (per-token outputs before the loss): every rank evaluates the *same* loss on
  the same gathered tensor, so every rank already holds the whole gradient; each keeps
  its own positions (summing would count the loss cp times).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Optional

import torch


def padded_width(width: int, cp: int) -> int:
    """``width`` rounded up to a multiple of ``2 * cp`` (the chunk count)."""
    chunks = 2 * cp
    return -(-width // chunks) * chunks


def cp_token_index(width: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Global positions held by CP rank ``rank`` of ``cp``: chunks ``rank`` and ``2 cp - 1 - rank``.

    ``width`` must be a multiple of ``2 * cp``.

    >>> cp_token_index(8, 2, 0).tolist(), cp_token_index(8, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    if width % (2 * cp):
        raise ValueError(f"width={width} is not a multiple of 2*cp={2 * cp}; pad it with padded_width()")
    size = width // (2 * cp)
    first = torch.arange(rank * size, (rank + 1) * size, device=device)
    second = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size, device=device)
    return torch.cat([first, second])


def gathered_to_global(width: int, cp: int, device: Any = None) -> torch.Tensor:
    """Index that puts the concatenation of every rank's shard (rank order) into global order."""
    held = torch.cat([cp_token_index(width, cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` into global order; backward per ``grad_mode`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: Any, grad_mode: str) -> torch.Tensor:
        import torch.distributed as dist

        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        shards = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        width = local.shape[dim] * cp
        ctx.dim, ctx.group, ctx.grad_mode = dim, group, grad_mode
        ctx.mine = cp_token_index(width, cp, rank, device=local.device)
        return torch.cat(shards, dim=dim).index_select(dim, gathered_to_global(width, cp, local.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        import torch.distributed as dist

        if ctx.grad_mode == "sum":
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(ctx.dim, ctx.mine), None, None, None


def gather_sequence(local: torch.Tensor, dim: int, group: Any, grad_mode: str) -> torch.Tensor:
    """All-gather ``local`` (this rank's tokens along ``dim``) over CP ``group`` into global token order.

    ``grad_mode``: ``"sum"`` (the ranks use the gathered tensor differently: gradients are
    summed over ranks) or ``"own"`` (every rank computes the same function of it: each keeps
    its own positions' gradient). See the module docstring.
    """
    if grad_mode not in ("sum", "own"):
        raise ValueError(f"grad_mode={grad_mode!r}; use 'sum' or 'own'")
    return _GatherSequence.apply(local, dim, group, grad_mode)


@functools.cache
def all_gather_kv_attention() -> type:
    """The ``AllGatherKVAttention`` class, a subclass of Megatron's ``DotProductAttention``.

    Defined on first call so that importing this module does not import Megatron.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class AllGatherKVAttention(DotProductAttention):
        """Megatron's local ``DotProductAttention`` for cp > 1: all-gathered K/V, queries at global positions.

        Built from the layer spec exactly like ``DotProductAttention`` (same arguments) and
        computes the same function (scale, GQA head expansion, masked softmax, dropout under
        the RNG tracker) on the local queries ``[sq, b, np, hn]`` against the keys and values
        of the whole sequence ``[cp * sq, b, ng, hn]``. The mask is causal by *global*
        position, built here; ``attention_mask`` must be None (flowrl's batches are right
        padded, so causal masking is exact on every real token, as at cp = 1).
        """

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                     cp_comm_type: Optional[str] = None, pg_collection: Any = None):
            if config.window_size is not None:
                raise ValueError(f"window_size={config.window_size}: sliding-window attention is not supported "
                                 "with context parallelism by this engine; use cp=1")
            # The parent refuses cp > 1 only because its attention is local; give it a cp=1 view of the config.
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.config = config
            group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.cp_group = group if group is not None else parallel_state.get_context_parallel_group()

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                    attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
            if packed_seq_params is not None:
                raise ValueError("packed sequences (THD) are not supported by all-gather KV context parallelism")
            if attention_mask is not None:
                raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} given with cp > 1; the "
                                 "all-gather KV attention masks causally by global position: pass None")
            key = gather_sequence(key, 0, self.cp_group, "sum")
            value = gather_sequence(value, 0, self.cp_group, "sum")
            import torch.distributed as dist

            width = key.shape[0]
            rows = cp_token_index(width, dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group),
                                  device=query.device)
            cols = torch.arange(width, device=query.device)
            attention_mask = (cols[None, :] > rows[:, None])[None, None]  # [1, 1, sq, T]: True = a future key
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)

    return AllGatherKVAttention


def cp_layer_spec(spec: Any) -> Any:
    """A copy of a local GPT layer spec whose core attention is :func:`all_gather_kv_attention`'s class."""
    from dataclasses import replace

    attention = spec.submodules.self_attention
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=all_gather_kv_attention()))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))
