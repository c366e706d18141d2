"""HF <-> Megatron state-dict conversion: layouts, TP/PP sharding and bit-exact round trips.

Pure tensor code (no Megatron import, no processes)."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines.megatron.convert import (
    ConversionError,
    Layout,
    ModelSpec,
    check_layout,
    hf_to_megatron,
    layer_range,
    megatron_to_hf,
    merge_tp,
    padded_vocab_size,
    shard_state,
    split_tp,
    unshard_state,
)
from flowrl.models.tiny import tiny_config


def _spec(arch: str = "llama", tie: bool = False, **kw) -> ModelSpec:
    cfg = tiny_config(17, arch=arch, **kw).to_dict()
    cfg["tie_word_embeddings"] = tie
    return ModelSpec.from_hf_config(cfg)


def _hf_state(spec: ModelSpec, seed: int = 0, role: str = "actor") -> dict[str, torch.Tensor]:
    """Random tensors with the transformers names and shapes of ``spec``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    h, d = spec.hidden, spec.head_dim
    sd = {"model.embed_tokens.weight": r(spec.vocab_size, h), "model.norm.weight": r(h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
            p + "self_attn.q_proj.weight": r(spec.heads * d, h), p + "self_attn.k_proj.weight": r(spec.kv_heads * d, h),
            p + "self_attn.v_proj.weight": r(spec.kv_heads * d, h), p + "self_attn.o_proj.weight": r(h, spec.heads * d),
            p + "mlp.gate_proj.weight": r(spec.ffn, h), p + "mlp.up_proj.weight": r(spec.ffn, h),
            p + "mlp.down_proj.weight": r(h, spec.ffn),
        })
        if spec.qkv_bias:
            sd.update({p + "self_attn.q_proj.bias": r(spec.heads * d),
                       p + "self_attn.k_proj.bias": r(spec.kv_heads * d),
                       p + "self_attn.v_proj.bias": r(spec.kv_heads * d)})
    if role == "critic":
        sd.update({"value_head.weight": r(1, h), "value_head.bias": r(1)})
    elif not spec.tie_embeddings:
        sd["lm_head.weight"] = r(spec.vocab_size, h)
    return sd


def _round_trip(hf, spec, tp, pp, role="actor", divisible_by=1):
    full = hf_to_megatron(hf, spec, role)
    shards = {
        (t, p): shard_state(full, spec, Layout(tp, t, pp, p, divisible_by), role) for t in range(tp) for p in range(pp)
    }
    return shards, megatron_to_hf(unshard_state(shards, spec, tp, pp, role), spec, role)


def _assert_bit_exact(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
def test_llama_round_trip_is_bit_exact(tp, pp):
    spec = _spec(heads=4, kv_heads=4 if tp == 4 else 2, hidden=128)
    hf = _hf_state(spec)
    _, back = _round_trip(hf, spec, tp, pp)
    _assert_bit_exact(back, hf)


def test_qwen2_qkv_bias_and_vocab_padding_round_trip():
    spec = _spec("qwen2", heads=4, kv_heads=2, hidden=128)
    assert spec.qkv_bias
    hf = _hf_state(spec, seed=1)
    shards, back = _round_trip(hf, spec, 2, 2, divisible_by=8)
    _assert_bit_exact(back, hf)
    # vocab 17 padded to 32 = 2 ranks x 16 rows; the padding rows are zero.
    emb = shards[(1, 0)]["embedding.word_embeddings.weight"]
    assert emb.shape == (16, 128) and torch.equal(emb[1:], torch.zeros(15, 128))


def test_tied_embeddings_have_no_output_layer_and_export_lm_head():
    spec = _spec(tie=True)
    hf = _hf_state(spec)
    shards, back = _round_trip(hf, spec, 2, 1)
    assert "output_layer.weight" not in shards[(0, 0)]
    assert torch.equal(back.pop("lm_head.weight"), hf["model.embed_tokens.weight"])
    _assert_bit_exact(back, hf)


def test_critic_head_is_replicated_and_named_value_head():
    spec = _spec()
    hf = _hf_state(spec, role="critic")
    shards, back = _round_trip(hf, spec, 2, 2, role="critic")
    _assert_bit_exact(back, hf)
    for t in range(2):
        assert torch.equal(shards[(t, 1)]["output_layer.weight"], hf["value_head.weight"])
        assert "output_layer.weight" not in shards[(t, 0)]


def test_fused_qkv_is_interleaved_per_query_group():
    spec = _spec(heads=4, kv_heads=2, hidden=128)  # 2 query heads per group, head_dim 32
    hf = _hf_state(spec)
    qkv = hf_to_megatron(hf, spec)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    d = 32
    expected = torch.cat([q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(qkv, expected)
    # TP rank 1 of 2 holds exactly group 1.
    shard = split_tp("decoder.layers.0.self_attention.linear_qkv.weight", qkv, spec, Layout(2, 1))
    assert torch.equal(shard, expected[4 * d:])


def test_fc1_shards_hold_gate_and_up_of_their_rows():
    spec = _spec(intermediate=256)
    hf = _hf_state(spec)
    fc1 = hf_to_megatron(hf, spec)["decoder.layers.1.mlp.linear_fc1.weight"]
    shard = split_tp("decoder.layers.1.mlp.linear_fc1.weight", fc1, spec, Layout(2, 1))
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(shard, torch.cat([gate[128:], up[128:]]))
    shards = [split_tp("decoder.layers.1.mlp.linear_fc1.weight", fc1, spec, Layout(2, r)) for r in range(2)]
    assert torch.equal(merge_tp("decoder.layers.1.mlp.linear_fc1.weight", shards, spec), fc1)


def test_row_parallel_split_on_input_dim_and_pp_renumbers_layers():
    spec = _spec(layers=4)
    full = hf_to_megatron(_hf_state(spec), spec)
    local = shard_state(full, spec, Layout(2, 1, 2, 1))
    assert sorted({n.split(".")[2] for n in local if n.startswith("decoder.layers.")}) == ["0", "1"]
    proj = full["decoder.layers.3.self_attention.linear_proj.weight"]
    assert torch.equal(local["decoder.layers.1.self_attention.linear_proj.weight"], proj[:, 64:])
    assert "embedding.word_embeddings.weight" not in local and "output_layer.weight" in local
    assert list(layer_range(4, 2, 1)) == [2, 3]


def test_padded_vocab_size():
    assert padded_vocab_size(17, 1) == 17
    assert padded_vocab_size(17, 2) == 18
    assert padded_vocab_size(17, 2, 128) == 256


def test_unsupported_layouts_and_models_have_clear_errors():
    spec = _spec(heads=4, kv_heads=2)
    with pytest.raises(ConversionError, match="num_key_value_heads=2 is not divisible by tp=4"):
        check_layout(spec, 4, 1)
    with pytest.raises(ConversionError, match="num_hidden_layers=2 is not divisible by pp=3"):
        check_layout(spec, 1, 3)
    cfg = tiny_config(17).to_dict()
    with pytest.raises(ConversionError, match="'GPT2LMHeadModel' checkpoints are not converted"):
        ModelSpec.from_hf_config({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConversionError, match="rope_type 'yarn'"):  # llama3 converts: tests/families
        ModelSpec.from_hf_config({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    hf = _hf_state(spec)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(hf, spec)


def test_spec_reads_the_tiny_checkpoint(tiny_dir):
    spec = ModelSpec.from_pretrained(tiny_dir)
    assert (spec.arch, spec.vocab_size, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.layers) == (
        "llama", 17, 128, 4, 2, 32, 2)
    assert spec.rope_theta == 10000.0 and not spec.tie_embeddings
