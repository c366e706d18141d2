"""A real-model setup through the whole stack, in one short GRPO run: `hf("acme/chat-llama3")` read
from a local Hugging Face cache (offline), a chat dataset rendered with the checkpoint's Llama 3
chat template, a Llama 3.x model (RoPE scaled by rope_type llama3) trained in Megatron and
generating in vLLM. After each resync vLLM's log-probs of the sampled tokens (the EOS that ends
a completion included) match the trainer's to 1e-4 in fp32.

The other families run the same path in the unit-level tests (test_family_logprobs.py, one
engine pair each) and in the shipped flows (flows/family_*.flow, compiled in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
pytest.importorskip("ray")

from family_cases import TOKENIZER_FAMILIES, build_family_tokenizer, fake_cache  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FLOW = """import stdlib.grpo

model policy = hf("acme/chat-llama3")
dataset chats = jsonl("chats.jsonl", chat = true)
reward longer = python_reward("chat_rewards:longer", workers = 1)

flow main(steps: int = 2, eval_every: int = 0) {
  grpo(policy, chats, longer, batch = 4, group = 2, max_tokens = 8, lr = 3e-3, kl = 0.0, seed = 1)
}

schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.train = megatron(tp = 1)
  policy.rollout = vllm(tp = 1)
}
"""
REWARD = '''def longer(completions, answers, prompts=None):
    """Longer completions score higher (up to 8 characters): rewards differ within a group."""
    return [min(len(c), 8) / 8 for c in completions]
'''
QUESTIONS = ["What is 2+2?", "Hello there, how are you?", "Compute 12 * 7.", "The quick brown fox?"]


def _chat_llama3(out: Path) -> Path:
    """A tiny Llama 3.x (llama3 RoPE scaling) with the Llama 3 tokenizer and chat template."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from flowrl.catalog.architectures import TINY_ARCHS

    tok = build_family_tokenizer("llama3")
    stops = tok.convert_tokens_to_ids(TOKENIZER_FAMILIES["llama3"]["stops"])
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, bos_token_id=tok.bos_token_id, eos_token_id=stops,
                               tie_word_embeddings=False, initializer_range=0.1, **TINY_ARCHS["llama3"].config)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = stops
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    hub = tmp_path / "hf_home" / "hub"
    fake_cache(hub, "acme/chat-llama3", _chat_llama3(tmp_path / "source"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    work = tmp_path / "work"
    work.mkdir()
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}], "answer": "x"}
            for q in QUESTIONS] * 3
    (work / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "chat_rewards.py").write_text(REWARD)
    (work / "chat.flow").write_text(FLOW)
    monkeypatch.syspath_prepend(str(work))  # the reward module, for the reward pool's processes
    return work


@pytest.mark.long  # make test-long, 69 s; in make test: each family's log-probs in vLLM vs the trainer (test_family_logprobs.py), chat templates
def test_hub_model_chat_template_llama3_megatron_vllm(workdir):
    result = run_file(str(workdir / "chat.flow"), out=str(workdir / "run"), log_samples=1)
    plan = json.loads((result.out / "plan.json").read_text())
    assert [d["chat"] for d in plan["datasets"]] == [True]
    assert [m["args"].get("hub_id") for m in plan["models"] if m["id"] == "policy"] == ["acme/chat-llama3"]
    assert len(result.rows) == 2
    assert any(row["train/policy/grad_norm"] > 0 for row in result.rows)
    for row in result.rows:
        assert row["mismatch/abs_max"] < 1e-4, row  # vLLM vs Megatron after each resync, fp32
    samples = [json.loads(line) for line in (result.out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
                           and s["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
                           for s in samples)
