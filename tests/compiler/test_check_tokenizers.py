"""Every model that reads the policy's token ids tokenizes as the policy does (check_tokenizers, E630);
a reward model may differ: the runtime re-tokenizes the text for it (tests/runtime/test_reward_model.py).

Tokenizers are compared as data: a tiny model's task characters, a checkpoint's tokenizer.json (its model,
added tokens, normalizer, pre-tokenizer), never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError
from model_dirs import write_char_tokenizer, write_planned_checkpoint

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 20,
         "max_position_embeddings": 128}

GRPO_REF = """model ref = frozen({base})
flow main(d: dataset, r: reward) {{
  x = generate(policy, sample(d), n = 2)
  ref_lp = logprobs(ref, x)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x), ref_lp, kl = 0.1)
}}
"""
PPO_CRITIC = """model vf = critic({base})
flow main(d: dataset, r: reward) {{
  x = generate(policy, sample(d), n = 2)
  v = values(vf, x)
  adv = gae(r(x), v, x)
  update(policy, x, adv, logprobs(policy, x))
  update(vf, x, adv, v, loss = value_clip(0.2))
}}
"""
REWARD_MODEL = """reward rm = reward_model({base})
flow main(d: dataset) {{
  x = generate(policy, sample(d), n = 2)
  update(policy, x, group_advantage(rm(x), group = 2), logprobs(policy, x))
}}
"""


def _codes(text: str) -> list:
    try:
        compile_text(text, "t.flow")
    except FlowError as e:
        return [(d.code, d.message, d.span.line, d.span.column) for d in e.diagnostics]
    return []


def test_a_reference_of_another_tiny_task_is_refused_and_frozen_policy_is_not():
    head = 'model policy = tiny(task = "arith")\nmodel other = tiny(task = "longtail")\n'
    (code, message, line, col), = _codes(head + GRPO_REF.format(base="other"))
    assert code == "E630" and (line, col) == (6, 21)
    assert message == ("`ref` reads the token ids `policy` generated, but tokenizes differently: `ref` has the "
                       "character tokenizer of task `longtail`, `policy` the character tokenizer of task `arith`")
    assert _codes(head + GRPO_REF.format(base="policy")) == []
    same_chars = 'model policy = tiny(task = "arith")\nmodel other = tiny(task = "arith_tool")\n'
    assert _codes(same_chars + GRPO_REF.format(base="other")) == []  # the same characters: the same tokenizer


@pytest.fixture
def checkpoints(tmp_path) -> dict[str, Path]:
    """Three checkpoints: `a` and its copy `a2` (the same tokenizer in another folder), `b` (other ids)."""
    a = write_planned_checkpoint(tmp_path / "a", LLAMA)
    a2 = write_planned_checkpoint(tmp_path / "a2", LLAMA)
    b = write_planned_checkpoint(tmp_path / "b", LLAMA)
    write_char_tokenizer(b, "=-+9876543210")
    return {"a": a, "a2": a2, "b": b}


def test_a_critic_of_a_checkpoint_with_another_tokenizer_is_refused(checkpoints):
    head = (f'model policy = hf("{checkpoints["a"]}")\nmodel other = hf("{checkpoints["b"]}")\n'
            f'model same = hf("{checkpoints["a2"]}")\n')
    (code, message, _, _), = _codes(head + PPO_CRITIC.format(base="other"))
    assert code == "E630" and message.startswith("`vf` reads the token ids `policy` generated")
    assert f"`vf` has the tokenizer in {checkpoints['b']}, `policy` the tokenizer in {checkpoints['a']}" in message
    assert _codes(head + PPO_CRITIC.format(base="same")) == []  # compared by content, not by folder
    (code, message, _, _), = _codes(head + GRPO_REF.format(base="other"))
    assert code == "E630" and message.startswith("`ref` reads")


def test_a_reward_model_with_another_tokenizer_is_accepted(checkpoints):
    """reward_model(m) reads the text at run time when its tokenizer differs (it re-tokenizes)."""
    head = f'model policy = hf("{checkpoints["a"]}")\nmodel judge = hf("{checkpoints["b"]}")\n'
    assert [c for c, *_ in _codes(head + REWARD_MODEL.format(base="frozen(judge)"))] == []
    b = json.loads((checkpoints["b"] / "tokenizer.json").read_text())
    a = json.loads((checkpoints["a"] / "tokenizer.json").read_text())
    assert a["model"]["vocab"] != b["model"]["vocab"]  # the two really tokenize differently


def test_a_reference_of_the_policy_reads_no_tokenizer_file(checkpoints, monkeypatch):
    """frozen(policy) is the policy's checkpoint: nothing to compare, and a 7-11 MB tokenizer.json stays unread."""
    import flowrl.compiler.model_info as model_info

    read = []
    monkeypatch.setattr(model_info, "tokenizer_fingerprint", lambda folder: read.append(folder) or "x")
    head = f'model policy = hf("{checkpoints["a"]}")\n'
    assert _codes(head + GRPO_REF.format(base="policy")) == [] and read == []
    assert _codes(head + f'model other = hf("{checkpoints["a2"]}")\n' + GRPO_REF.format(base="other")) == []
    assert len(read) == 2  # two checkpoints: both read
