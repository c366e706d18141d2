"""The tiny Reasoning Gym tasks (flowrl/tasks/rg.py): their rows are the training and held-out splits of the
`reasoning_gym(...)` dataset their flows declare, each training question once, and their charsets hold
every character of those rows (the tiny tokenizer would map any other to <unk>)."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from flowrl.data.reasoning_gym import generate_splits  # noqa: E402
from flowrl.tasks import TASKS  # noqa: E402
from flowrl.tasks.rg import RG_TASKS  # noqa: E402


@pytest.mark.parametrize("name", sorted(RG_TASKS))
def test_task_rows_are_the_datasets_splits_and_its_charset_covers_them(name):
    rg, task = RG_TASKS[name], TASKS[name]
    train, test = task.make_splits()
    d_train, d_held = generate_splits(rg.task, rg.config, size=rg.size, seed=rg.seed, eval_size=rg.eval_size)
    assert [r["prompt"] for r in train] == list(dict.fromkeys(r["question"] for r in d_train))  # each once, in order
    assert test == [{"prompt": r["question"], "answer": r["answer"]} for r in d_held]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    used = set("".join(r["prompt"] + r["answer"] for r in train + test))
    assert used <= set(task.chars), sorted(used - set(task.chars))
    assert max(len(r["answer"]) for r in train + test) + 1 <= task.max_new_tokens  # the answer and EOS
