"""Micro-batches by a token budget, balanced over data-parallel ranks, and sequence packing.

What veRL calls dynamic batch size: a long-tailed batch (a few rows of hundreds of tokens, many
of tens) wastes most of a row-count micro-batch on padding. Here

* :func:`balance` splits rows over ``parts`` data-parallel ranks so their real-token totals differ
  by at most the longest row (greedy longest-processing-time: each row, longest first, goes to the
  lightest rank; veRL uses Karmarkar-Karp, whose spread is usually smaller, for the same bound);
* :func:`micro_batches` groups one rank's rows into micro-batches of at most ``max_tokens`` real
  tokens (first-fit, longest first, so rows of like lengths share a micro-batch and pad little; a
  row longer than the budget runs alone), or of ``max_rows`` rows when the budget is 0;
* :func:`plan_ranks` does both and then splits micro-batches until every rank has as many
  (collectives must match across ranks);
* :func:`pack` concatenates a micro-batch's rows into one row whose attention stays within each
  sequence (a block-diagonal causal mask, additive float: transformers' eager and sdpa kernels take
  it) and whose position ids restart at each sequence; :func:`unpack` scatters per-token outputs
  of the packed row back to the padded ``[B, T]`` layout, so the loss and its denominators are
  exactly those of the padded path.

The loss normalises by whole-minibatch counts (:data:`~flowrl.engines.base.Denominator`), so how
rows are split into micro-batches changes the gradient only by float rounding.

>>> balance([5, 4, 3, 3, 1], 2)
[[0, 3], [1, 2, 4]]
>>> micro_batches([9, 2, 3, 5, 1], [0, 1, 2, 3, 4], max_rows=8, max_tokens=6, padded=False)
[[0], [3, 4], [2, 1]]
>>> micro_batches([9, 2, 3, 5, 1], [0, 1, 2, 3, 4], max_rows=8, max_tokens=6)  # rows x longest <= 6
[[0], [3], [2, 1], [4]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.engines.types import TokenBatch


def balance(lengths: list[int], parts: int) -> list[list[int]]:
    """Row indices per part (each sorted), every row in exactly one part; the parts' length totals
    differ by at most ``max(lengths)``: when a part last grew it was the lightest, so it exceeds
    the lightest part by at most the row it took."""
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(parts), key=lambda p: (loads[p], len(out[p]), p))
        out[p].append(i)
        loads[p] += lengths[i]
    return [sorted(rows) for rows in out]


def micro_batches(lengths: list[int], rows: list[int], *, max_rows: int, max_tokens: int = 0,
                  padded: bool = True) -> list[list[int]]:
    """Split ``rows`` (indices into ``lengths``) into micro-batches.

    ``max_tokens == 0``: consecutive runs of ``max_rows`` rows (the padded path's split).
    ``max_tokens > 0``: first-fit decreasing into bins of ``max_tokens`` tokens; a row longer than
    the budget fills a bin alone. A ``padded`` micro-batch counts its token slots (rows x its
    longest row: what it costs run padded, so the budget bounds its activations), a packed one its
    real tokens; either way it holds at most ``max_tokens`` real tokens.
    """
    if max_tokens <= 0:
        return [rows[s:s + max_rows] for s in range(0, len(rows), max_rows)]
    bins: list[list[int]] = []
    used: list[int] = []  # real tokens per bin
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):  # a bin's first row is its longest
        cost = (lambda b: (len(bins[b]) + 1) * lengths[bins[b][0]]) if padded else (lambda b: used[b] + lengths[i])
        b = next((b for b in range(len(bins)) if cost(b) <= max_tokens), None)
        if b is None:
            bins.append([i])
            used.append(lengths[i])
        else:
            bins[b].append(i)
            used[b] += lengths[i]
    return bins


def plan_ranks(lengths: list[int], ranks: int, *, max_rows: int, max_tokens: int = 0,
               padded: bool = True) -> list[list[list[int]]]:
    """Per rank, its micro-batches (lists of row indices).

    With a token budget the rows are balanced over ranks by tokens (:func:`balance`); without one
    each rank keeps its contiguous slice (the padded path, unchanged). ``padded``: see
    :func:`micro_batches` (False when the micro-batches run packed). Ranks with fewer
    micro-batches split their largest multi-row one until all have as many; a rank with too few
    rows to split that far runs zero-weight passes (the engine's business).
    """
    n = len(lengths)
    if max_tokens > 0:
        shares = balance(lengths, ranks) if ranks > 1 else [list(range(n))]
    else:
        bounds = [round(r * n / ranks) for r in range(ranks + 1)]  # flowrl.engines.ranks.dp_slices' rule
        shares = [list(range(bounds[r], bounds[r + 1])) for r in range(ranks)]
    plans = [micro_batches(lengths, rows, max_rows=max_rows, max_tokens=max_tokens, padded=padded) for rows in shares]
    most = max(len(p) for p in plans)
    for plan in plans:
        while len(plan) < most:
            splittable = [m for m in plan if len(m) > 1]
            if not splittable:
                break
            big = max(splittable, key=lambda m: sum(lengths[i] for i in m))
            k = plan.index(big)
            plan[k:k + 1] = [big[: len(big) // 2], big[len(big) // 2:]]
    return plans


def rank_rows(plans: list[list[list[int]]]) -> list[list[int]]:
    """Each rank's rows in ascending order (the order a rank returns its forward outputs in)."""
    return [sorted(i for m in plan for i in m) for plan in plans]


def lengths_of(batch: TokenBatch) -> list[int]:
    """Real tokens per row (right padding)."""
    return [int(x) for x in batch.attention_mask.sum(dim=1).tolist()]


@dataclass(frozen=True)
class Packed:
    """A micro-batch's B rows as one row of L = sum of their lengths."""

    input_ids: torch.Tensor
    """[1, L] int64: the rows' real tokens, one after the other."""
    position_ids: torch.Tensor
    """[1, L] int64: 0, 1, ... restarting at each sequence."""
    attention_mask: torch.Tensor
    """[1, 1, L, L] float32, additive: 0 where query i may attend key j (same sequence, j <= i),
    the dtype's minimum elsewhere."""
    lengths: tuple[int, ...]
    """The B rows' lengths, in row order."""


def pack(batch: TokenBatch, dtype: torch.dtype = torch.float32) -> Packed:
    """One packed row of ``batch``'s real tokens (:class:`Packed`)."""
    lengths = lengths_of(batch)
    ids = torch.cat([batch.input_ids[b, :n] for b, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return Packed(ids[None], pos[None], mask[None, None], tuple(lengths))


def unpack(values: torch.Tensor, lengths: tuple[int, ...], width: int) -> torch.Tensor:
    """Per-token values of a packed row, [1, L] or [L], -> [B, width] right-padded with zeros."""
    flat = values.reshape(-1)
    out = flat.new_zeros(len(lengths), width)
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = flat[start:start + n]
        start += n
    return out


def pad_fraction(batch: TokenBatch, plan: list[list[int]], packed: bool) -> float:
    """Share of the token slots the model runs on that are padding: 0 when packed; else, per
    micro-batch, rows x its longest row against its real tokens."""
    if packed:
        return 0.0
    lengths = lengths_of(batch)
    slots = sum(len(m) * max((lengths[i] for i in m), default=0) for m in plan)
    real = sum(lengths[i] for m in plan for i in m)
    return 1.0 - real / slots if slots else 0.0


__all__ = ["balance", "micro_batches", "plan_ranks", "rank_rows", "lengths_of", "Packed", "pack", "unpack",
           "pad_fraction"]
