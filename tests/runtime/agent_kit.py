"""What the agent / rollout-endpoint tests share: a tokenizer with a Qwen-style chat template that
calls tools in the Hermes format, a tiny checkpoint over it, and agent programs.

A module of its own (test folders' conftest modules share one name, so tests must not import
from them); the agent programs are found by the runtime as ``agent_kit:...`` (this folder on the
flow file's path: the tests copy this file next to their flows).
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = ["The answer is 42. The answer is 7.", "calculator expression arguments name", "Hello there, the tool says 12",
          '{"name": "calculator", "arguments": {"expression": "2+3"}}', "user assistant tool system"] * 4
"""Text the tiny byte-level BPE is trained on: merges such as ``Th``/``The``/``answer`` exist, so a
completion sampled piece by piece re-tokenizes differently."""

HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] %}{{- '<tool_call>\\n' + ({'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson) + '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""A Qwen 2.5-style template (ChatML, tools in the system turn, ``<tool_call>`` JSON, tool results
as ``<tool_response>`` in a user turn)."""


def qwen_tokenizer():
    """A byte-level BPE with Qwen's special tokens (EOS ``<|im_end|>``, no BOS) and :data:`HERMES_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = HERMES_TEMPLATE
    return out


def build_qwen(folder: Path, seed: int = 0) -> str:
    """A tiny random Qwen2 checkpoint over :func:`qwen_tokenizer` (head_dim 32, as vLLM on CPU needs)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = qwen_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


async def three_turns(client, row):
    """Three model calls: after each of the first two, a tool result (and a user nudge after the second)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    text = ""
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        text = msg.content or ""
        messages.append({"role": "assistant", "content": msg.content,
                         **({"tool_calls": [c.model_dump() for c in msg.tool_calls]} if msg.tool_calls else {})})
        messages.append({"role": "tool", "content": f"result {turn}"})
        if turn == 1:
            messages.append({"role": "user", "content": "and now?"})
    return text


def sync_reward(client, row):
    """A plain (not async) program that returns a reward: 1.0 when the reply is non-empty."""
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0 if reply.choices[0].message.content else 0.0


async def crashes(client, row):
    """Raises after one call: its episode ends with an error, the others go on."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    raise RuntimeError("the agent broke")


async def sleeps(client, row):
    """Never returns within a short timeout."""
    import asyncio

    await asyncio.sleep(3600)


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(n)))
    return path
