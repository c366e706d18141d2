"""Arithmetic with a calculator tool: 4-digit sums, answered in the head or through a tool call.

Prompts are :mod:`flowrl.tasks.arith`'s with 4-digit operands from 5000 (``"6958+6408="``); the
answer is the sum (``"13366"``, always 5 digits). The environment
:class:`flowrl.envs.calculator.Calculator` answers a turn that is only the expression
(``6958+6408``) with ``13366=``, and the model's next turn copies ``13366``.

The supervised warm start (:func:`sft_turns`) shows both ways to answer: a fixed
:data:`TOOL_FRAC` of the rows through a calculator call (prompt, call, result, answer), the
others directly. The warm start stops when whole transcripts pass its check (``Task.sft``);
the warm 2-layer model then gets few sums right in its head and, greedily, calls the tool on
most prompts but copies badly; RL with the calculator
(``flows/agentic_calc.flow``) makes the call its first move, which is what
``bench/agentic.py`` measures. That is the cold start, then RL, recipe of tool-integrated RL
(ReTool, ToRL), at the scale of this repository.

The shipped files under ``data/arith_tool/`` are ``write_splits()``; ``tests/models`` checks
they still are.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from flowrl.tasks import arith

CHARS = arith.CHARS
"""Digits, ``+``, ``-``, ``=``: calls and results use the same characters as problems."""

SPEC = arith.ArithSpec(max_operand=9999, min_operand=5000)
"""4-digit operands from 5000, ``+`` only: every sum has 5 digits (``"6958+6408="``: ``13366``), so a
calculator result (``13366=``) and the answer that copies it have one width, and the copy is
a fixed offset back (with results of 4 or 5 digits, 1500 warm-start steps did not teach the
2-layer model to copy the result: it kept adding)."""

TOOL_FRAC = 0.5
"""The fraction of warm-start rows that show a calculator call (chosen per row by a hash of
its prompt, so the choice does not depend on the order or the seed). With a quarter, 600
warm-start steps did not teach the model to copy the result: its answer turn kept adding."""


def calls_tool(row: dict[str, str]) -> bool:
    """Whether the warm start shows ``row`` answered through a calculator call.

    >>> [calls_tool({"prompt": f"{i:04d}+0001="}) for i in range(8)]
    [False, True, False, False, False, True, True, True]
    """
    return zlib.crc32(row["prompt"].encode()) % 100 < round(100 * TOOL_FRAC)


def sft_turns(row: dict[str, str]) -> list[str]:
    """The turns the warm start trains on: model turns at even positions, the environment's
    observations at odd ones (as the runtime lays out an episode: each model turn ends with
    EOS, an observation is appended without special tokens).

    >>> sft_turns({"prompt": "0001+0001=", "answer": "2"})
    ['0001+0001', '2=', '2']
    >>> sft_turns({"prompt": "0000+0001=", "answer": "1"})
    ['1']
    """
    if not calls_tool(row):
        return [row["answer"]]
    return [row["prompt"].rstrip("="), f"{row['answer']}=", row["answer"]]


def make_splits(n_train: int = arith.DEFAULT_TRAIN, n_test: int = arith.DEFAULT_TEST,
                seed: int = arith.DEFAULT_SEED) -> tuple[list[dict], list[dict]]:
    """``(train, test)``: :func:`flowrl.tasks.arith.make_splits` with 4-digit operands."""
    return arith.make_splits(n_train, n_test, seed, spec=SPEC)


def write_splits(out_dir: str | Path, **kwargs) -> tuple[Path, Path]:
    """Write ``make_splits(**kwargs)`` as ``train.jsonl`` and ``test.jsonl``."""
    return arith.write_jsonl_splits(out_dir, make_splits(**kwargs))
