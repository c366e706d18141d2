"""The context-parallel token layout (flowrl.engines.megatron.context_parallel) in one process:
it is Megatron's load-balanced layout (get_batch_on_this_cp_rank, the RoPE slice of the CPU
shim), the gathered order inverts it, and the CP layer spec swaps only the core attention."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines.megatron.context_parallel import cp_token_index, gather_sequence, gathered_to_global, padded_width


def test_padded_width_rounds_up_to_two_chunks_per_rank():
    assert [padded_width(w, 2) for w in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert padded_width(7, 3) == 12


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert cp_token_index(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert cp_token_index(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    assert cp_token_index(12, 3, 1).tolist() == [2, 3, 8, 9]
    for cp in (1, 2, 3, 4):
        held = torch.cat([cp_token_index(8 * cp, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(8 * cp))  # every position on exactly one rank
    with pytest.raises(ValueError, match="width=10 is not a multiple of 2\\*cp=4"):
        cp_token_index(10, 2, 0)


def test_gathered_to_global_restores_token_order():
    for cp in (2, 3):
        width = 6 * cp
        tokens = torch.arange(100, 100 + width)[None]
        gathered = torch.cat([tokens.index_select(1, cp_token_index(width, cp, r)) for r in range(cp)], dim=1)
        assert torch.equal(gathered.index_select(1, gathered_to_global(width, cp)), tokens)


def test_layout_is_megatrons(monkeypatch):
    """Megatron's own batch slicing puts the same tokens (and mask rows) on each CP rank."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    width = 24
    for cp in (2, 3):
        for rank in range(cp):
            monkeypatch.setattr(dist, "get_world_size", lambda group=None: cp)
            monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
            tokens = torch.arange(width)[None].repeat(2, 1)
            mask = torch.arange(width * width).view(1, 1, width, width)
            out = get_batch_on_this_cp_rank({"tokens": tokens, "attention_mask": mask}, is_hybrid_cp=False,
                                            cp_group=object())
            mine = cp_token_index(width, cp, rank)
            assert torch.equal(out["tokens"], tokens.index_select(1, mine))
            assert torch.equal(out["attention_mask"], mask.index_select(2, mine))


def test_cpu_rope_slice_shim_keeps_the_same_positions():
    from flowrl.engines.megatron.cpu_shims import _cpu_pos_emb_on_this_cp_rank

    class Group:
        def __init__(self, size: int, rank: int):
            self._size, self._rank = size, rank

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return self._rank

    emb = torch.arange(16.0)[:, None, None, None].expand(16, 1, 1, 4)  # RoPE table [s, 1, 1, dim]
    for cp, rank in ((2, 0), (2, 1), (4, 3)):
        got = _cpu_pos_emb_on_this_cp_rank(emb, 0, Group(cp, rank))
        assert torch.equal(got, emb.index_select(0, cp_token_index(16, cp, rank)))


def test_cp_layer_spec_swaps_only_the_core_attention():
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from flowrl.engines.megatron.context_parallel import all_gather_kv_attention, cp_layer_spec

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec = cp_layer_spec(base)
    attention = spec.submodules.self_attention.submodules
    assert attention.core_attention is all_gather_kv_attention()
    assert issubclass(attention.core_attention, DotProductAttention)
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention  # not mutated
    assert attention.linear_qkv is base.submodules.self_attention.submodules.linear_qkv
    assert spec.submodules.mlp is base.submodules.mlp


def test_gather_sequence_rejects_an_unknown_grad_mode():
    with pytest.raises(ValueError, match="grad_mode='mean'"):
        gather_sequence(torch.zeros(2, 4), 1, None, "mean")
