"""Check datasets' templates, `datasets` directories, shards and mixtures, reading only their first rows.

Requires: check_edge_types (options of resources have their defaults; a ``mix``'s weights are a list
of numbers, one per dataset, E220).

Guarantees, for every dataset declaration the flow uses:

* ``template``: its slots are field names (``{question}``; ``{{``/``}}`` are braces), else E661 at
  the template; where the dataset's rows can be read here (a flow file on disk, see
  :func:`~flowrl.compiler.resources.checked`), every slot names a column of the file's schema
  (Parquet, Arrow) or a field of each of its first :data:`HEAD_ROWS` rows (JSON lines), else E662
  at the slot, naming the row and the fields it has;
* ``hf_dataset(path, split = ..., eval = ...)``: ``path`` is a ``save_to_disk`` folder, a folder of
  shards or a glob that matches (E601), holding the split and the held-out split asked for (E663,
  at the option, listing the splits there are), in a format flowrl reads (E602); its first row
  holds the prompt (or the template's slots) and the answer as the runtime reads them (E602);
* ``mix(a, b, weights = [...])``: every weight is >= 0 and one at least is > 0 (E660).

Nothing is run and no file is read whole: a JSON-lines file's first rows (at most 16 MiB), a
Parquet footer and first row group, an Arrow file memory-mapped. The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... dataset d = jsonl("d.jsonl", template = "Q: {question!r}")
... flow main() { r = generate(m, sample(d))  return r }''', "doc.flow")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:3:41: error[E661]: the template of dataset `d` cannot be filled: slot `{question!r}` is not a field name
"""

from __future__ import annotations

import os


from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.library_checks import check_library
from flowrl.compiler.resources import checked, folder_of, shown_folder, text_option
from flowrl.data.datasets import DatasetError
from flowrl.data.rows import RowFormat, TemplateError, template_slots
from flowrl.data.sources import SOURCES, MissingData, MissingSplit, RowSource
from flowrl.diagnostics import Collector, SourceMap, Span
from flowrl.ir.graph import Const, FlowGraph, Node, Ref, plain
from flowrl.plan import row_fields

HEAD_ROWS = 64
"""Rows of a JSON-lines dataset a template's slots are checked against (its first ones)."""


def check_datasets(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    for node in graph.nodes():
        if node.kind != OpKind.DATASET or node.op not in OPS:
            continue
        if any(isinstance(a, Ref) for a in node.args):
            _check_mix(node, errors)
            continue
        slots = _slots(node, errors)
        spec = OPS[node.op]
        if spec.library and (ctx.options.get("resources") is False or not check_library(node, spec, errors)):
            continue  # its rows cannot be made (E670-E672 said why) or are not to be checked
        opener = SOURCES.get(OPS[node.op].handler)
        if opener is None or not (checked(node, ctx) or spec.library) or not node.args \
                or not isinstance(node.args[0], Const):
            continue
        files = bool(OPS[node.op].paths)  # jsonl, parquet: check_resources checks the files themselves
        if files and not slots:
            continue  # nothing of theirs to check here
        for which in ("train", "eval"):
            source = _open(node, opener, which, files, errors)
            if source is not None:
                _check_rows(node, source, slots, files, ctx.sources, errors)
    errors.raise_if_any()
    return graph


def _check_mix(node: Node, errors: Collector) -> None:
    """E660: a weight below 0, or none above it."""
    values = node.attr("weights")
    if not isinstance(values, tuple):
        return  # unset: equal weights
    numbers = [(v, plain(v)) for v in values if isinstance(v, Const) and v.kind in ("int", "float")]
    for v, w in numbers:
        if w < 0:
            errors.error("E660", f"weight {w} of mixture `{node.id}` is negative", v.span,
                         "a weight is the share of rows drawn from its dataset: 0 or more")
    if numbers and len(numbers) == len(values) and all(w == 0 for _, w in numbers):
        errors.error("E660", f"every weight of mixture `{node.id}` is 0: it would draw no row",
                     node.key_span("weights") or node.span, "give one dataset at least a weight above 0")


def _slots(node: Node, errors: Collector) -> list[tuple[str, int]] | None:
    """The template's ``(field, offset)`` slots; None without a template or where it is malformed (E661)."""
    template = text_option(node, "template")
    if not template:
        return None
    try:
        return template_slots(template)
    except TemplateError as e:
        message, _, hint = str(e).partition("; hint: ")
        errors.error("E661", f"the template of dataset `{node.id}` cannot be filled: {message}",
                     node.attr("template").span, hint or None)
        return None


def _shown(node: Node, text: str) -> str:
    """``text`` with paths below the flow file's folder as the user named that folder (diagnostics quote
    paths so, and golden outputs stay the same on every machine: :func:`~flowrl.compiler.model_info.shown_path`)."""
    folder = folder_of(node)
    shown = os.path.dirname(node.span.path) if not node.span.path.startswith("<") else ""
    return text.replace(folder + os.sep, shown + os.sep if shown else "")


def _open(node: Node, opener, which: str, files: bool, errors: Collector) -> RowSource | None:
    """The dataset's ``which`` split, or None (no such split; or an error, reported here unless
    ``check_resources`` reports it)."""
    path = str(node.args[0].value)
    options = {k: plain(v) for k, v in node.attrs}
    try:
        return opener(path, options, which, folder_of(node))
    except DatasetError as e:
        if files:
            return None  # E601 / E602 from check_resources
        message, _, hint = _shown(node, str(e)).partition("; hint: ")
        option = "split" if which == "train" else "eval"
        if isinstance(e, MissingSplit):
            span = node.attr(option).span if node.attr(option) is not None else node.span
            errors.error("E663", f"hf_dataset `{node.id}`: {message}", span, hint or None)
        elif isinstance(e, MissingData):
            where = node.args[0].span if which == "train" else node.attr("eval").span
            errors.error("E601", f"dataset `{node.id}`: {message}", where,
                         f"relative paths are resolved against the folder of the flow file, {shown_folder(node)}")
        else:
            errors.error("E602", f"dataset `{node.id}` cannot be read as `{node.op}`: {message}",
                         node.args[0].span, hint or None)
    except OSError as e:
        errors.error("E602", f"dataset `{node.id}` cannot be read: {e}", node.args[0].span, None)
    return None


def _check_rows(node: Node, source: RowSource, slots, files: bool, sources: SourceMap,
                errors: Collector) -> None:
    """E662 for a slot no column (or one of the first rows) has; E602 for an ``hf_dataset`` whose first row
    the runtime would refuse."""
    try:
        columns = source.columns()
        # a file of columns (Parquet, Arrow) says what rows hold; JSON lines, its first rows
        head = source.head(HEAD_ROWS) if columns is None else source.head(1) if not files else []
    except DatasetError as e:
        if not files:
            errors.error("E602", f"dataset `{node.id}` cannot be read as `{node.op}`: {_shown(node, str(e))}",
                         node.args[0].span, None)
        return
    name = _shown(node, source.name)
    missing = False
    for field, _ in slots or ():
        if columns is not None:
            if field not in columns:
                missing = True
                errors.error("E662", f"the template of dataset `{node.id}` reads field `{field}`, which `{name}` "
                                     f"lacks (its columns: {', '.join(columns)})", _slot_span(node, field, sources),
                             "write a slot for one of its columns, or name the column as the data has it")
            continue
        for i, (_, row) in enumerate(head, start=1):
            if isinstance(row, dict) and field not in row:
                missing = True
                errors.error("E662", f"the template of dataset `{node.id}` reads field `{field}`, which row {i} of "
                                     f"`{name}` lacks (its fields: {', '.join(sorted(row))})",
                             _slot_span(node, field, sources),
                             f"every row needs the template's fields; the first {HEAD_ROWS} rows are checked")
                break
    if files or missing:
        return
    answer = text_option(node, "answer") or "answer"
    fmt = RowFormat(text_option(node, "prompt") or "prompt", row_fields(answer, text_option(node, "completion") or ""),
                    text_option(node, "template") or "", plain(node.attr("chat")) is True)
    skip = text_option(node, "bad_rows") == "skip"
    for where, row in head[:1] if not skip else head:
        try:
            if isinstance(row, DatasetError):
                raise row
            fmt.check(where, row)
            return
        except DatasetError as e:
            if not skip:
                message, _, hint = _shown(node, str(e)).partition("; hint: ")
                errors.error("E602", f"dataset `{node.id}` cannot be read as `{node.op}`: {message}",
                             node.args[0].span, hint or None)
                return


def _slot_span(node: Node, name: str, sources: SourceMap) -> Span:
    """Where the flow writes slot ``{name}`` of the template (the template's span where it cannot be found)."""
    span = node.attr("template").span
    line = sources.line(span.path, span.line) or ""
    end = span.end_column - 1 if span.end_line == span.line else len(line)
    at = line.find("{" + name + "}", span.column - 1, end)
    if at < 0:
        return span
    return Span.point(span.path, span.line, at + 1, len(name) + 2)


__all__ = ["check_datasets", "HEAD_ROWS"]
