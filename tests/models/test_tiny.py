"""flowrl.models.tiny: character tokenizer and tiny checkpoints loadable by transformers and vLLM."""

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl.models.tiny import SPECIALS, TinyModelError, build_tiny_model, build_tokenizer, load_tokenizer


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_ids_bos_and_decode():
    tok = build_tokenizer("0123456789+-= \n")
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert len(tok) == len(SPECIALS) + 15
    ids = tok("12+35=").input_ids
    assert ids == [1, 5, 6, 14, 7, 9, 16]
    assert tok("12", add_special_tokens=False).input_ids == [5, 6]
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+35="
    assert tok.decode(tok("1 2\n3", add_special_tokens=False).input_ids) == "1 2\n3"
    assert tok("x", add_special_tokens=False).input_ids == [tok.unk_token_id]
    assert tok.chat_template is None


def test_tokenizer_rejects_bad_charsets():
    with pytest.raises(TinyModelError, match="empty charset"):
        build_tokenizer("")
    with pytest.raises(TinyModelError, match=r"repeats \['1'\]"):
        build_tokenizer("011")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_loads_in_transformers_and_is_deterministic(tmp_path, arch):
    a = build_tiny_model(tmp_path / "a", arch=arch, seed=3)
    b = build_tiny_model(tmp_path / "b", arch=arch, seed=3)
    c = build_tiny_model(tmp_path / "c", arch=arch, seed=4)
    assert sha(a / "model.safetensors") == sha(b / "model.safetensors")
    assert sha(a / "model.safetensors") != sha(c / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(a)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size // cfg.num_attention_heads, cfg.tie_word_embeddings) == (arch, 32, False)
    assert next(model.parameters()).dtype == torch.float32
    # AutoTokenizer (what vLLM uses) encodes like ours, also for qwen2 (which transformers re-tokenizes byte-level).
    auto = AutoTokenizer.from_pretrained(a)
    assert auto("98+07=").input_ids == load_tokenizer(a)("98+07=").input_ids == [1, 13, 12, 14, 4, 11, 16]
    assert auto.decode([13, 12, 2], skip_special_tokens=True) == "98"


def test_building_does_not_disturb_the_global_rng(tmp_path):
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    build_tiny_model(tmp_path / "m", seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"hidden": 64, "heads": 4}, r"head size hidden / heads = 64 / 4 = 16, which vLLM's CPU attention has no kernel"),
        ({"hidden": 160, "heads": 4}, r"head size hidden / heads = 160 / 4 = 40, which"),
        ({"hidden": 128, "heads": 3}, "hidden = 128 does not divide by heads = 3"),
        ({"heads": 4, "kv_heads": 3}, "heads = 4 does not divide by kv_heads = 3"),
        ({"arch": "gpt3"}, r"unknown tiny model arch 'gpt3'; choose one of \['gpt2', 'llama', 'llama3', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe'\]"),
        ({"arch": "qwen2", "chars": "0 1"}, r"arch='qwen2' cannot use characters \[' '\]"),
        ({"arch": "qwen3_moe", "hidden": 80, "heads": 2, "kv_heads": 1},
         r"hidden = 80 is not a multiple of 32, which vLLM's CPU MoE kernel needs; use hidden = 96"),
    ],
)
def test_bad_shapes_are_refused(tmp_path, kwargs, pattern):
    with pytest.raises(TinyModelError, match=pattern):
        build_tiny_model(tmp_path / "m", **kwargs)


def test_kv_heads_do_not_constrain_a_family_without_them(tmp_path):
    """GPT-2 has no grouped-query attention: its config ignores ``kv_heads`` (tiny_shape_problems)."""
    out = build_tiny_model(tmp_path / "m", arch="gpt2", hidden=96, heads=3, kv_heads=2, layers=1)
    assert (out / "config.json").is_file()


def test_loads_in_vllm_with_matching_logprobs(tiny_llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm_cache"))
    # vLLM's in-process CPU worker makes torch.set_num_threads a no-op for the whole process
    # (VLLMRolloutEngine gives it back; this bare LLM does not): undone after the test.
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=128,
        distributed_executor_backend="uni", seed=0,
    )
    try:
        (out,) = llm.generate(["12+35="], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))
    finally:
        del llm
    assert out.prompt_token_ids == [1, 5, 6, 14, 7, 9, 16]  # vLLM tokenizes exactly like transformers
    gen = list(out.outputs[0].token_ids)
    assert 1 <= len(gen) <= 6
    # Greedy tokens and their logprobs agree with transformers on the same weights.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ids = torch.tensor([out.prompt_token_ids + gen])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0], dim=-1)
    p = len(out.prompt_token_ids)
    assert gen == lp[p - 1 : p - 1 + len(gen)].argmax(-1).tolist()
    ref = [lp[p - 1 + i, t].item() for i, t in enumerate(gen)]
    got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
    assert got == pytest.approx(ref, abs=1e-4)
