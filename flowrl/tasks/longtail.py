"""A long-tailed-length verifiable task: multiplication written out as repeated addition.

The prompt ``"7*03="`` asks for ``7 * 3``; the completion counts down the additions left
and writes every partial sum, then the final answer after ``=``::

    7*03=  ->  02:007,01:014,00:021=21

Each step is ``RR:PPP`` (the steps still to go, two digits; the partial sum, three digits),
so a step depends only on the step before it at a fixed offset and on the prompt's digit:
a small model learns the step, and its chance of a slip grows with the number of steps.
The number of steps ``k`` is drawn from a Zipf law on ``1..max_steps`` (``P(k) ~ k^-s``), so
completions run from 12 tokens (``00:007=7`` + EOS) to a few hundred (``max_steps`` = 48:
340 characters), most of them short and a long tail of long ones: the shape of real RL
post-training batches, where inference engines, asynchronous steps and partial rollout pay.

A row is ``{"prompt", "answer", "solution"}``: ``answer`` is the final number (what the
``final`` verifier checks), ``solution`` the reference completion the warm start imitates.
:func:`final_answer` reads a completion's answer without evaluating anything in it (model text
is untrusted): the digits after its last ``=``, or None.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from flowrl.tasks.arith import write_jsonl_splits

CHARS = "0123456789*:,="
"""Every character a prompt or a solution contains (the tiny tokenizer's charset)."""

MAX_ANSWER_CHARS = 8
"""An answer longer than this is wrong whatever it says (the largest is 9 * 99 = 891)."""


class LongTailTaskError(ValueError):
    """A long-tail split that cannot be made (bad settings, too few distinct problems)."""


@dataclass(frozen=True)
class LongTailSpec:
    """The task's difficulty and length distribution."""

    max_steps: int = 48
    """Most additions (the longest completion: 7 characters a step, plus the answer)."""
    zipf_s: float = 1.1
    """Exponent of the step-count law ``P(k) ~ k^-zipf_s``: larger, shorter completions."""
    max_digit: int = 9
    """The multiplicand is drawn uniformly from ``1..max_digit``."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= 99:
            raise LongTailTaskError(f"max_steps={self.max_steps}: must be in 1..99 (two-digit step counter)")
        if not 1 <= self.max_digit <= 9:
            raise LongTailTaskError(f"max_digit={self.max_digit}: must be in 1..9 (one-digit multiplicand)")
        if self.zipf_s <= 0:
            raise LongTailTaskError(f"zipf_s={self.zipf_s}: must be > 0")

    @property
    def n_problems(self) -> int:
        return self.max_steps * self.max_digit


DEFAULT_SPEC = LongTailSpec()
DEFAULT_SEED = 4321
DEFAULT_TRAIN = 4000
DEFAULT_TEST = 256


def solution(a: int, k: int) -> str:
    """The reference completion of ``a * k``.

    >>> solution(7, 3)
    '02:007,01:014,00:021=21'
    """
    return ",".join(f"{k - i:02d}:{i * a:03d}" for i in range(1, k + 1)) + f"={a * k}"


def format_problem(a: int, k: int) -> dict[str, str]:
    """The row of ``a * k``: ``{"prompt": "a*kk=", "answer": str(a*k), "solution": ...}``."""
    return {"prompt": f"{a}*{k:02d}=", "answer": str(a * k), "solution": solution(a, k)}


def step_weights(spec: LongTailSpec = DEFAULT_SPEC) -> list[float]:
    """``P(k)`` for ``k = 1..max_steps`` (normalised Zipf weights)."""
    w = [k ** -spec.zipf_s for k in range(1, spec.max_steps + 1)]
    total = sum(w)
    return [x / total for x in w]


def make_split(n: int, seed: int, *, spec: LongTailSpec = DEFAULT_SPEC) -> list[dict[str, str]]:
    """``n`` rows (problems may repeat: there are only ``max_steps * max_digit``), a function of ``seed``."""
    if n < 1:
        raise LongTailTaskError(f"make_split(n={n}): ask for at least one row")
    rng = random.Random(seed)
    ks = rng.choices(range(1, spec.max_steps + 1), weights=step_weights(spec), k=n)
    return [format_problem(rng.randint(1, spec.max_digit), k) for k in ks]


def make_splits(n_train: int = DEFAULT_TRAIN, n_test: int = DEFAULT_TEST, seed: int = DEFAULT_SEED, *,
                spec: LongTailSpec = DEFAULT_SPEC) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, test)`` drawn from the same law with different seeds. With 432 distinct problems
    the test prompts also occur in train: what the split holds out is samples, not problems, and
    held-out accuracy measures how reliably the model carries a long chain, which is what RL lifts."""
    return make_split(n_train, seed + 1, spec=spec), make_split(n_test, seed, spec=spec)


def write_splits(out_dir, **kwargs):
    """Write ``make_splits(**kwargs)`` as ``train.jsonl`` and ``test.jsonl``."""
    return write_jsonl_splits(out_dir, make_splits(**kwargs))


def final_answer(completion: str) -> str | None:
    """The answer a completion gives: the characters after its last ``=``, stripped, when they
    are 1 to ``MAX_ANSWER_CHARS`` ASCII digits; else None. Never evaluates the text.

    >>> final_answer("02:007,01:014,00:021=21"), final_answer("00:021=2x"), final_answer("21")
    ('21', None, None)
    """
    head, sep, tail = completion.rpartition("=")
    tail = tail.strip()
    if not sep or not 1 <= len(tail) <= MAX_ANSWER_CHARS or not (tail.isascii() and tail.isdigit()):
        return None
    return str(int(tail))


def sft_turns(row: dict) -> list[str]:
    """What the warm start trains on: the reference solution, one model turn."""
    return [row["solution"]]


def spec_dict(spec: LongTailSpec = DEFAULT_SPEC) -> dict:
    return asdict(spec)
