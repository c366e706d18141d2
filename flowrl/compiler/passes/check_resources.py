"""Check the files and code a flow names exist and hold what the runtime will read, without running anything.

Requires: check_edge_types (options of resources have their defaults).

Guarantees, for every resource declared in a file on disk (see :mod:`flowrl.compiler.resources`;
paths are resolved against the folder of the flow file that declares them):

* datasets (:attr:`~flowrl.catalog.ops.OpSpec.paths`): each file, the ``eval`` split
  included, exists, and its head reads as the runtime will read it (its catalogue record's
  ``file_format``): a JSON-lines file's first row is an object with the ``prompt`` and
  ``answer`` fields and a string prompt; a Parquet file's footer lists those columns, the
  prompt's as strings, and at least one row (E601, E602);
* model checkpoints (``facts_from`` is ``FactsFrom.CHECKPOINT``): a local directory, or a hub id in
  the local Hugging Face cache (:mod:`flowrl.hub`), holding what the engines load, read as data by
  :func:`flowrl.model_files.checkpoint_problems` (the runtime checks the same before it starts an
  engine): a decoder ``config.json`` of an architecture of the catalogue (E603), safetensors weights
  whose headers are whole (every shard of an index; a PyTorch pickle is refused with the command that
  converts it) and a tokenizer (E620); else a preset hub id (E603; a hub id that is neither names the
  command that downloads it);
* row fields a reward reads (:attr:`~flowrl.catalog.ops.VerifierCost.row_fields`, e.g.
  ``verifier("code")``'s ``tests``): every dataset it scores (the prompts of its ``score``,
  followed back to their datasets; the ``eval`` split unless the dataset names another
  ``eval_reward``) has the field in its first rows (a JSON-lines file's first 64 rows, a
  Parquet file's columns); else E622 at the reward, naming the dataset, its file and the field;
* user code (:attr:`~flowrl.catalog.ops.OpSpec.python_ref`): ``"module:attribute"`` names a
  module found in the flow file's folder, then ``PYTHONPATH``, then installed packages
  (:mod:`flowrl.pyrefs`), whose source defines the attribute at top level (E604-E606). The
  module is read with :mod:`ast`, never imported.

The graph is returned unchanged. Every diagnostic points at the value as written and names
the folder relative paths were resolved against.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... dataset d = jsonl("no/such.jsonl")
... flow main() { b = sample(d)  r = generate(m, b)  return r }''', "/nowhere/doc.flow", options={"resources": True})
... except FlowError as e:
...     print(str(e).splitlines()[0])
/nowhere/doc.flow:3:19: error[E601]: dataset file not found: /nowhere/no/such.jsonl
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from flowrl.catalog.models import PRESETS, preset
from flowrl.catalog.ops import OPS, VERIFIER_COSTS, FactsFrom, OpKind, OpSpec
from flowrl.compiler.context import CompileContext
from flowrl.compiler.library_checks import check_library
from flowrl.compiler.model_info import shown_path
from flowrl.compiler.resources import (DatasetFile, checked, dataset_files, folder_of, prompt_datasets, read_head,
                                       shown_folder, text_option)
from flowrl.diagnostics import Collector
from flowrl.hub import cached_snapshot, download_hint, is_hub_id
from flowrl.ir.graph import Const, FlowGraph, Node, Ref
from flowrl.model_files import FileProblem, checkpoint_problems
from flowrl.pyrefs import RefError, defined_names, find_module, looked_in, split_ref


def check_resources(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    seen_refs: set[tuple[str, str]] = set()
    for node in graph.nodes():
        spec = OPS.get(node.op)
        if spec is None or not (checked(node, ctx) or (spec.library and node.kind != OpKind.DATASET)):
            continue
        if spec.file_format:
            _check_dataset(node, spec, errors)
        if spec.facts_from == FactsFrom.CHECKPOINT:
            _check_checkpoint(node, errors)
        if spec.library and node.kind != OpKind.DATASET and ctx.options.get("resources") is not False:
            check_library(node, spec, errors)  # a library's datasets: check_datasets checks them
        if spec.python_ref and node.args and isinstance(node.args[0], Const):
            key = (str(node.args[0].value), folder_of(node))
            if key not in seen_refs:  # one report per reference, however many calls name it
                seen_refs.add(key)
                _check_ref(node, spec, errors)
    _check_row_fields(graph, ctx, errors)
    errors.raise_if_any()
    return graph


ROW_FIELD_ROWS = 64
"""How many of a JSON-lines dataset's first rows E622 reads."""


def _check_row_fields(graph: FlowGraph, ctx: CompileContext, errors: Collector) -> None:
    """E622: a reward reads a row field (``verifier("code")``: ``tests``) the dataset it scores lacks."""
    wanted: dict[tuple[str, str], tuple[Node, Node, tuple[str, ...]]] = {}
    for node in graph.nodes():
        if node.kind == OpKind.SCORE:  # what it scores: its other arguments, back to their prompts' datasets
            datasets = [ds for a in node.args if isinstance(a, Ref) and a.target in graph
                        and graph.node(a.target).kind != OpKind.REWARD_FN
                        for ds in prompt_datasets(graph, graph.node(a.target))]
            for reward in _rewards(graph, node):
                fields = _row_fields(reward)
                for ds in datasets if fields else ():
                    wanted.setdefault((reward.id, ds.id), (reward, ds, fields))
    for reward, ds, fields in wanted.values():
        if checked(ds, ctx):
            eval_by_other = text_option(ds, "eval_reward") is not None
            for f in dataset_files(ds, OPS[ds.op]):
                if not (f.option == "eval" and eval_by_other):
                    _missing_fields(reward, reward.span, ds, f, fields, errors)
    for ds in graph.nodes():  # an eval split scored by a named verifier (`eval_reward = "code"`)
        name = text_option(ds, "eval_reward") if ds.kind == OpKind.DATASET else None
        if name in VERIFIER_COSTS and VERIFIER_COSTS[name].row_fields and checked(ds, ctx):
            for f in dataset_files(ds, OPS[ds.op]):
                if f.option == "eval":
                    _missing_fields(None, ds.attr("eval_reward").span, ds, f, VERIFIER_COSTS[name].row_fields,
                                    errors, f"`eval_reward = \"{name}\"`")


def _rewards(graph: FlowGraph, node: Node) -> list[Node]:
    """The reward functions ``node`` reads, and those they combine (``weighted_sum``), transitively."""
    out, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        for a in n.args:
            if isinstance(a, Ref) and a.target in graph and a.target not in seen:
                seen.add(a.target)
                target = graph.node(a.target)
                if target.kind == OpKind.REWARD_FN:
                    out.append(target)
                    todo.append(target)
    return out


def _row_fields(reward: Node) -> tuple[str, ...]:
    """The row fields a reward reads, from its catalogue record (a built-in verifier's ``row_fields``)."""
    spec = OPS.get(reward.op)
    if spec is not None and spec.row_fields:
        return spec.row_fields
    if spec is None or not spec.costs_by_name or not reward.args or not isinstance(reward.args[0], Const):
        return ()
    cost = spec.costs_by_name.get(reward.args[0].value)
    return cost.row_fields if cost is not None else ()


def _missing_fields(reward: Node | None, span, ds: Node, f: DatasetFile, fields: tuple[str, ...],
                    errors: Collector, what: str | None = None) -> None:
    from flowrl.data.datasets import head_rows
    from flowrl.data.parquet_footer import ParquetFooterError, read_footer

    if not f.path.is_file():
        return  # E601 says so
    what = what or (f"`{reward.op}(\"{reward.args[0].value}\")`" if reward.args else f"`{reward.op}()`")
    split = "eval split" if f.option == "eval" else "file"
    for field in fields:
        if OPS[ds.op].file_format == ".parquet":
            try:
                columns = read_footer(f.path).columns
            except (ParquetFooterError, OSError):
                return  # E602 says so
            if field in columns:
                continue
            found = f"it has no column `{field}` (its columns: {', '.join(sorted(columns))})"
        else:
            prompt = text_option(ds, "prompt") or "prompt"
            rows = head_rows(f.path, prompt_field=prompt, fields=(field,), format=OPS[ds.op].file_format,
                             rows=ROW_FIELD_ROWS, template=text_option(ds, "template") or "")
            lacking = [i for i, (_, values) in enumerate(rows, start=1) if values[0] is None]
            if not lacking:
                continue
            found = (f"{len(lacking)} of its first {len(rows)} rows have no `{field}` field (the first: row "
                     f"{lacking[0]})")
        errors.error("E622", f"{what} reads each row's `{field}` field, but dataset `{ds.id}` ({split} "
                             f"`{f.written}`) lacks it: {found}; every sample would score as an error", span,
                     f"add `{field}` to every row of `{f.written}` (docs/rewards.md shows its forms), "
                     "or score this dataset with another reward")


def _check_dataset(node: Node, spec: OpSpec, errors: Collector) -> None:
    from flowrl.data.datasets import DatasetError

    folder = shown_folder(node)
    for f in dataset_files(node, spec):
        what = "eval split" if f.option == "eval" else "dataset file"
        if not f.path.exists():
            near = _near_files(f.path, f.written)
            errors.error("E601", f"{what} not found: {f.path}", f.span,
                         (f"did you mean {near}? " if near else "")
                         + f"relative paths are resolved against the folder of the flow file, {folder}")
            continue
        try:
            read_head(f, node)
        except DatasetError as e:
            message, _, hint = str(e).partition("; hint: ")
            line, message = _where(message, str(f.path))
            errors.error("E602", f"{what} `{f.written}`{line} cannot be read as `{node.op}`: {message}", f.span,
                         hint or f"the runtime reads it as a {spec.file_format} file")


def _where(message: str, path: str) -> tuple[str, str]:
    """A DatasetError message ``PATH[:LINE]: TEXT`` -> (``", line LINE"`` or ``""``, ``TEXT``)."""
    if not message.startswith(path + ":"):
        return "", message
    rest = message[len(path) + 1:]
    lineno, sep, text = rest.partition(": ")
    if sep and lineno.isdigit():
        return f", line {lineno},", text
    return "", rest.lstrip()


def _near_files(path: Path, written: str) -> str:
    """Files next to a missing one whose names are close, written as the flow would write them."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.is_file()] if path.parent.is_dir() else []
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=2, cutoff=0.6)
    head = written[: len(written) - len(os.path.basename(written))]
    return " or ".join(f"`{head}{n}`" for n in close)


def _check_checkpoint(node: Node, errors: Collector) -> None:
    if not node.args or not isinstance(node.args[0], Const):
        return
    written = str(node.args[0].value)
    local = Path(shown_path(node, written))
    span = node.args[0].span
    if (local / "config.json").is_file():
        for problem in checkpoint_problems(local):
            _report_files(problem, f"hf(\"{written}\")" + (f" ({local})" if problem.what != "config" else ""),
                          span, errors)
        return
    cached = cached_snapshot(written)
    if cached is not None:
        again = download_hint(written, folder=False).replace("put it", "put it again", 1)
        for problem in checkpoint_problems(cached):
            fix = f"the cached download is damaged or partial: {again}" if problem.partial else problem.fix
            _report_files(FileProblem(problem.what, problem.reason, fix),
                          f"hf(\"{written}\"), from the local Hugging Face cache" + (
                              f" ({cached})" if problem.what != "config" else ""), span, errors)
        return
    if preset(written) is not None:
        return  # a public config flowrl knows: plans are made without the checkpoint (`run` needs it cached)
    where = "is not a directory" if not local.is_dir() else "has no config.json"
    hub = is_hub_id(written) and not local.is_dir()
    close = difflib.get_close_matches(written.lower(), list(PRESETS), n=1, cutoff=0.7)
    errors.error("E603", f"hf(\"{written}\"): {local} {where}, and `{written}` is not "
                         + ("in the local Hugging Face cache nor " if hub else "") + "a model flowrl knows", span,
                 (f"did you mean `{PRESETS[close[0]].name}` (a config flowrl knows)? " if close else "")
                 + f"relative paths are resolved against the folder of the flow file, {shown_folder(node)}; "
                   "flowrl never downloads models: save one there with `save_pretrained(dir)`"
                 + (f", or, `{written}` being a hub id, {download_hint(written, folder=False)}" if hub else ""))


def _report_files(problem: FileProblem, what: str, span, errors: Collector) -> None:
    """A checkpoint's config problem is E603 (not a model flowrl knows); missing or damaged weights or
    tokenizer, E620 (the engines would fail to load it)."""
    code = "E603" if problem.what == "config" else "E620"
    errors.error(code, f"{what}: {problem.reason}", span, problem.fix)


def _check_ref(node: Node, spec: OpSpec, errors: Collector) -> None:
    ref = str(node.args[0].value)
    span = node.args[0].span
    try:
        module, attr = split_ref(ref)
    except RefError as e:
        errors.error("E604", f"`{node.op}` needs \"module:{spec.python_ref}\": {e}", span,
                     f"write \"my_module:{'MyEnv' if spec.python_ref == 'class' else 'my_function'}\" "
                     "for a module next to the flow file or on PYTHONPATH")
        return
    folder = folder_of(node)
    found = find_module(module, folder)
    if found is None:
        near = _near_modules(module, folder)
        errors.error("E605", f"cannot find module `{module}` (for `{ref}`)", span,
                     f"looked in {looked_in(shown_folder(node))}" + (f"; did you mean `{near}`?" if near else ""))
        return
    if found.source is None:
        return  # compiled or built in: nothing to read, the import at run time tells
    source = _shown_source(found.source, folder, shown_folder(node))
    try:
        names, open_ended = defined_names(found.source)
    except SyntaxError as e:
        errors.error("E605", f"module `{module}` ({source}) does not parse: {e.msg} at line {e.lineno}",
                     span, "fix the module: it would fail when the run imports it")
        return
    except (OSError, UnicodeDecodeError) as e:
        errors.error("E605", f"cannot read module `{module}` ({source}): {e}", span,
                     "check the file's permissions and encoding (UTF-8)")
        return
    top = attr.split(".")[0]
    if top in names or open_ended:
        return
    close = difflib.get_close_matches(top, sorted(names), n=3, cutoff=0.6)
    public = sorted(n for n in names if not n.startswith("_"))
    errors.error("E606", f"module `{module}` ({source}) defines no `{top}`", span,
                 (f"did you mean {', '.join(f'`{c}`' for c in close)}?" if close else
                  f"it defines {', '.join(f'`{n}`' for n in public[:12])}" + (" ..." if len(public) > 12 else "")
                  if public else f"define `{top}` there ({spec.python_ref})"))


def _shown_source(source: Path, folder: str, shown: str) -> str:
    """A module's file as diagnostics quote it: below the flow file's folder as that folder is quoted."""
    try:
        return os.path.normpath(os.path.join(shown, source.relative_to(folder)))
    except ValueError:
        return str(source)  # found on PYTHONPATH or installed: its own path


def _near_modules(module: str, folder: str) -> str | None:
    """A module name next to the flow file close to the one asked for."""
    head = module.split(".")[0]
    try:
        names = [p.stem if p.suffix == ".py" else p.name for p in Path(folder).iterdir()
                 if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file())]
    except OSError:
        return None
    close = difflib.get_close_matches(head, names, n=1, cutoff=0.6)
    return close[0] + module[len(head):] if close else None


__all__ = ["check_resources"]
