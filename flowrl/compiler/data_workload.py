"""The workload a flow's generate ops will see, measured from its datasets where that is cheap.

The cost model charges every generate for prefilling its prompts and decoding its responses,
and every log-prob and update pass for the tokens of each sample. A flow does not state these
lengths, but its datasets hold them: for each ``generate``, the first :data:`ROWS` rows of the
training file of each dataset its prompts are sampled from are counted with the model's
tokenizer (where that is cheap: :func:`~flowrl.compiler.model_info.prompt_counter`):

* the prompts' mean is the estimate's prompt length;
* where the dataset names a reference completion (``completion = "solution"``: a worked
  solution, what TRL's prompt-completion datasets call ``completion``), their mean, plus the
  end-of-sequence token and capped at ``max_tokens``, is the responses' mean length (the
  estimate keeps its long-tailed shape, :meth:`~flowrl.cost.sim.LengthDist.with_mean`): a
  policy that solves the task writes about that much;
* else, where the policy writes the answer alone (a tiny model warm-started on its task's answers,
  :func:`~flowrl.compiler.model_info.writes_answers`), the answers' mean, counted the same way.
  Otherwise the responses' length stays an assumption (:func:`~flowrl.compiler.workload.lengths`).

Where the rows or the tokenizer cannot be read (Parquet, a large tokenizer, a flow compiled from
memory, datasets passed in as parameters), the estimate keeps its assumptions, and ``flowrl plan``
says which it used.

A chat dataset's prompts are counted without the chat template (their messages' text): a lower
bound of what the engine prefills; a chat completion (a list of messages) counts its messages' text.

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
from flowrl.compiler.model_info import prompt_counter, writes_answers
from flowrl.compiler.resources import DatasetFile, checked, dataset_files, file_version, prompt_datasets, text_option
from flowrl.data.chat import message_problem, prompt_words
from flowrl.data.datasets import head_rows
from flowrl.ir.graph import Const, FlowGraph, Node

ROWS = 64
"""Rows of a dataset's training file that are read (its first ones)."""


@dataclass(frozen=True)
class DataWorkload:
    """What one generate's datasets say of its work: mean lengths in tokens, and where they were read."""

    prompt_tokens: float
    prompt_source: str
    """As the plan prints it, e.g. ``"mean of the first 64 rows of `../data/arith/train.jsonl`"``."""
    integer_answers: bool = False
    """Whether every one of those rows has an integer reference answer (``42``, ``"-7"``)."""
    response_tokens: float | None = None
    """Mean tokens of the rows' reference completions (or answers, where the policy writes those alone) as
    responses (end-of-sequence included, capped at the generate's ``max_tokens``); None where neither is known."""
    response_source: str = ""


def measured_workload(graph: FlowGraph, ctx: CompileContext | None) -> dict[str, DataWorkload]:
    """Generate op id -> what the rows it samples from say of its work, where they can be read."""
    out: dict[str, DataWorkload] = {}
    for node in graph.nodes():
        if node.kind != OpKind.GENERATE or not node.model:
            continue
        count = prompt_counter(graph, node.model)
        if count is None:
            continue
        cap = _max_tokens(node)
        answers_alone = writes_answers(graph, node.model)
        specials = count("")  # tokens the tokenizer adds to any text (a tiny model's <bos>)
        prompts, responses, where, refs, integers = [], [], [], [], True
        for dataset in prompt_datasets(graph, node):
            if ctx is None or not checked(dataset, ctx):
                continue
            train = _training_file(dataset)
            if train is None:
                continue
            completion, answer = text_option(dataset, "completion"), text_option(dataset, "answer") or "answer"
            rows = _rows(str(train.path), file_version(train), OPS[dataset.op].file_format,
                         text_option(dataset, "prompt") or "prompt", (answer, *((completion,) if completion else ())),
                         text_option(dataset, "template") or "")
            if not rows:
                continue
            prompts.append(statistics.fmean(count(p) for p, _ in rows))
            where.append(f"mean of the first {len(rows)} rows of `{train.written}`")
            integers = integers and all(_is_integer(values[0]) for _, values in rows)
            texts, field, why = _responses(rows, completion, answer, answers_alone)
            if texts:  # each written out, then the end-of-sequence token
                responses.append(statistics.fmean(min(count(t) - specials + 1, cap) for t in texts))
                refs.append(f"mean of the first {len(texts)} rows' `{field}` in `{train.written}`{why}")
        if prompts:
            out[node.id] = DataWorkload(
                round(statistics.fmean(prompts), 2), "; ".join(where), integers,
                round(statistics.fmean(responses), 2) if responses else None, "; ".join(refs))
    return out


def _responses(rows, completion: str, answer: str, answers_alone: bool) -> tuple[list[str], str, str]:
    """The texts the responses are taken to be, the field they come from and why (as the plan says it): the
    reference completions where the dataset names them, else the answers where the policy writes those alone."""
    texts = [t for _, values in rows if completion and (t := _text(values[1])) is not None]
    if texts or not answers_alone:
        return texts, completion, ""
    answers = [str(a) for _, (a, *_) in rows if isinstance(a, (str, int, float)) and not isinstance(a, bool)]
    return answers, answer, ": the policy, warm-started on answers, writes them alone"


def _max_tokens(node: Node) -> int:
    value = node.attr("max_tokens")
    return int(value.value) if isinstance(value, Const) and isinstance(value.value, int) else 1 << 30


def _training_file(dataset: Node) -> DatasetFile | None:
    """The file a dataset declaration trains on (its first path option, not ``eval``)."""
    spec = OPS.get(dataset.op)
    if spec is None or not spec.paths:
        return None
    return next((f for f in dataset_files(dataset, spec) if f.option == spec.paths[0]), None)


def _text(completion) -> str | None:
    """A reference completion's text: a string, or a chat completion's messages' contents (TRL's
    conversational format); None for anything else."""
    if isinstance(completion, str):
        return completion
    return prompt_words(completion) if message_problem(completion) is None else None


_INTEGER = re.compile(r"\s*[-+]?\d+\s*")


def _is_integer(answer) -> bool:
    """An integer reference answer, as a JSON number or text (``_is_integer("-7")``; not ``1.5``, ``"1/2"``)."""
    if isinstance(answer, bool):
        return False
    return isinstance(answer, int) or (isinstance(answer, str) and _INTEGER.fullmatch(answer) is not None)


@lru_cache(maxsize=64)
def _rows(path: str, version, file_format: str | None, prompt_field: str, fields: tuple[str, ...],
          template: str = "") -> tuple:
    """The first rows' ``(prompt, (answer[, completion]))`` of a file (the prompt written by the dataset's
    template where it has one), read once per file version (a check compiles every flow of a file)."""
    if version is None:
        return ()
    return tuple(head_rows(path, prompt_field=prompt_field, fields=fields, format=file_format, rows=ROWS,
                           template=template))


__all__ = ["DataWorkload", "measured_workload", "ROWS"]
