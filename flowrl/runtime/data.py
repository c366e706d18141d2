"""A run's data: datasets read through :data:`DATASET_FORMATS`, one sampler per ``sample`` op, the tokenizer.

A plan's :class:`~flowrl.plan.DatasetPlan` names its format (``jsonl``, ``parquet``,
``hf_dataset``, ``mix``: the op that declared it); the catalogue record of that op names the
reader here (``OpSpec.handler``), and a format without a reader is an error. A file dataset's
rows come from its row source (:data:`flowrl.data.sources.SOURCES`, the same handler name), are
checked and written by its row format (:mod:`flowrl.data.rows`), and are read whole, or
streamed (``stream``) by the sampler as the run goes. :class:`RunData` is the
:class:`~flowrl.runtime.step.DataService` handlers draw prompts from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from flowrl.catalog.ops import OPS, OpKind
from flowrl.data.datasets import BAD_ROWS_HINT, DatasetError
from flowrl.data.rows import RowFormat, render_prompt
from flowrl.data.sources import SOURCES, RowSource
from flowrl.plan import DatasetPlan, ExecutionPlan, OpPlan
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.kinds import builder_for
from flowrl.runtime.step import op_seed


@dataclass(frozen=True)
class Dataset:
    """One dataset: its training rows (or, streamed, the source they are read from as the run goes), its
    held-out rows and its column names."""

    rows: list
    prompt: str
    answer: str
    eval_rows: list
    source: Any = None
    """A streamed training split's :class:`~flowrl.data.sources.RowSource` (``rows`` is then empty)."""


RowCheck = Callable[[dict], "str | None"]
"""A row -> what is wrong with it (a bad row, see ``DatasetPlan.bad_rows``), or None."""

STREAM_BYTES = 256 << 20
"""``stream = "auto"`` streams a training split whose files pass this many bytes."""


def row_format(d: DatasetPlan) -> RowFormat:
    """The fields ``d``'s rows must hold and how their prompt is written (:mod:`flowrl.data.rows`)."""
    return RowFormat(d.prompt, d.row_fields, d.template, d.chat)


def open_split(d: DatasetPlan, which: str) -> RowSource | None:
    """``d``'s ``which`` (``"train"``, ``"eval"``) split as a row source (its op's opener in
    :data:`~flowrl.data.sources.SOURCES`); None where it has no such split."""
    from flowrl.pyrefs import folder_of

    opener = SOURCES.get(OPS[d.format].handler) if d.format in OPS else None
    if opener is None:
        raise RuntimeFlowError(f"{d.origin}: dataset `{d.id}` ({d.format}) has no row source")
    options = {**d.options, **({"eval": d.eval_path} if d.eval_path else {})}
    return opener(d.path, options, which, folder_of(d.origin) or os.getcwd())


def _preparer(d: DatasetPlan, tokenizer: Any, check: RowCheck | None, skipped: list | None,
              render: bool) -> Callable[[str, Any], dict | None]:
    """``(where, raw row) -> training row``, None for a bad row skipped (its message appended to
    ``skipped``); raises :class:`DatasetError` for a bad row under ``bad_rows = "error"``. ``render``: the
    prompt is written as the model reads it (template filled, system prompt and chat template applied)."""
    fmt = row_format(d)

    def prepare(where: str, raw: Any) -> dict | None:
        try:
            if isinstance(raw, DatasetError):
                raise raw
            row = fmt.check(where, raw)
            if render:
                row = {**row, d.prompt: _render(d, tokenizer, row[d.prompt])}
            problem = check(row) if check is not None else None
            if problem:
                raise DatasetError(f"{where}: {problem}")
        except DatasetError as bad:
            if d.bad_rows != "skip":
                raise DatasetError(f"{bad}; {BAD_ROWS_HINT}") from None
            if skipped is not None:
                skipped.append(str(bad))
            return None
        return row
    return prepare


def _render(d: DatasetPlan, tokenizer: Any, prompt: Any) -> str:
    from flowrl.data.chat import ChatError

    try:
        return render_prompt(tokenizer, prompt, chat=d.chat, chat_auto=d.chat_auto, system=d.system)
    except ChatError as e:
        raise RuntimeFlowError(f"{d.origin}: dataset `{d.id}` (chat = true): {e}") from None


def _whole(source: RowSource, prepare: Callable[[str, Any], dict | None], bad_rows: str, skipped: list) -> list:
    """Every row of ``source`` through ``prepare``; a source without one good row is refused."""
    before = len(skipped)
    rows = [row for where, raw in source.rows() if (row := prepare(where, raw)) is not None]
    if not rows:
        what = "every row is bad (skipped)" if bad_rows == "skip" and len(skipped) > before else "dataset is empty"
        raise DatasetError(f"{source.name}: {what}; hint: a training run needs at least one row")
    return rows


def streamed(d: DatasetPlan, source: RowSource) -> bool:
    """Whether ``d``'s training split is read as the run goes (``stream``), not whole before it starts."""
    mode = str(d.options.get("stream", "auto"))
    return mode == "on" or (mode == "auto" and source.nbytes() > STREAM_BYTES)


def read_dataset(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None, *,
                 tokenizer: Any = None) -> Dataset:
    """``d``'s rows through its op's row source: the training split whole (or, streamed, its source), the
    held-out split whole; bad rows (``check``'s too) go by ``d.bad_rows``, the skipped ones' messages into
    ``skipped``. With a ``tokenizer`` prompts are written as the model reads them (:func:`_render`)."""
    skipped = skipped if skipped is not None else []
    # A template is filled by the row format; the system prompt and chat template need the tokenizer.
    render = tokenizer is not None and bool(d.chat or d.chat_auto or d.system)
    prepare = _preparer(d, tokenizer, check, skipped, render)
    train = open_split(d, "train")
    ev = open_split(d, "eval")
    eval_rows = _whole(ev, prepare, d.bad_rows, skipped) if ev is not None else []
    if streamed(d, train):
        return Dataset([], d.prompt, d.answer, eval_rows, source=train)
    return Dataset(_whole(train, prepare, d.bad_rows, skipped), d.prompt, d.answer, eval_rows)


def jsonl(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None, **kw) -> Dataset:
    """``jsonl(path, eval = ...)``: one JSON object per line."""
    return read_dataset(d, check, skipped, **kw)


def parquet(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None, **kw) -> Dataset:
    """``parquet(path, eval = ...)``: a Parquet table with the named columns."""
    return read_dataset(d, check, skipped, **kw)


def hf_dataset(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None, **kw) -> Dataset:
    """``hf_dataset(path, split = ..., eval = ...)``: a `datasets` save_to_disk folder, or shards."""
    return read_dataset(d, check, skipped, **kw)


def reasoning_gym(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None, **kw) -> Dataset:
    """``reasoning_gym(task, size = ..., seed = ..., eval_size = ...)``: rows generated by the task
    (:mod:`flowrl.data.reasoning_gym`), the held-out split disjoint from the training one."""
    return read_dataset(d, check, skipped, **kw)


def mix(d: DatasetPlan, check: RowCheck | None = None, skipped: list | None = None, **kw) -> Dataset:
    """``mix(a, b, weights = ...)``: no rows of its own; :class:`RunData` draws from its parts."""
    return Dataset([], MIX_COLUMNS[0], MIX_COLUMNS[1], [])


MIX_COLUMNS = ("prompt", "answer")
"""The fields a mixture's rows carry each part's prompt and answer in (the parts name theirs)."""

DATASET_FORMATS: dict[str, Callable[..., Dataset]] = {f.__name__: f for f in (jsonl, parquet, hf_dataset, mix,
                                                                      reasoning_gym)}
"""``OpSpec.handler`` of a dataset op -> its reader ``(plan, check=None, skipped=None, tokenizer=None) -> Dataset``
(``check`` and ``skipped``: see :func:`read_dataset`)."""


def reader_of(d: DatasetPlan) -> Callable[[DatasetPlan], Dataset]:
    """The reader of ``d``'s format (its op's ``OpSpec.handler``); an unknown format is an error."""
    return builder_for(d.format, OpKind.DATASET, DATASET_FORMATS, d.origin, noun="a dataset format",
                       listing="formats", things="datasets")


def prompt_limit(plan: ExecutionPlan, contexts: dict[str, int]) -> int | None:
    """The most prompt tokens every ``generate`` can take: its rollout engine's context
    (``contexts``: model id -> tokens) less its ``max_tokens``; None when nothing generates.
    A longer prompt would stop the run at its first draw (the engines' ``check_lengths``)."""
    limits = [contexts[op.model] - int(op.options.get("max_tokens", 0))
              for op in plan.ops if op.kind == OpKind.GENERATE and op.model in contexts]
    return min(limits) if limits else None


def _length_check(d: DatasetPlan, tokenizer: Any, limit: int | None) -> RowCheck | None:
    """A row check refusing prompts (as the model reads them) longer than ``limit`` tokens. The prompt
    it gets is rendered already where the dataset has a template, a system prompt or chat."""
    if limit is None or tokenizer is None:
        return None
    from flowrl.data.chat import encode

    def check(row: dict) -> str | None:
        text = row[d.prompt]
        if not isinstance(text, str):
            return None  # chat messages not rendered (no tokenizer): the rendering reports them
        n = len(encode(tokenizer, text))
        if n > limit:
            return (f"the prompt has {n} tokens, more than the {limit} the rollout engine's context leaves after "
                    "max_tokens; hint: shorten it, lower max_tokens or use a model with a longer context")
        return None
    return check


class RunData:
    """Datasets, samplers and the tokenizer of one run (a :class:`~flowrl.runtime.step.DataService`).

    Each ``sample`` op has its own sampler (:mod:`flowrl.data.sampler`): over the rows of a split
    read whole, over a streamed split's source, or, for a mixture, over its parts' samplers (each
    part's rows carrying its prompt and answer as :data:`MIX_COLUMNS`)."""

    def __init__(self, plan: ExecutionPlan, tokenizer: Any, seed: int, contexts: dict[str, int] | None = None):
        """``contexts``: model id -> its rollout engine's context in tokens (prompts longer than
        :func:`prompt_limit` are bad rows); None: no length check."""
        from flowrl.data.chat import pad_id

        self.tokenizer = tokenizer
        self.pad_id = pad_id(tokenizer)  # EOS where the tokenizer has no pad token (GPT-2, Llama 3); masked
        self.limit = prompt_limit(plan, contexts) if contexts else None
        self.plans = {d.id: d for d in plan.datasets}
        self.skipped: dict[str, list[str]] = {d.id: [] for d in plan.datasets}
        """Dataset id -> the messages of its bad rows left out (``bad_rows = "skip"``), file:row first."""
        # Prompts as the model reads them: templates filled, chat messages rendered with the tokenizer's template.
        self.datasets = {d.id: reader_of(d)(d, self._check(d), self.skipped[d.id], tokenizer=tokenizer)
                         for d in plan.datasets}
        self.samplers = {op.id: self._sampler(op.inputs["dataset"], int(op.options["size"]), op_seed(seed, 0, op.id))
                         for op in plan.ops if op.kind == OpKind.SAMPLE}

    def _check(self, d: DatasetPlan) -> RowCheck | None:
        return _length_check(d, self.tokenizer, self.limit)

    def _sampler(self, dataset: str, size: int, seed: int, depth: int = 0):
        from flowrl.data.sampler import MixSampler, RowsSampler, StreamSampler

        d, ds = self.plans[dataset], self.datasets[dataset]
        if d.parts:
            if depth > 16:
                raise RuntimeFlowError(f"{d.origin}: mixture `{d.id}` nests mixtures more than 16 deep")
            weights = d.weights or tuple(1.0 for _ in d.parts)
            return MixSampler([_Columns(self._sampler(p, size, op_seed(seed, 0, p), depth + 1), self.plans[p])
                               for p in d.parts], weights, seed=seed)
        if ds.source is not None:
            prepare = _preparer(d, self.tokenizer, self._check(d), self.skipped[d.id],
                                bool(d.chat or d.chat_auto or d.system))
            return StreamSampler(ds.source, prepare, seed=seed, window=int(d.options.get("window", 64)))
        return RowsSampler(ds.rows, size, seed=seed)

    def draw(self, op: OpPlan) -> list[dict]:
        try:
            return self.samplers[op.id].take(int(op.options["size"]))
        except (DatasetError, ValueError) as e:  # a streamed split's bad row (bad_rows = "error"), or no good row
            d = self.plans[op.inputs["dataset"]]
            raise RuntimeFlowError(f"{d.origin}: dataset `{d.id}`: {e}") from None

    def tokenize(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        from flowrl.data.chat import encode

        if not special:  # appended to a conversation: no BOS in the middle of it
            return [list(self.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
        return [encode(self.tokenizer, t) for t in texts]  # no second BOS after a chat template's

    def columns(self, dataset: str) -> tuple[str, str]:
        ds = self.datasets[dataset]
        return ds.prompt, ds.answer

    def eval_rows(self, dataset: str) -> list[dict]:
        """The held-out rows; a mixture's: each part's, in order, carrying :data:`MIX_COLUMNS`."""
        d = self.plans[dataset]
        if d.parts:
            return [_Columns.rename(r, self.plans[p]) for p in d.parts for r in self.eval_rows(p)]
        return self.datasets[dataset].eval_rows

    @property
    def rows_skipped(self) -> int:
        """Bad rows left out of every dataset (training and held-out splits): ``data/rows_skipped``."""
        return sum(len(v) for v in self.skipped.values())

    def state_dict(self) -> dict:
        """The samplers' states (part of a checkpoint)."""
        return {k: s.state_dict() for k, s in self.samplers.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, s in state.items():
            self.samplers[k].load_state_dict(s)


class _Columns:
    """A mixture's part: its rows carry its prompt and answer as :data:`MIX_COLUMNS` too."""

    def __init__(self, sampler: Any, d: DatasetPlan) -> None:
        self.sampler, self.d = sampler, d

    @staticmethod
    def rename(row: dict, d: DatasetPlan) -> dict:
        if d.parts:
            return row  # a nested mixture's rows carry them already
        return {**row, MIX_COLUMNS[0]: row[d.prompt], MIX_COLUMNS[1]: row[d.answer]}

    def take(self, n: int) -> list[dict]:
        return [self.rename(r, self.d) for r in self.sampler.take(n)]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


__all__ = ["Dataset", "DATASET_FORMATS", "MIX_COLUMNS", "STREAM_BYTES", "reader_of", "read_dataset", "open_split",
           "row_format", "streamed", "prompt_limit", "RunData", "jsonl", "parquet", "hf_dataset", "mix"]
