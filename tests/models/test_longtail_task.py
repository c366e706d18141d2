"""flowrl.tasks.longtail: a long-tailed length distribution, a verifier robust to garbage, the
task's own ~12M-parameter model shape, and a tiny warm start that learns its format."""

import json
import re
import statistics
from dataclasses import asdict

import pytest
import torch

from flowrl.catalog.models import tiny_facts
from flowrl.models.tiny import build_tiny_model, build_tokenizer, tiny_config
from flowrl.models.families import model_class
from flowrl.models.warmstart import TinyModelConfig, task_model_config
from flowrl.rewards.verifiers import get_verifier
from flowrl.tasks import DATA_ROOT, get_task
from flowrl.tasks.longtail import (
    LongTailSpec, LongTailTaskError, final_answer, format_problem, make_split, make_splits, solution,
)


def test_solution_counts_down_and_accumulates():
    assert solution(7, 1) == "00:007=7"
    assert solution(9, 12).split("=")[0].split(",")[-1] == "00:108"
    row = format_problem(4, 3)
    assert row == {"prompt": "4*03=", "answer": "12", "solution": "02:004,01:008,00:012=12"}


def test_split_is_deterministic_and_correct():
    rows = make_split(500, 3)
    assert rows == make_split(500, 3) and rows != make_split(500, 4)
    for r in rows:
        a, k = re.fullmatch(r"(\d)\*(\d\d)=", r["prompt"]).groups()
        assert r == format_problem(int(a), int(k))
        assert final_answer(r["solution"]) == r["answer"] == str(int(a) * int(k))


def test_lengths_have_a_long_tail():
    """Completion characters (solution + EOS) of the shipped train split: mostly short, a long tail."""
    lengths = sorted(len(r["solution"]) + 1 for r in get_task("longtail").rows("train"))
    q = {p: lengths[int(p * (len(lengths) - 1))] for p in (0.0, 0.5, 0.9, 0.99, 1.0)}
    assert q[0.0] <= 10  # a single step: "00:007=7" + EOS
    assert 20 <= q[0.5] <= 45  # the median is a few steps
    assert q[0.9] >= 150 and q[0.99] >= 300  # the tail runs to hundreds
    assert q[1.0] <= 7 * 48 + 5
    assert statistics.fmean(lengths) < q[0.9] / 2  # heavy-tailed: the mean sits far below p90


def test_bad_spec():
    with pytest.raises(LongTailTaskError, match="max_steps=100"):
        LongTailSpec(max_steps=100)
    with pytest.raises(LongTailTaskError, match="zipf_s=0"):
        LongTailSpec(zipf_s=0)
    with pytest.raises(LongTailTaskError, match=r"n=0"):
        make_split(0, 1)


@pytest.mark.parametrize("text, want", [
    ("02:007,01:014,00:021=21", "21"), ("=021 ", "21"), ("garbage=5", "5"),
    ("02:007,01:014,00:021", None), ("=", None), ("=2a", None), ("=-21", None), ("=1e3", None),
    ("=٢١", None),  # non-ASCII digits are digits to str.isdigit, not to the verifier
    ("=" + "9" * 40, None), ("__import__('os').system('true')=1", "1"),
])
def test_final_answer_parses_and_never_evaluates(text, want):
    assert final_answer(text) == want


def test_final_verifier_right_wrong_garbage():
    verify = get_verifier(get_task("longtail").verifier)
    completions = ["02:007,01:014,00:021=21", "02:007,01:014,00:022=22", "=21", "21", "\x00=\n", ""]
    assert verify(completions, ["21"] * 6) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        verify(["=1", "=2"], ["1"])


def test_shipped_files_equal_the_generator():
    task = get_task("longtail")
    train, test = make_splits()
    for name, rows in (("train", train), ("test", test)):
        path = DATA_ROOT / "longtail" / f"{name}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    longest = max(len(r["solution"]) for r in train + test)
    assert longest + 1 <= task.max_new_tokens  # solution + EOS fits the budget
    assert set("".join(r["prompt"] + r["solution"] for r in train)) <= set(task.chars)
    assert task.sft_turns(train[0]) == [train[0]["solution"]]


def test_tokenizer_round_trips_prompt_and_solution():
    tok = build_tokenizer(get_task("longtail").chars)
    row = format_problem(8, 47)
    ids = tok(row["prompt"] + row["solution"]).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(row["prompt"]) + len(row["solution"])
    assert tok.decode(ids, skip_special_tokens=True) == row["prompt"] + row["solution"]


def test_task_model_is_tens_of_millions_of_parameters():
    """The task's shape (built on the meta device: no weights allocated) has 10-30M parameters,
    room for the longest prompt + solution, and the compiler's facts agree with it."""
    task = get_task("longtail")
    cfg = task_model_config("longtail")
    assert cfg != TinyModelConfig() and task_model_config("arith") == TinyModelConfig()
    hf = tiny_config(4 + len(task.chars), **{k: v for k, v in asdict(cfg).items()})
    with torch.device("meta"):
        n = sum(p.numel() for p in model_class(cfg.arch)(hf).parameters())
    assert 10e6 <= n <= 30e6
    assert cfg.max_position >= 1 + 5 + task.max_new_tokens
    facts = tiny_facts({"task": "longtail"})
    assert (facts.hidden, facts.layers, facts.max_len) == (cfg.hidden, cfg.layers, cfg.max_position)
    assert tiny_facts({"task": "longtail", "hidden": 256, "heads": 4}).hidden == 256  # the flow's options win


@pytest.mark.long  # ~50 s on 2 cores, most of it the greedy held-out pass over 344-token budgets
def test_tiny_warm_start_learns_the_format(tmp_path):
    """A 0.2M model of the same family, 60 SFT steps on the task's solutions: the loss falls well
    below the uniform guess (ln 18 = 2.89 nats), and the held-out accuracy is read through ``final``."""
    from flowrl.models.warmstart import SFTConfig, warm_start

    res = warm_start("longtail", model_cfg=TinyModelConfig(max_position=512), seed=0, cache_dir=tmp_path,
                     sft=SFTConfig(steps=60, batch_size=16, lr=3e-3, stop_at_accuracy=None))
    assert res.info["steps_taken"] == 60 and res.info["final_loss"] < 1.5
    assert 0.0 <= res.info["test_accuracy"] <= 1.0
