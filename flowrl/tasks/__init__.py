"""Verifiable tasks shipped with flowrl, by name.

A task bundles what a run needs besides a model: the character set of its tiny
tokenizer, its train/test rows (``{"prompt", "answer"}``), the name of the verifier
that scores completions (``flowrl.rewards.verifiers``) and how many tokens an answer
can take. Rows come from the files shipped under ``data/<task>/``; where those are not
present (an installed package without data) the task's deterministic generator
rebuilds the same rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flowrl.tasks import arith, arith_code, arith_tool, longtail
from flowrl.tasks.rg import RG_TASKS

DATA_ROOT = Path(__file__).resolve().parents[2] / "data"
"""``<repo>/data``: where the shipped split files live."""

SPLITS = ("train", "test")


class UnknownTaskError(KeyError):
    """A task name that is not registered."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


@dataclass(frozen=True)
class Task:
    """One registered task."""

    name: str
    """Registry name, also the folder under ``data/``."""
    chars: str
    """Every character prompts and answers use (the tiny tokenizer's charset)."""
    verifier: str
    """Name of the verifier in ``flowrl.rewards.verifiers.VERIFIERS``."""
    max_new_tokens: int
    """Generation budget that fits any answer plus EOS."""
    make_splits: Callable[[], tuple[list[dict[str, str]], list[dict[str, str]]]]
    """Rebuilds ``(train, test)`` rows exactly as shipped."""
    spec: Callable[[], dict]
    """The generator's settings as a dict (part of warm-start cache keys)."""
    sft_turns: Callable[[dict], list[str]] | None = None
    """What the warm start trains on for a row: model turns at even positions, the
    environment's observations at odd ones (None: the row's ``answer``, one turn)."""
    sft: dict = field(default_factory=dict)
    """Warm-start settings of this task (``SFTConfig`` fields), under the caller's own."""
    model: dict = field(default_factory=dict)
    """The shape of this task's tiny model (``TinyModelConfig`` fields), under the caller's own
    (a flow's ``tiny(hidden = ...)``); empty: the tiny defaults."""
    final: Callable[[str], str | None] | None = None
    """Reads the answer out of a completion (None when it gives none) for the warm start's
    held-out accuracy; None: the whole stripped completion is the answer."""

    @property
    def data_dir(self) -> Path:
        return DATA_ROOT / self.name

    def rows(self, split: str) -> list[dict[str, str]]:
        """The rows of ``split`` ("train" or "test"): the shipped file, else regenerated."""
        if split not in SPLITS:
            raise ValueError(f"task {self.name!r} has no split {split!r}; use one of {SPLITS}")
        path = self.data_dir / f"{split}.jsonl"
        if path.is_file():
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return self.make_splits()[SPLITS.index(split)]


LONGTAIL_SFT = {"batch_size": 16, "lr": 1e-3, "steps": 300, "stop_at_accuracy": 0.3, "check_every": 20,
                "check_rows": 128}
"""The long-tail task's warm start: small batches (a batch pads to its longest solution, up to
341 tokens) and a stop at 30% on its validation rows, which leaves RL the long chains to lift."""

RG_SFT = {"stop_at_accuracy": 0.3, "check_rows": 256}
"""The Reasoning Gym tasks' warm start: as the arithmetic task's (stop at 30% on held-out-like rows)."""

TASKS: dict[str, Task] = {
    "arith": Task(
        name="arith",
        chars=arith.CHARS,
        verifier="exact",
        max_new_tokens=5,  # "-99" or "198", then EOS, plus one spare
        make_splits=arith.make_splits,
        spec=lambda: {
            **arith.spec_dict(),
            "seed": arith.DEFAULT_SEED,
            "n_train": arith.DEFAULT_TRAIN,
            "n_test": arith.DEFAULT_TEST,
        },
    ),
    "arith_code": Task(
        name="arith_code",
        chars=arith_code.CHARS,
        verifier="code",
        max_new_tokens=12,  # "print(198)", then EOS, plus one spare
        make_splits=arith_code.make_splits,
        spec=lambda: {
            **arith.spec_dict(),
            "seed": arith.DEFAULT_SEED,
            "n_train": arith.DEFAULT_TRAIN,
            "n_test": arith.DEFAULT_TEST,
            "program": "print(answer)",
        },
    ),
    "arith_tool": Task(
        name="arith_tool",
        chars=arith_tool.CHARS,
        verifier="exact",
        max_new_tokens=12,  # a call "1234+5678" (9), then EOS, plus spares
        make_splits=arith_tool.make_splits,
        spec=lambda: {
            **arith.spec_dict(arith_tool.SPEC),
            "seed": arith.DEFAULT_SEED,
            "n_train": arith.DEFAULT_TRAIN,
            "n_test": arith.DEFAULT_TEST,
            "tool_frac": arith_tool.TOOL_FRAC,
        },
        sft_turns=arith_tool.sft_turns,
        # The check scores whole transcripts (a call, the copied result) on rows it never trained
        # on; the model learns them in a sudden transition whose start varies with the seed (seed
        # 0 was past it at 600 steps, seed 1 not yet), so a fixed length does not fit every seed.
        sft={"stop_at_accuracy": 0.25},
    ),
    "longtail": Task(
        name="longtail",
        chars=longtail.CHARS,
        verifier="final",
        max_new_tokens=7 * longtail.DEFAULT_SPEC.max_steps + 8,  # 7 a step, "=" + 3 digits, EOS, spares
        make_splits=longtail.make_splits,
        spec=lambda: {
            **longtail.spec_dict(),
            "seed": longtail.DEFAULT_SEED,
            "n_train": longtail.DEFAULT_TRAIN,
            "n_test": longtail.DEFAULT_TEST,
        },
        sft_turns=longtail.sft_turns,
        final=longtail.final_answer,
        # ~12M parameters: 4 blocks of width 512 (heads of 64, which vLLM's CPU attention takes),
        # room for the longest prompt + solution (6 + 341 tokens).
        model={"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 1408, "max_position": 512},
        sft=LONGTAIL_SFT,
    ),
}

for _name, _rg in RG_TASKS.items():
    # Reasoning Gym tasks (flowrl.tasks.rg): their rows generated by reasoning_gym, not shipped. Their flows
    # score with the task's own scorer (reasoning_gym_score()); the task's rows are prompt and answer only,
    # and full marks on these tasks is the exact answer. The warm start stops at RG_SFT's accuracy.
    TASKS[_name] = Task(name=_name, chars=_rg.chars, verifier="exact", max_new_tokens=_rg.max_answer + 2,
                        make_splits=_rg.make_splits, spec=_rg.spec, sft=RG_SFT)


def get_task(name: str) -> Task:
    """The registered task called ``name``."""
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTaskError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)}") from None
