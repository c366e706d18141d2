"""Score completions with a Reasoning Gym task's own scorer (``score_answer``), as reasoning_gym evaluates.

reasoning_gym's evaluation reads the answer out of a completion with
``reasoning_gym.utils.extract_answer`` (the text of the last ``<answer>...</answer>``, stripped)
and scores it with the task's ``score_answer(answer, entry)``: 1.0 right, partial credit for
some tasks (an answer holding the oracle's text scores ``len(oracle) / len(answer)``), 0.0 for
no answer. :func:`extract` does the same, with a fallback for models that write the answer
bare (a tiny model, a completion-style prompt): ``extract = "auto"`` (the default) takes the
tag's text where the completion has one, else the whole stripped completion; ``"tag"`` only
the tag (reasoning_gym's own rule); ``"raw"`` the whole stripped completion.

Which task and entry a sample is scored against comes from its dataset row:

* a row of ``reasoning_gym(...)`` (:mod:`flowrl.data.reasoning_gym`) names its generator, config,
  seed and index: the entry is generated again, exactly (original types), and scored by a task
  object made with the same config (some scorers read it: ``decimal_arithmetic``'s precision);
* any other row with reasoning_gym's ``metadata.source_dataset`` (a split reasoning_gym wrote
  to a JSON-lines file) is scored as it is, by the task's default-config scorer (what
  ``reasoning_gym.get_score_answer_fn`` gives).

A row with neither, an unknown task or a scorer that raises is that sample's error (its
reward is the pool's error reward, the message in ``events.log``), never the run's.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from typing import Any

from flowrl.data.reasoning_gym import SOURCE, ReasoningGymError, entry, generator, require

EXTRACT_MODES = ("auto", "tag", "raw")
"""How the answer is read out of a completion (see the module docstring)."""

_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer's


def extract(completion: str, mode: str = "auto") -> str | None:
    """The answer in ``completion`` (None: none, which scores 0).

    >>> extract("I think <answer> 42 </answer>"), extract("42\\n"), extract("42", "tag"), extract("<answer>1</answer>", "raw")
    ('42', '42', None, '<answer>1</answer>')
    """
    if mode not in EXTRACT_MODES:
        raise ValueError(f"extract={mode!r}: use one of {EXTRACT_MODES}")
    if mode != "raw":
        found = _TAG.findall(completion)
        if found:
            return found[-1].strip()
        if mode == "tag":
            return None
    return completion.strip()


class RowError(ValueError):
    """A row that does not say which reasoning_gym task and entry it is."""


@lru_cache(maxsize=128)
def _default_scorer(task: str):
    rg = require()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ReasoningGymError(f"the row's metadata names reasoning_gym task {task!r}, which the installed "
                                "package does not register")
    return rg.get_score_answer_fn(task)


def _entry_and_scorer(row: Any):
    """``(entry, score_answer)`` of a row (see the module docstring)."""
    if not isinstance(row, dict):
        raise RowError("no dataset row to score against (reasoning_gym_score reads each sample's row)")
    src = row.get(SOURCE)
    if isinstance(src, dict) and {"task", "config", "seed", "size", "index"} <= set(src):
        ds = generator(src["task"], src["config"], src["seed"], src["size"])
        e = entry(src["task"], src["config"], src["seed"], src["size"], src["index"])
        return e, ds.score_answer
    meta = row.get("metadata")
    if isinstance(meta, str):  # a parquet or CSV export keeps it as JSON text
        try:
            meta = json.loads(meta)
        except ValueError:
            meta = None
    task = meta.get("source_dataset") if isinstance(meta, dict) else None
    if not isinstance(task, str):
        raise RowError(f"the row has neither a `{SOURCE}` field (rows of `reasoning_gym(...)`) nor "
                       "`metadata.source_dataset` (rows reasoning_gym wrote): its task is unknown")
    return {**row, "metadata": meta}, _default_scorer(task)


def reasoning_gym_score(completions: list[str], answers: list[str], *, rows: list | None = None,
                        extract_mode: str = "auto") -> list[float]:
    """Each completion's score by its row's task (``score_answer(extract(completion), entry)``), in [0, 1]:
    ``reasoning_gym_score()`` in a flow (partial credit kept) and ``verifier("reasoning_gym")`` (full marks
    its ``correct``, anything less its ``wrong``).
    ``[N]`` completions and rows -> ``[N]`` floats. Raises for a batch with a bad row: the pool then
    scores one sample at a time, so only the bad rows' samples fail."""
    if rows is None or len(rows) != len(completions):
        raise RowError(f"{len(completions)} completions but {0 if rows is None else len(rows)} rows; "
                       "reasoning_gym_score reads each sample's dataset row")
    out = []
    for completion, row in zip(completions, rows):
        e, score = _entry_and_scorer(row)
        value = float(score(extract(completion, extract_mode), e))
        out.append(value if math.isfinite(value) else 0.0)
    return out


__all__ = ["EXTRACT_MODES", "extract", "reasoning_gym_score", "RowError"]
