"""A verifiable arithmetic task: ``"a+b="`` / ``"a-b="`` prompts, integer answers.

The prompt ends with ``=``; the model's completion is the decimal answer (``-`` for a
negative result) followed by EOS, so verifying a completion is an exact string match
after stripping, e.g. prompt ``"12+35="`` → completion ``"47"``.

Splits are deterministic functions of their arguments: ``make_split`` samples distinct
problems with a seeded ``random.Random``, and ``make_splits`` carves disjoint train and
test sets out of one such sample so that held-out accuracy measures generalisation, not
memorisation. The files shipped under ``data/arith/`` are ``write_splits`` of the
defaults below; ``tests/models`` checks that they are still equal to it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

CHARS = "0123456789+-="
"""Every character a prompt or an answer can contain (the tiny tokenizer's charset)."""

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}


class ArithTaskError(ValueError):
    """An arithmetic split that cannot be made (bad operator, too few distinct problems...)."""


@dataclass(frozen=True)
class ArithSpec:
    """Difficulty of the task (the defaults are the ones ``bench/rl_feasibility.py`` chose)."""

    max_operand: int = 99
    """Operands are drawn uniformly from ``[min_operand, max_operand]``."""
    min_operand: int = 0
    """The smallest operand (``flowrl.tasks.arith_tool`` keeps its sums at 5 digits with it)."""
    ops: str = "+"
    """Operators to mix, each drawn with equal probability. Default "+" only: with "+-"
    mixed the 2-layer model was still at 8% after 2500 SFT steps, too slow for a demo."""
    zero_pad: bool = True
    """Write operands with a fixed number of digits (``"07+35="``): every prompt then has
    the same length and each digit a fixed position, which a 2-layer model learns far
    faster than variable-width operands (measured in ``bench/rl_feasibility.py``)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(_OPS))
        if unknown or not self.ops:
            raise ArithTaskError(f"ops={self.ops!r}: unknown operators {unknown}; use a non-empty subset of '+-'")
        if self.max_operand < 1:
            raise ArithTaskError(f"max_operand={self.max_operand}: must be >= 1")
        if not 0 <= self.min_operand < self.max_operand:
            raise ArithTaskError(f"min_operand={self.min_operand}: must be >= 0 and below max_operand={self.max_operand}")

    @property
    def n_problems(self) -> int:
        """How many distinct problems this spec can produce."""
        return len(set(self.ops)) * (self.max_operand - self.min_operand + 1) ** 2


DEFAULT_SPEC = ArithSpec()
DEFAULT_SEED = 1234
DEFAULT_TRAIN = 4000
DEFAULT_TEST = 400


def format_problem(a: int, op: str, b: int, *, width: int = 0) -> dict[str, str]:
    """The row of one problem: ``{"prompt": "a<op>b=", "answer": str(result)}``.

    Operands are zero-padded to ``width`` digits (0: no padding); the answer never is.
    """
    return {"prompt": f"{a:0{width}d}{op}{b:0{width}d}=" if width else f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))}


def make_split(
    n: int, seed: int, *, spec: ArithSpec = DEFAULT_SPEC, exclude: frozenset[str] | set[str] = frozenset()
) -> list[dict[str, str]]:
    """``n`` distinct problems (no prompt repeats, none in ``exclude``), a function of ``seed``.

    Returns rows ``{"prompt": str, "answer": str}`` in sampling order.
    """
    available = spec.n_problems - len(exclude)
    if n > available:
        raise ArithTaskError(
            f"make_split(n={n}): only {available} distinct problems exist for {spec} after excluding "
            f"{len(exclude)}; raise max_operand or ask for fewer rows"
        )
    rng = random.Random(seed)
    ops = sorted(set(spec.ops))  # sorted: the same spec gives the same stream whatever the ops' order
    width = len(str(spec.max_operand)) if spec.zero_pad else 0
    rows: list[dict[str, str]] = []
    seen = set(exclude)
    while len(rows) < n:
        a, op, b = (rng.randint(spec.min_operand, spec.max_operand), rng.choice(ops),
                    rng.randint(spec.min_operand, spec.max_operand))
        row = format_problem(a, op, b, width=width)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def make_splits(
    n_train: int = DEFAULT_TRAIN, n_test: int = DEFAULT_TEST, seed: int = DEFAULT_SEED, *, spec: ArithSpec = DEFAULT_SPEC
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Disjoint ``(train, test)`` rows: the test split is drawn first, train excludes it."""
    test = make_split(n_test, seed, spec=spec)
    train = make_split(n_train, seed + 1, spec=spec, exclude={r["prompt"] for r in test})
    return train, test


def write_splits(out_dir: str | Path, **kwargs) -> tuple[Path, Path]:
    """Write ``make_splits(**kwargs)`` as ``train.jsonl`` and ``test.jsonl`` (one JSON object a line)."""
    return write_jsonl_splits(out_dir, make_splits(**kwargs))


def write_jsonl_splits(out_dir: str | Path, splits: tuple[list[dict], list[dict]]) -> tuple[Path, Path]:
    """``(train, test)`` rows written as ``out_dir/train.jsonl`` and ``test.jsonl``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip(("train", "test"), splits):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def spec_dict(spec: ArithSpec = DEFAULT_SPEC) -> dict:
    """The spec as a plain dict (for cache keys and reports)."""
    return asdict(spec)
