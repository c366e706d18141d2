"""Model families HF <-> Megatron: every converted family round-trips bit-exactly over TP/PP
layouts, its RoPE frequencies are transformers' own, and what the converters refuse is what
``flowrl check`` refuses (one description: :mod:`flowrl.catalog.architectures`).

Pure tensor code on transformers' own state dicts of tiny models (no Megatron, no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.catalog.architectures import ARCHITECTURES, TINY_ARCHS, conversion_issue
from flowrl.catalog.engines import ENGINES
from flowrl.catalog.models import from_config
from flowrl.engines.megatron.convert import (
    ConversionError,
    Layout,
    ModelSpec,
    hf_to_megatron,
    megatron_to_hf,
    rope_inv_freq,
    set_rope_frequencies,
    shard_state,
    unshard_state,
)
from flowrl.models.families import family_config, model_class

CONVERTED = [name for name, t in TINY_ARCHS.items() if t.spec.converted]


def _tiny(arch: str, **shape):
    shape = {"vocab_size": 19, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256,
             "max_position": 128, "pad_id": 0, "bos_id": 1, "eos_id": 2, **shape}
    cfg = family_config(arch, **shape)
    torch.manual_seed(0)
    return cfg, model_class(arch)(cfg)


def test_every_family_but_gpt2_converts():
    assert set(CONVERTED) == {"llama", "llama3", "qwen2", "qwen3", "mistral", "qwen3_moe"}
    assert ENGINES["megatron"].architectures == {a.name for a in ARCHITECTURES.values() if a.converted}


@pytest.mark.parametrize("arch", CONVERTED)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_exact(arch, tp, pp, tmp_path):
    cfg, model = _tiny(arch)
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if spec.moe:  # transformers 5 fuses a layer's experts in memory; checkpoints (what the engine reads) do not
        from safetensors.torch import load_file

        model.save_pretrained(tmp_path)
        hf = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    full = hf_to_megatron(hf, spec)
    shards = {(t, p): shard_state(full, spec, Layout(tp, t, pp, p)) for t in range(tp) for p in range(pp)}
    back = megatron_to_hf(unshard_state(shards, spec, tp, pp), spec)
    assert sorted(back) == sorted(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_qwen3_qk_norm_and_head_size():
    cfg, model = _tiny("qwen3")
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    assert (spec.qk_norm, spec.head_dim, spec.hidden // spec.heads) == (True, 64, 32)
    full = hf_to_megatron(model.state_dict(), spec)
    assert full["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (64,)
    assert full["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 64, 128)
    assert full["decoder.layers.0.self_attention.linear_proj.weight"].shape == (128, 4 * 64)
    # Replicated over TP: every rank holds the whole [d] norm.
    shard = shard_state(full, spec, Layout(2, 1))
    assert torch.equal(shard["decoder.layers.0.self_attention.k_layernorm.weight"],
                       model.state_dict()["model.layers.0.self_attn.k_norm.weight"])


@pytest.mark.parametrize("arch", CONVERTED)
def test_rope_frequencies_are_transformers_own(arch):
    cfg, model = _tiny(arch)
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    theirs = model.model.rotary_emb.inv_freq
    ours = rope_inv_freq(spec)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0), (ours - theirs).abs().max()


def test_llama3_scaling_changes_the_frequencies_megatron_would_use():
    """Megatron's own RoPE (rotary_base only) would give plain frequencies: the engine must set ours."""
    spec = ModelSpec.from_hf_config(_tiny("llama3")[0].to_dict())
    plain = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim))
    ours = rope_inv_freq(spec)
    assert torch.equal(ours[:1], plain[:1])  # the highest frequency is kept
    assert torch.allclose(ours[-1], plain[-1] / 8)  # the lowest is divided by the factor
    assert not torch.allclose(ours, plain)

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inv_freq = plain.clone()

    module = torch.nn.Sequential(Rotary(), torch.nn.Linear(2, 2))
    assert set_rope_frequencies(module, spec) == 1
    assert torch.equal(module[0].inv_freq, ours)


PUBLIC = {  # the config.json keys that matter, as the hub's checkpoints write them
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "intermediate_size": 14336, "max_position_embeddings": 131072, "vocab_size": 128256,
                     "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "tie_word_embeddings": False, "mlp_bias": False, "attention_bias": False},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                   "head_dim": 128, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "intermediate_size": 3072, "max_position_embeddings": 40960, "vocab_size": 151936,
                   "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 1000000, "rope_scaling": None,
                   "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True,
                   "attention_bias": False},
    "mistral-7b-v0.3": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "intermediate_size": 14336, "max_position_embeddings": 32768, "vocab_size": 32768,
                        "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 1000000.0,
                        "sliding_window": None, "tie_word_embeddings": False},
}


def test_public_configs_convert():
    llama = ModelSpec.from_hf_config(PUBLIC["llama-3.1-8b"])
    assert dict(llama.rope)["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    assert dict(llama.rope)["original_max_position_embeddings"] == 8192
    qwen = ModelSpec.from_hf_config(PUBLIC["qwen3-0.6b"])
    assert (qwen.head_dim, qwen.qk_norm, qwen.tie_embeddings, qwen.qkv_bias) == (128, True, True, False)
    mistral = ModelSpec.from_hf_config(PUBLIC["mistral-7b-v0.3"])
    assert (mistral.arch, mistral.kv_heads) == ("mistral", 8)


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"sliding_window": 4096}, "sliding_window 4096 < max_position_embeddings 32768"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "mlp_bias / attention_bias"),
])
def test_what_the_converter_refuses_check_refuses_too(tmp_path, change, words):
    cfg = {**PUBLIC["mistral-7b-v0.3"], **change}
    with pytest.raises(ConversionError, match=words.replace("(", r"\(")):
        ModelSpec.from_hf_config(cfg)
    assert words in conversion_issue(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert words in from_config(tmp_path).unconvertible  # what check_model_fit reads (E607)


def test_a_window_that_is_off_is_no_window():
    cfg = {**PUBLIC["qwen3-0.6b"], "sliding_window": 4096, "use_sliding_window": False}
    assert conversion_issue(cfg) == ""
    assert "sliding_window 4096" in conversion_issue({**cfg, "use_sliding_window": True})


def test_gpt2_is_refused_by_name():
    cfg = family_config("gpt2", vocab_size=19, hidden=64, layers=1, heads=2, kv_heads=2, intermediate=128,
                        max_position=32, pad_id=0, bos_id=1, eos_id=2).to_dict()
    with pytest.raises(ConversionError, match="'GPT2LMHeadModel' checkpoints are not converted to Megatron's layout; "
                                              "it converts LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                              "Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_compiler_facts_and_converter_read_the_same_record(tmp_path, arch):
    """The facts ``flowrl check`` computes from a tiny checkpoint's config are the model's own."""
    cfg, model = _tiny(arch)
    cfg.save_pretrained(tmp_path)
    facts = from_config(tmp_path)
    assert facts.architecture == TINY_ARCHS[arch].architecture
    counted = sum(p.numel() for p in model.parameters())
    # Llama-style facts count exactly, but for Qwen3's QK-norm weights (2 x head size per layer);
    # GPT-2's biases, LayerNorm biases and position table are outside the facts' model (a few
    # percent of a tiny model, less of a real one).
    if facts.gated_mlp:
        qk_norms = facts.layers * 2 * facts.hd if TINY_ARCHS[arch].spec.qk_norm else 0
        assert facts.params + qk_norms == counted
    else:
        assert abs(facts.params - counted) / counted < 0.2
    assert (facts.qkv_bias, facts.tied) == (TINY_ARCHS[arch].spec.qkv_bias, TINY_ARCHS[arch].spec.tied_default)
    if TINY_ARCHS[arch].spec.converted:
        spec = ModelSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
        assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn) == \
            (facts.hidden, facts.layers, facts.heads, facts.kv_heads, facts.hd, facts.intermediate)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_tiny_facts_are_the_built_models(tmp_path, arch):
    """`flowrl check` plans `tiny(arch = ...)` without building it: its facts are the built checkpoint's."""
    from dataclasses import asdict

    from flowrl.catalog.models import tiny_facts
    from flowrl.models.tiny import build_tiny_model
    from flowrl.tasks import get_task

    planned = tiny_facts({"task": "arith", "arch": arch})
    built = from_config(build_tiny_model(tmp_path, chars=get_task("arith").chars, arch=arch))
    # Not compared: where the facts came from, bytes per weight (the cluster's), and head_dim as
    # written (0 = hidden / heads; the head size itself, `hd`, is).
    skip = {"name", "dtype_bytes", "head_dim"}
    assert {k: v for k, v in asdict(planned).items() if k not in skip} == \
        {k: v for k, v in asdict(built).items() if k not in skip}
    assert (planned.hd, planned.params) == (built.hd, built.params)


def test_the_engines_doc_lists_every_family_as_the_records_say():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    section = doc.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[2].strip(): line for line in section.splitlines() if line.startswith("| ")}
    for arch in ARCHITECTURES.values():
        row = next(r for key, r in rows.items() if key.startswith(f"`{arch.name}`"))
        engines = row.split("|")[4]
        for name in ENGINES:
            if name in arch.engines or "same" in engines:
                continue
            assert f"{name}," not in engines and not engines.strip().startswith(name), (arch.name, name)
    for name in TINY_ARCHS:
        assert f"| `{name}` |" in section, name
