"""A run's data (flowrl.runtime.data.RunData) from lowered flows: hf_dataset with a template and a system
prompt rendered by the tokenizer's chat template, a streamed JSON-lines file, a mixture; the samplers'
checkpointed state continues the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_file
from flowrl.runtime.data import RunData
from flowrl.runtime.handlers import prompt_value

datasets = pytest.importorskip("datasets")

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "Q:": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = chat_template
    return fast


def _plan(tmp: Path, decls: str, dataset: str = "d", size: int = 4):
    path = tmp / "f.flow"
    path.write_text(f"""model policy = tiny(task = "arith")
{decls}
reward r = verifier("exact")
flow main() {{
  x = generate(policy, sample({dataset}, size = {size}), n = 2, max_tokens = 4)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}}
""")
    return lower(compile_file(str(path)).graph)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_an_hf_dataset_with_a_template_and_system_prompt_through_the_chat_template(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"question": [f"{i}+1?" for i in range(10)],
                                                               "solution": [str(i + 1) for i in range(10)]}),
                          "test": datasets.Dataset.from_dict({"question": ["7+7?"], "solution": ["14"]})}
                         ).save_to_disk(str(tmp_path / "hf"))
    plan = _plan(tmp_path, 'dataset d = hf_dataset("hf", eval = "test", answer = "solution", '
                           'template = "Q: {question}", system = "Be brief.")')
    data = RunData(plan, _tokenizer(CHAT), seed=0)
    (op,) = [o for o in plan.ops if o.kind == "sample"]
    rows = data.draw(op)
    assert len(rows) == 4 and all(r["prompt"].startswith("<|system|>Be brief.\n<|user|>Q: ") for r in rows)
    value = prompt_value(data, "d", rows)
    assert value["answers"] == [r["solution"] for r in rows] and value["rows"][0]["question"] in value["prompt_text"][0]
    assert data.eval_rows("d") == [{"question": "7+7?", "solution": "14",
                                    "prompt": "<|system|>Be brief.\n<|user|>Q: 7+7?\n<|assistant|>"}]
    # without a chat template the system prompt is written before the prompt
    plain = RunData(plan, _tokenizer(None), seed=0)
    assert plain.eval_rows("d")[0]["prompt"] == "Be brief.\n\nQ: 7+7?"


def test_a_streamed_file_is_drawn_as_the_run_goes_and_resumes(tmp_path):
    # 3 MB: three 1 MiB blocks, of which a window of one is held
    _jsonl(tmp_path / "big.jsonl", [{"q": f"{i:06d}" + "." * 60, "a": str(i)} for i in range(40_000)])
    plan = _plan(tmp_path, 'dataset d = jsonl("big.jsonl", prompt = "q", answer = "a", stream = "on", window = 1)')
    tok = _tokenizer(None)
    data = RunData(plan, tok, seed=3)
    assert data.datasets["d"].rows == [] and data.datasets["d"].source is not None
    (op,) = [o for o in plan.ops if o.kind == "sample"]
    for _ in range(5):
        data.draw(op)
    state = json.loads(json.dumps(data.state_dict()))
    following = [data.draw(op) for _ in range(3)]
    again = RunData(plan, tok, seed=3)
    again.load_state_dict(state)
    assert [again.draw(op) for _ in range(3)] == following
    sampler = data.samplers[op.id]
    assert sampler.held < 40_000 // 2 and sampler.source.bytes_read < (tmp_path / "big.jsonl").stat().st_size


def test_a_mixture_draws_from_its_parts_under_one_pair_of_columns(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"question": f"a{i}", "solution": "A"} for i in range(20)])
    _jsonl(tmp_path / "a_test.jsonl", [{"question": "a-held", "solution": "A"}])
    _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "answer": "B"} for i in range(20)])
    plan = _plan(tmp_path, 'dataset a = jsonl("a.jsonl", eval = "a_test.jsonl", prompt = "question", answer = "solution")\n'
                           'dataset b = jsonl("b.jsonl", stream = "on")\n'
                           'dataset d = mix(a, b, weights = [1, 3])', size=400)
    data = RunData(plan, _tokenizer(None), seed=0)
    (op,) = [o for o in plan.ops if o.kind == "sample"]
    rows = data.draw(op)
    value = prompt_value(data, "d", rows)
    assert {(p[0], a) for p, a in zip(value["prompt_text"], value["answers"])} == {("a", "A"), ("b", "B")}
    share = sum(p.startswith("b") for p in value["prompt_text"]) / len(rows)
    assert 0.75 - 0.1 < share < 0.75 + 0.1
    assert [r["prompt"] for r in data.eval_rows("d")] == ["a-held"]
    state = json.loads(json.dumps(data.state_dict()))
    nxt = data.draw(op)
    again = RunData(plan, _tokenizer(None), seed=0)
    again.load_state_dict(state)
    assert again.draw(op) == nxt
