"""The executed reshard plan (flowrl.engines.tp_shards): each tensor-parallel rank is sent only the rows
its shards hold, and those rows rebuild its shards exactly.

The destination shards are built straight from the checkpoint tensors with torch
(``test_reshard_plan.shards``, independent of the plan's tables): once from the full tensors,
once from what a rank was sent (its rows exact, every other row zero). They must be equal,
so a rank is never missing a row it reads; and the rows sent over all ranks must add up to
the model once (each KV head once per rank holding it when tp exceeds the KV heads).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_reshard_plan import GQA, hf_tensors, shards  # noqa: E402

from flowrl.catalog.models import tiny_facts  # noqa: E402
from flowrl.engines.tp_shards import full_from_slices, rank_rows, slice_for_ranks  # noqa: E402

LAYER = 3
"""The one layer the tensors stand for (names carry a real layer number, as a resync's do)."""


def _named(hf: dict) -> list[tuple[str, torch.Tensor]]:
    return [(name.replace("{i}", str(LAYER)), t) for name, t in hf.items()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("f, tp", [(tiny_facts({}), 2), (GQA, 2), (GQA, 4)], ids=["tiny-tp2", "gqa-tp2", "gqa-tp4"])
def test_each_rank_is_sent_exactly_the_rows_of_its_shards(f, tp):
    hf = hf_tensors(f)
    named = _named(hf)
    shapes = {name: list(t.shape) for name, t in named}
    rows = rank_rows(f, "vllm", tp)
    sent = slice_for_ranks(named, rows, tp)
    truth = shards(f, "vllm", tp, hf)
    for rank in range(tp):
        rebuilt = {name.replace(f".{LAYER}.", ".{i}."): t for name, t in full_from_slices(sent[rank], shapes)}
        assert set(rebuilt) == set(hf), f"rank {rank} was not sent {sorted(set(hf) - set(rebuilt))}"
        mine = shards(f, "vllm", tp, rebuilt)
        for name, per_rank in truth.items():
            assert torch.equal(mine[name][rank], per_rank[rank]), f"rank {rank}, {name}"
    # bytes: every sharded row once per rank holding it; the norms whole to every rank
    whole = sum(_nbytes(t) for name, t in hf.items() if name not in rows)
    sliced = sum(_nbytes(t) for name, t in hf.items() if name in rows)
    kv_rows = 2 * (tp // f.kv_heads - 1) * f.hd if tp > f.kv_heads else 0  # extra copies of each k/v head row
    kv_extra = kv_rows * f.kv_heads * (hf["model.layers.{i}.self_attn.k_proj.weight"].shape[1]
                                      + (1 if f.qkv_bias else 0)) * 4
    per_rank = [sum(_nbytes(t) for t in s.values()) for s in sent]
    assert sum(per_rank) == sliced + tp * whole + kv_extra
    assert max(per_rank) < sliced  # no rank is sent the whole model


def test_tensors_the_plan_does_not_shard_go_whole_to_every_rank():
    extra = torch.arange(6.0)
    sent = slice_for_ranks([("model.layers.0.self_attn.q_norm.weight", extra)], rank_rows(GQA, "vllm", 2), 2)
    assert [list(s) for s in sent] == [["model.layers.0.self_attn.q_norm.weight"]] * 2
