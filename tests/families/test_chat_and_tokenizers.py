"""Chat datasets and the special tokens of each tokenizer family (flowrl.data.chat), built locally.

Four tokenizers (a tiny byte-level BPE with the special tokens, BOS rule and chat template of
Llama 3 instruct, Qwen2/3 instruct, Mistral instruct and GPT-2) check: chat prompts render
with ``add_generation_prompt`` and tokenize as ``apply_chat_template`` does (one BOS, never
two); raw prompts get the tokenizer's BOS where it has one; batches pad with EOS where there
is no pad token; the EOS a completion ends with is a response token and padding is not; and
generation stops at every EOS ``generation_config.json`` names (vLLM). The flow side:
``chat = true`` is checked (E602, E610), shown by ``flowrl plan`` and rendered by the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from family_cases import TOKENIZER_FAMILIES, build_family_tokenizer

from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import check_file, compile_file
from flowrl.data.chat import ChatError, encode, pad_id, render, stop_ids
from flowrl.diagnostics import FlowError
from flowrl.engines.types import Completion, TokenBatch

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module", params=sorted(TOKENIZER_FAMILIES))
def family(request):
    return request.param, build_family_tokenizer(request.param)


def _ids(value) -> list[int]:
    return list(value["input_ids"] if hasattr(value, "keys") else value)


def test_chat_prompts_render_and_tokenize_as_the_template_says(family):
    name, tok = family
    spec = TOKENIZER_FAMILIES[name]
    if spec["template"] is None:  # GPT-2 has no chat template: chat prompts are refused with the fix
        with pytest.raises(ChatError, match="has no chat template; give the dataset `chat = false`"):
            render(tok, MESSAGES, True)
        return
    text = render(tok, MESSAGES, True)
    ids = encode(tok, text)
    assert ids == _ids(tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True))
    assert text.endswith({"llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                          "qwen": "<|im_start|>assistant\n", "mistral": "[/INST]"}[name])
    if spec["bos"] is not None and spec["add_bos"]:
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's, not a second
    # A string is one user message.
    assert render(tok, "What is 2+2?", True) == render(tok, [{"role": "user", "content": "What is 2+2?"}], True)


def test_raw_prompts_get_the_tokenizers_bos_where_it_has_one(family):
    name, tok = family
    ids = encode(tok, "What is 2+2?")
    assert (ids[0] == tok.bos_token_id) == TOKENIZER_FAMILIES[name]["add_bos"]
    assert render(tok, "What is 2+2?", False) == "What is 2+2?"
    with pytest.raises(ChatError, match="give the dataset `chat = true`"):
        render(tok, MESSAGES, False)


def test_padding_is_eos_where_there_is_no_pad_token_and_is_masked(family):
    name, tok = family
    spec = TOKENIZER_FAMILIES[name]
    pad = pad_id(tok)
    assert tok.convert_ids_to_tokens(pad) == (spec["pad"] or spec["eos"])
    eos = tok.eos_token_id
    prompt = tuple(encode(tok, "What is 2+2?"))
    ended = Completion(prompt, (11, 12, eos), (-0.1, -0.2, -0.3), "stop")
    cut = Completion(prompt, (13,) * 6, (-0.1,) * 6, "length")
    batch = TokenBatch.from_completions([ended, cut], pad)
    p = len(prompt)
    # The EOS that ends a completion is a response token (trained, with its rollout log-prob) ...
    assert batch.input_ids[0, p + 2] == eos and batch.response_mask[0, p + 2] == 1
    assert batch.extras["rollout_logprobs"][0, p + 2] == pytest.approx(-0.3)
    # ... the padding after it is not, even where it is the same id.
    assert (batch.input_ids[0, p + 3:] == pad).all()
    assert batch.response_mask[0, p + 3:].sum() == 0 and batch.attention_mask[0, p + 3:].sum() == 0


def test_stop_ids_are_every_eos_the_tokenizer_and_generation_config_name(family):
    name, tok = family
    stops = TOKENIZER_FAMILIES[name]["stops"]

    class GenerationConfig:
        eos_token_id = tok.convert_tokens_to_ids(stops)

    assert stop_ids(tok, GenerationConfig()) == tuple(sorted(tok.convert_tokens_to_ids(stops)))
    assert stop_ids(tok) == (tok.eos_token_id,)


# ---- the flow: check, plan, run-time rendering ----------------------------------------------------

FLOW = """model policy = hf("{model}")
dataset d = jsonl("chats.jsonl", eval = "chats.jsonl"{chat})
reward r = verifier("exact")
flow main() {{
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 8)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}}
"""
ROWS = [{"prompt": MESSAGES, "answer": "4"}, {"prompt": "What is 12 * 7?", "answer": "84"}]


def _qwen_checkpoint(folder: Path, template: bool = True) -> Path:
    """A tiny Qwen3 config with the Qwen-style tokenizer, and weights with no tensors (check and plan read none)."""
    from model_dirs import write_empty_weights

    from flowrl.models.families import family_config

    tok = build_family_tokenizer("qwen")
    if not template:
        tok.chat_template = None
    family_config("qwen3", vocab_size=len(tok), hidden=128, layers=1, heads=4, kv_heads=2, intermediate=256,
                  max_position=128, pad_id=tok.pad_token_id, bos_id=tok.eos_token_id,
                  eos_id=tok.eos_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    write_empty_weights(folder)
    return folder


def _flow(tmp: Path, model: str, chat: bool | None, rows=ROWS) -> Path:
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / "f.flow"
    path.write_text(FLOW.format(model=model, chat="" if chat is None else f", chat = {str(chat).lower()}"))
    return path


def _codes(path: Path) -> list:
    try:
        check_file(str(path))
    except FlowError as e:
        return [(d.code, d.message, d.hint) for d in e.diagnostics]
    return []


def test_check_refuses_messages_without_chat_and_chat_without_a_template(tmp_path):
    model = _qwen_checkpoint(tmp_path / "qwen")
    diagnostics = _codes(_flow(tmp_path, "qwen", None))  # the train file and the eval split (the same file)
    assert [(code, "holds chat messages" in message, "chat = true" in hint) for code, message, hint in diagnostics] \
        == [("E602", True, True)] * 2
    assert _codes(_flow(tmp_path, "qwen", True)) == []
    bad = [{"prompt": [{"role": "user", "text": "hi"}], "answer": "x"}]
    (code, message, _), _eval = _codes(_flow(tmp_path, "qwen", True, bad))
    assert code == "E602" and "message 0 has no string 'content'" in message
    _qwen_checkpoint(model, template=False)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    [(code, message, _)] = _codes(_flow(tmp_path, "qwen", True))
    assert code == "E610" and f"but `policy` ({model}) has no chat template" in message


def test_plan_shows_the_choice_and_the_runtime_renders_with_the_template(tmp_path):
    from flowrl.compiler.explain import describe_plan
    from flowrl.runtime.data import RunData
    from transformers import AutoTokenizer

    model = _qwen_checkpoint(tmp_path / "qwen")
    plan = lower(compile_file(str(_flow(tmp_path, "qwen", True))).graph)
    assert [d.chat for d in plan.datasets] == [True]
    assert ("d: jsonl chats.jsonl: prompts as chat messages rendered with the chat template of `policy`'s "
            "tokenizer (add_generation_prompt)") in describe_plan(plan)
    tok = AutoTokenizer.from_pretrained(str(model))
    data = RunData(plan, tok, seed=0)
    assert data.pad_id == tok.pad_token_id
    rows = data.eval_rows("d")
    texts = [r["prompt"] for r in rows]
    assert texts[1] == "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n"
    expected = [_ids(tok.apply_chat_template(r["prompt"] if isinstance(r["prompt"], list) else
                                             [{"role": "user", "content": r["prompt"]}],
                                             tokenize=True, add_generation_prompt=True)) for r in ROWS]
    assert data.tokenize(texts) == expected
    raw = lower(compile_file(str(_flow(tmp_path, "qwen", False, [ROWS[1]]))).graph)
    assert "prompts as raw text" in describe_plan(raw)
    assert RunData(raw, tok, seed=0).eval_rows("d")[0]["prompt"] == "What is 12 * 7?"


# ---- generation stops at every EOS generation_config.json names (vLLM) -------------------------------


def _rigged_llama3(folder: Path, emit: str) -> tuple[str, int]:
    """A tiny Llama with the Llama 3 tokenizer whose every next token is ``emit`` (logit ~ +50):
    attention and MLP outputs are zero, every embedding has +1 in dimension 0, and only
    ``emit``'s LM-head row reads that dimension."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_family_tokenizer("llama3")
    stops = tok.convert_tokens_to_ids(TOKENIZER_FAMILIES["llama3"]["stops"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=tok.bos_token_id, eos_token_id=stops, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    target = tok.convert_tokens_to_ids(emit)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.mul_(0.01)[:, 0] = 1.0
        model.lm_head.weight.zero_()[target, 0] = 5.0
    model.generation_config.eos_token_id = stops
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), target


@pytest.mark.parametrize("emit", ["<|eot_id|>", "<|end_of_text|>"])
def test_vllm_stops_at_each_generation_config_eos_and_keeps_it_in_the_response(tmp_path, emit):
    pytest.importorskip("vllm")
    from flowrl.engines.types import SamplingSpec
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    path, target = _rigged_llama3(tmp_path / "llama3", emit)
    tok = build_family_tokenizer("llama3")
    assert emit != "<|eot_id|>" or target == tok.eos_token_id  # one is the tokenizer's EOS, the other only
    engine = VLLMRolloutEngine(path, dtype="float32", max_model_len=64)  # generation_config.json's
    try:
        prompt = encode(tok, render(tok, MESSAGES, True))
        [[c]] = engine.generate([prompt], SamplingSpec(n=1, temperature=1.0, max_tokens=8, seed=0))
    finally:
        engine.shutdown()
    assert (c.response_ids, c.finish_reason) == ((target,), "stop")
    batch = TokenBatch.from_completions([c], pad_id(tok))
    assert batch.response_mask[0, len(prompt)] == 1
