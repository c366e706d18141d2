"""flowrl.models.reward: tiny reward models fit to preference pairs of their base model's own samples."""

import hashlib
import math

import pytest
import torch

from flowrl.models.reward import PreferenceConfig, preference_pairs, ranking_quality, reward_start
from flowrl.models.tiny import load_tokenizer
from flowrl.models.warmstart import SFTConfig, TinyModelConfig, WarmStartError, warm_start
from flowrl.tasks import get_task

SHORT = SFTConfig(steps=40, batch_size=32)
SMALL = TinyModelConfig(hidden=64, heads=2, kv_heads=1, intermediate=128)
FIT = PreferenceConfig(steps=40, batch_size=32, samples=1)


def _build(tmp_path, seed=0):
    return reward_start("arith", model_cfg=SMALL, sft=SHORT, preferences=FIT, seed=seed, cache_dir=tmp_path)


def test_pairs_put_the_answer_over_wrong_samples_other_rows_answers_and_near_misses(tmp_path):
    from transformers import AutoModelForCausalLM

    base = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=tmp_path)
    tok = load_tokenizer(base.path)
    policy = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32).eval()
    rows = get_task("arith").rows("train")[:64]
    torch.manual_seed(0)
    pairs, scored = preference_pairs(policy, tok, "arith", rows, PreferenceConfig(samples=3, swapped=2, perturbed=1))
    assert [len(g) for g in scored] == [3] * len(rows)
    eos = tok.eos_token_id
    it = iter(pairs)
    wrong_samples = 0
    for row, group in zip(rows, scored):
        prompt = tok(row["prompt"]).input_ids
        chosen = prompt + tok(row["answer"], add_special_tokens=False).input_ids + [eos]
        for text, ok, ids in group:
            assert ids and (eos not in ids or ids.index(eos) == len(ids) - 1)  # as sampled: through EOS
            assert (text.strip() == row["answer"]) == (ok >= 1.0)
            if ok < 1.0:  # one pair per wrong sample, its token row as sampled
                wrong_samples += 1
                assert next(it) == (chosen, prompt + ids)
        for _ in range(2):  # then two answers of other rows
            c, rejected = next(it)
            other = tok.decode(rejected[len(prompt):-1])
            assert c == chosen and rejected[-1] == eos and other != row["answer"]
            assert other in {r["answer"] for r in rows}
        c, rejected = next(it)  # then the answer with one digit changed
        near = tok.decode(rejected[len(prompt):-1])
        assert c == chosen and len(near) == len(row["answer"]) and near != row["answer"]
        assert sum(x != y for x, y in zip(near, row["answer"])) == 1
    assert next(it, None) is None and wrong_samples > 0


def test_a_reward_model_is_fit_cached_and_reproducible(tmp_path):
    first = _build(tmp_path / "a")
    assert not first.cached and first.path.name.startswith("arith-rm-")
    info = first.info
    assert info["pairs"] > 1000 and info["final_loss"] < math.log(2)  # it learned something from the pairs
    assert 0.0 <= info["test_pair_accuracy"] <= 1.0
    again = _build(tmp_path / "a")
    assert again.cached and again.path == first.path and again.info == info
    other = _build(tmp_path / "b")  # a fresh cache: the same bytes
    digest = [hashlib.sha256((r.path / "model.safetensors").read_bytes()).hexdigest() for r in (first, other)]
    assert digest[0] == digest[1] and other.info == info
    assert _build(tmp_path / "a", seed=1).path != first.path


def test_the_saved_reward_model_loads_as_a_one_label_classifier_that_ranks(tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm = _build(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(str(rm.path), dtype=torch.float32).eval()
    tok = load_tokenizer(rm.path)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    rows = get_task("arith").rows("test")[:8]
    def ids(text):
        return tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]

    samples = [[(r["answer"], 1.0, ids(r["answer"])), ("0", 0.0, ids("0"))] for r in rows]
    quality = ranking_quality(model, tok, rows, samples)  # the answer is also a "right sample" here
    assert quality["test_auc_prompts"] == 8 and quality["test_auc"] == quality["test_pair_accuracy"]


def test_a_multi_turn_task_has_no_tiny_reward_model(tmp_path):
    with pytest.raises(WarmStartError, match="single-turn"):
        reward_start("arith_tool", model_cfg=SMALL, sft=SHORT, preferences=FIT, cache_dir=tmp_path)
