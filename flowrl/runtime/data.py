"""A run's data: datasets read through :data:`DATASET_FORMATS`, one sampler per ``sample`` op, the tokenizer.

A plan's :class:`~flowrl.plan.DatasetPlan` names its format (``jsonl``, ``parquet``: the op
that declared it); the catalogue record of that op names the reader here
(``OpSpec.handler``), and a format without a reader is an error. :class:`RunData` is the
:class:`~flowrl.runtime.step.DataService` handlers draw prompts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from flowrl.catalog.ops import OpKind
from flowrl.plan import DatasetPlan, ExecutionPlan, OpPlan
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.kinds import builder_for
from flowrl.runtime.step import op_seed


@dataclass(frozen=True)
class Dataset:
    """One dataset's rows (training split and held-out split) and its column names."""

    rows: list
    prompt: str
    answer: str
    eval_rows: list


RowCheck = Callable[[dict], "str | None"]
"""A row -> what is wrong with it (a bad row, see ``DatasetPlan.bad_rows``), or None."""


def _read(d: DatasetPlan, path: str, suffix: str, check: RowCheck | None, skipped: list | None) -> list:
    from flowrl.data.datasets import load_rows
    from flowrl.pyrefs import folder_of

    # A missing file's message names the folder the flow's relative paths were resolved against.
    return load_rows(path, prompt_field=d.prompt, answer_fields=d.row_fields, format=suffix,
                     relative_to=folder_of(d.origin), chat=d.chat, bad_rows=d.bad_rows, check=check, skipped=skipped)


def jsonl(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None) -> Dataset:
    """``jsonl(path, eval = ...)``: one JSON object per line."""
    return Dataset(_read(d, d.path, ".jsonl", check, skipped), d.prompt, d.answer,
                   _read(d, d.eval_path, ".jsonl", check, skipped) if d.eval_path else [])


def parquet(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None) -> Dataset:
    """``parquet(path, eval = ...)``: a Parquet table with the named columns."""
    return Dataset(_read(d, d.path, ".parquet", check, skipped), d.prompt, d.answer,
                   _read(d, d.eval_path, ".parquet", check, skipped) if d.eval_path else [])


DATASET_FORMATS: dict[str, Callable[..., Dataset]] = {f.__name__: f for f in (jsonl, parquet)}
"""``OpSpec.handler`` of a dataset op -> its reader ``(plan, check=None, skipped=None) -> Dataset``
(``check`` and ``skipped``: see :func:`flowrl.data.datasets.load_rows`)."""


def reader_of(d: DatasetPlan) -> Callable[[DatasetPlan], Dataset]:
    """The reader of ``d``'s format (its op's ``OpSpec.handler``); an unknown format is an error."""
    return builder_for(d.format, OpKind.DATASET, DATASET_FORMATS, d.origin, noun="a dataset format",
                       listing="formats", things="datasets")


def read_dataset(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None) -> Dataset:
    """``d``'s rows through the reader its op's record names; bad rows (``check``'s too) go by
    ``d.bad_rows``, the skipped ones' messages into ``skipped``."""
    return reader_of(d)(d, check, skipped)


def prompt_limit(plan: ExecutionPlan, contexts: dict[str, int]) -> int | None:
    """The most prompt tokens every ``generate`` can take: its rollout engine's context
    (``contexts``: model id -> tokens) less its ``max_tokens``; None when nothing generates.
    A longer prompt would stop the run at its first draw (the engines' ``check_lengths``)."""
    limits = [contexts[op.model] - int(op.options.get("max_tokens", 0))
              for op in plan.ops if op.kind == OpKind.GENERATE and op.model in contexts]
    return min(limits) if limits else None


def _length_check(d: DatasetPlan, tokenizer: Any, limit: int | None) -> RowCheck | None:
    """A row check refusing prompts (as the model reads them) longer than ``limit`` tokens."""
    if limit is None or tokenizer is None:
        return None
    from flowrl.data.chat import ChatError, encode, render

    def check(row: dict) -> str | None:
        try:
            text = render(tokenizer, row[d.prompt], True) if d.chat else row[d.prompt]
        except ChatError:
            return None  # the dataset's rendering reports it, for the whole dataset (_rendered)
        n = len(encode(tokenizer, text))
        if n > limit:
            return (f"the prompt has {n} tokens, more than the {limit} the rollout engine's context leaves after "
                    "max_tokens; hint: shorten it, lower max_tokens or use a model with a longer context")
        return None
    return check


def _rendered(ds: Dataset, d: DatasetPlan, tokenizer: Any) -> Dataset:
    """``ds`` with each prompt as the model reads it (:func:`flowrl.data.chat.render`)."""
    if not d.chat:
        return ds
    from flowrl.data.chat import ChatError, render_rows

    try:
        return Dataset(render_rows(ds.rows, ds.prompt, tokenizer, True), ds.prompt, ds.answer,
                       render_rows(ds.eval_rows, ds.prompt, tokenizer, True))
    except ChatError as e:
        raise RuntimeFlowError(f"{d.origin}: dataset `{d.id}` (chat = true): {e}") from None


class RunData:
    """Datasets, samplers and the tokenizer of one run (a :class:`~flowrl.runtime.step.DataService`)."""

    def __init__(self, plan: ExecutionPlan, tokenizer: Any, seed: int, contexts: dict[str, int] | None = None):
        """``contexts``: model id -> its rollout engine's context in tokens (prompts longer than
        :func:`prompt_limit` are bad rows); None: no length check."""
        from flowrl.data.sampler import BatchSampler

        from flowrl.data.chat import pad_id

        self.tokenizer = tokenizer
        self.pad_id = pad_id(tokenizer)  # EOS where the tokenizer has no pad token (GPT-2, Llama 3); masked
        limit = prompt_limit(plan, contexts) if contexts else None
        self.skipped: dict[str, list[str]] = {d.id: [] for d in plan.datasets}
        """Dataset id -> the messages of its bad rows left out (``bad_rows = "skip"``), file:row first."""
        # Prompts as the model reads them: chat messages rendered once with the tokenizer's template.
        self.datasets = {d.id: _rendered(read_dataset(d, _length_check(d, tokenizer, limit), self.skipped[d.id]),
                                         d, tokenizer)
                         for d in plan.datasets}
        self.samplers = {op.id: BatchSampler(len(self.datasets[op.inputs["dataset"]].rows), int(op.options["size"]),
                                             seed=op_seed(seed, 0, op.id))
                         for op in plan.ops if op.kind == OpKind.SAMPLE}

    def draw(self, op: OpPlan) -> list[dict]:
        return self.samplers[op.id].next_rows(self.datasets[op.inputs["dataset"]].rows)

    def tokenize(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        from flowrl.data.chat import encode

        if not special:  # appended to a conversation: no BOS in the middle of it
            return [list(self.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
        return [encode(self.tokenizer, t) for t in texts]  # no second BOS after a chat template's

    def columns(self, dataset: str) -> tuple[str, str]:
        ds = self.datasets[dataset]
        return ds.prompt, ds.answer

    def eval_rows(self, dataset: str) -> list[dict]:
        return self.datasets[dataset].eval_rows

    @property
    def rows_skipped(self) -> int:
        """Bad rows left out of every dataset (training and held-out splits): ``data/rows_skipped``."""
        return sum(len(v) for v in self.skipped.values())

    def state_dict(self) -> dict:
        """The samplers' cursors (part of a checkpoint)."""
        return {k: s.state_dict() for k, s in self.samplers.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, s in state.items():
            self.samplers[k].load_state_dict(s)


__all__ = ["Dataset", "DATASET_FORMATS", "reader_of", "read_dataset", "prompt_limit", "RunData", "jsonl", "parquet"]
