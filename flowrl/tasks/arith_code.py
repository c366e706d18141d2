"""Arithmetic as code: the completion is a Python program that prints the answer.

The prompts are those of :mod:`flowrl.tasks.arith` (``"12+35="``); a row's ``answer`` is the
reference program ``print(47)`` (what the supervised warm start imitates) and its ``tests``
field holds one input/output case, no input and the expected output ``"47\\n"``: the ``code``
verifier (:mod:`flowrl.rewards.code`) runs each completion in the sandbox
(:mod:`flowrl.sandbox`) and rewards the programs that print it. Any program that does is
right: ``print(12+35)`` and ``print(40+7)`` pass too, a program that fails to parse or prints
something else does not.

The rows are a function of the arithmetic task's splits (same seeds, same problems), so the
shipped files under ``data/arith_code/`` are ``write_splits()``; ``tests/models`` checks they
still are.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.tasks import arith

CHARS = "0123456789+-=print()"
"""Every character a prompt or a reference program contains (the tiny tokenizer's charset)."""


def code_row(row: dict[str, str]) -> dict:
    """The code-task row of an arithmetic row: the program that prints its answer, and that test.

    >>> code_row({"prompt": "12+35=", "answer": "47"})
    {'prompt': '12+35=', 'answer': 'print(47)', 'tests': [{'stdin': '', 'stdout': '47\\n'}]}
    """
    return {"prompt": row["prompt"], "answer": f"print({row['answer']})",
            "tests": [{"stdin": "", "stdout": f"{row['answer']}\n"}]}


def make_splits(n_train: int = arith.DEFAULT_TRAIN, n_test: int = arith.DEFAULT_TEST,
                seed: int = arith.DEFAULT_SEED) -> tuple[list[dict], list[dict]]:
    """``(train, test)``: :func:`flowrl.tasks.arith.make_splits` with each row as :func:`code_row`."""
    train, test = arith.make_splits(n_train, n_test, seed)
    return [code_row(r) for r in train], [code_row(r) for r in test]


def write_splits(out_dir: str | Path, **kwargs) -> tuple[Path, Path]:
    """Write ``make_splits(**kwargs)`` as ``train.jsonl`` and ``test.jsonl``."""
    return arith.write_jsonl_splits(out_dir, make_splits(**kwargs))
