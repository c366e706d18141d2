"""The prompt lengths a flow's generate ops will see, measured from its datasets where that is cheap.

The cost model charges every generate for prefilling its prompts and every log-prob and update
pass for the prompt tokens of each sample. A flow does not state its prompts' length, but its
datasets hold them: for each ``generate``, the first :data:`PROMPT_ROWS` rows of the training
file of each dataset its prompts are sampled from are counted with the model's tokenizer (where
that is cheap: :func:`~flowrl.compiler.model_info.prompt_counter`), and the mean is the
estimate's prompt length. Where the rows or the tokenizer cannot be read (Parquet, a large
tokenizer, a flow compiled from memory, datasets passed in as parameters), the estimate keeps
its assumption (:func:`~flowrl.compiler.workload.prompt_tokens`), and ``flowrl plan`` says which
it used.

A chat dataset's prompts are counted without the chat template (their messages' text): a lower
bound of what the engine prefills.

The same rows say whether every reference answer is an integer, which is what a verifier's
fast path depends on (:attr:`~flowrl.catalog.ops.VerifierCost.integer_seconds_per_item`).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from functools import lru_cache

from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import prompt_counter
from flowrl.compiler.resources import DatasetFile, checked, dataset_files, file_version, prompt_datasets, text_option
from flowrl.ir.graph import FlowGraph, Node

PROMPT_ROWS = 64
"""Rows of a dataset's training file whose prompts are counted (its first ones)."""


@dataclass(frozen=True)
class PromptLength:
    """The mean prompt length of one generate's datasets, in tokens, and where it was read."""

    tokens: float
    source: str
    """As the plan prints it, e.g. ``"mean of the first 64 rows of `../data/arith/train.jsonl`"``."""
    integer_answers: bool = False
    """Whether every one of those rows has an integer reference answer (``42``, ``"-7"``)."""


def measured_prompts(graph: FlowGraph, ctx: CompileContext | None) -> dict[str, PromptLength]:
    """Generate op id -> the mean prompt length of the rows it samples from, where they can be read."""
    out: dict[str, PromptLength] = {}
    for node in graph.nodes():
        if node.kind != OpKind.GENERATE or not node.model:
            continue
        count = prompt_counter(graph, node.model)
        if count is None:
            continue
        means, where, integers = [], [], True
        for dataset in prompt_datasets(graph, node):
            if ctx is None or not checked(dataset, ctx):
                continue
            train = _training_file(dataset)
            if train is None:
                continue
            rows = _rows(str(train.path), file_version(train), OPS[dataset.op].file_format,
                         text_option(dataset, "prompt") or "prompt", text_option(dataset, "answer") or "answer")
            if rows:
                means.append(statistics.fmean(count(p) for p, _ in rows))
                where.append(f"mean of the first {len(rows)} rows of `{train.written}`")
                integers = integers and all(_is_integer(a) for _, a in rows)
        if means:
            out[node.id] = PromptLength(round(statistics.fmean(means), 2), "; ".join(where), integers)
    return out


def _training_file(dataset: Node) -> DatasetFile | None:
    """The file a dataset declaration trains on (its first path option, not ``eval``)."""
    spec = OPS.get(dataset.op)
    if spec is None or not spec.paths:
        return None
    return next((f for f in dataset_files(dataset, spec) if f.option == spec.paths[0]), None)


_INTEGER = re.compile(r"\s*[-+]?\d+\s*")


def _is_integer(answer) -> bool:
    """An integer reference answer, as a JSON number or text (``_is_integer("-7")``; not ``1.5``, ``"1/2"``)."""
    if isinstance(answer, bool):
        return False
    return isinstance(answer, int) or (isinstance(answer, str) and _INTEGER.fullmatch(answer) is not None)


@lru_cache(maxsize=64)
def _rows(path: str, version, file_format: str | None, prompt_field: str, answer_field: str) -> tuple:
    """The first rows' ``(prompt, answer)`` of a file, read once per file version (a check compiles
    every flow of a file)."""
    from flowrl.data.datasets import head_rows

    if version is None:
        return ()
    return tuple(head_rows(path, prompt_field=prompt_field, answer_field=answer_field, format=file_format,
                           rows=PROMPT_ROWS))


__all__ = ["PromptLength", "measured_prompts", "PROMPT_ROWS"]
