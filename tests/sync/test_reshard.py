"""Resharding plans between training and rollout layouts, and their exact execution over gloo."""

import itertools

import pytest
import torch

from flowrl.runtime.reshard import (
    LlamaDims,
    Layout,
    ReshardError,
    plan_reshard,
    reshard_local,
    shard_state_dict,
    unshard_state_dict,
)
from sync_testkit import canonical_llama, collect, reference_shards, reshard_worker, start_children

DIMS = LlamaDims(layers=2, hidden=32, heads=8, kv_heads=4, head_dim=4, intermediate=64, vocab=64,
                 attention_bias=True)
"""GQA (2 query heads per group), biases on q/k/v, every size divisible by tp 1, 2 and 4."""

LAYOUTS = [Layout(style, tp) for style in ("hf", "vllm", "megatron") for tp in (1, 2, 4)]


@pytest.mark.parametrize("src, dst", list(itertools.product(LAYOUTS, LAYOUTS)), ids=str)
def test_local_reshard_matches_the_reference_of_every_layout(src, dst):
    hf = canonical_llama(DIMS)
    shards = [reference_shards(hf, DIMS, src.style, src.tp, r) for r in range(src.tp)]
    got = reshard_local(plan_reshard(DIMS, src, dst), shards)
    for r in range(dst.tp):
        want = reference_shards(hf, DIMS, dst.style, dst.tp, r)
        assert got[r].keys() == want.keys()
        for name in want:
            assert torch.equal(got[r][name], want[name]), (r, name)


def test_state_dict_round_trip_and_names_match_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    state = transformers.Qwen2ForCausalLM(cfg).state_dict()
    dims = LlamaDims.from_config(cfg)
    assert dims == DIMS
    with pytest.raises(ReshardError, match="mlp_bias are not planned"):
        LlamaDims.from_config(transformers.LlamaConfig(mlp_bias=True))
    for layout in LAYOUTS:
        shards = shard_state_dict(state, dims, layout)
        back = unshard_state_dict(shards, dims, layout)
        assert back.keys() == state.keys()  # every transformers tensor is planned, none invented
        assert all(torch.equal(back[k], state[k]) for k in state)


def test_plan_says_what_is_gathered_refused_and_scattered():
    dims = LlamaDims(layers=1, hidden=16, heads=4, kv_heads=2, head_dim=8, intermediate=24, vocab=32)
    down = plan_reshard(dims, Layout("megatron", 2), Layout("vllm", 1))
    qkv = next(m for m in down.moves if m.group == "layers.0.qkv")
    assert [s.name for s in qkv.sources] == ["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.sources[0].shard_shape == (32, 16) and qkv.targets[0].shard_shape == (64, 16)
    assert qkv.steps == ("all_gather dim 0 over 2 ranks", "unfuse megatron_qkv(tp=2)", "fuse concat(tp=1)",
                         "rank 0 keeps the whole tensor")
    o = next(m for m in down.moves if m.group == "layers.0.o")
    assert o.steps == ("all_gather dim 1 over 2 ranks", "rank 0 keeps the whole tensor") and not o.refused
    up = plan_reshard(dims, Layout("megatron", 1), Layout("vllm", 2))
    gate_up = next(m for m in up.moves if m.group == "layers.0.gate_up")
    assert gate_up.refused and gate_up.steps[-1] == "scatter dim 0 from rank 0 to 2 ranks"
    norm = next(m for m in up.moves if m.group == "layers.0.post_norm")
    assert norm.steps == ("broadcast from rank 0 to 2 ranks",)
    assert [m.group for m in up.moves][:3] == ["embed", "layers.0.qkv", "layers.0.o"]
    same = plan_reshard(dims, Layout("vllm", 2), Layout("vllm", 2))
    assert {m.steps for m in same.moves} == {("keep",)}
    assert down.describe().splitlines()[0] == "reshard megatron(tp=2) -> vllm(tp=1): 9 groups, 2 ranks"
    assert down.to_dict()["moves"][1]["steps"] == list(qkv.steps)


@pytest.mark.parametrize("dims, layout, message", [
    (LlamaDims(1, 16, 4, 2, 4, 24, 32), Layout("vllm", 4), r"vllm\(tp=4\): tp=4 does not divide kv_heads"),
    (LlamaDims(1, 16, 4, 4, 4, 24, 30), Layout("megatron", 4), r"tp=4 does not divide vocab=30"),
    (LlamaDims(1, 16, 4, 4, 4, 24, 32), Layout("sglang", 1), r"layout style 'sglang'; hint: one of hf, vllm"),
])
def test_impossible_layouts_are_clear_errors(dims, layout, message):
    with pytest.raises(ReshardError, match=message):
        plan_reshard(dims, Layout("hf", 1), layout)


def test_wrong_shards_are_named():
    plan = plan_reshard(DIMS, Layout("megatron", 2), Layout("hf", 1))
    shards = [reference_shards(canonical_llama(DIMS), DIMS, "megatron", 2, r) for r in range(2)]
    del shards[1]["decoder.layers.1.mlp.linear_fc1.weight"]
    with pytest.raises(ReshardError, match="rank 1 lacks source shard 'decoder.layers.1.mlp.linear_fc1.weight'"):
        reshard_local(plan, shards)


def test_tp2_to_tp1_and_tp1_to_tp2_round_trips_over_gloo(tmp_path):
    """Two processes, real collectives: Megatron TP=2 <-> vLLM TP=1 and Megatron TP=1 <-> vLLM TP=2, and more."""
    cases = [("megatron", 2, "vllm", 1), ("megatron", 1, "vllm", 2), ("megatron", 2, "hf", 2),
             ("vllm", 2, "megatron", 2)]
    init = str(tmp_path / "rendezvous")
    procs, q = start_children(reshard_worker, [(r, 2, init, DIMS, cases) for r in range(2)])
    per_rank = collect(procs, q)
    assert per_rank == [[(True, True)] * len(cases)] * 2
