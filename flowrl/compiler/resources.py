"""What the resource checks read of a flow's files, shared by ``check_resources`` and ``check_model_fit``.

A flow's resources are checked against the folder of the file that declares them (as
lowering resolves their paths), so only where that file is real, on disk: a ``.flow`` file
(``flowrl check``/``plan``/``run``, ``compile_file``), or the Python file that builds a flow
with :mod:`flowrl.builder` (its spans point there). Text compiled from memory with a made-up
path (``compile_text(text, "doc.flow")``) has no such folder; ``options={"resources": True}``
checks it anyway and ``{"resources": False}`` turns the checks off.

Each dataset file is read once per version (path, size, modification time): a check
compiles every flow of a file, and large programs name one dataset many times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from flowrl.catalog.ops import OPS, OpKind, OpSpec
from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import shown_path
from flowrl.diagnostics import Span
from flowrl.ir.graph import Const, FlowGraph, Node, Ref
from flowrl.plan import row_fields


def checked(node: Node, ctx: CompileContext) -> bool:
    """Whether ``node``'s resources are checked (see the module docstring)."""
    wanted = ctx.options.get("resources")
    if wanted is not None:
        return bool(wanted)
    return not node.span.path.startswith("<") and os.path.isfile(node.span.path)


def folder_of(node: Node) -> str:
    """The folder ``node``'s relative paths are resolved against: its flow file's (absolute)."""
    return os.path.dirname(os.path.abspath(node.span.path)) if not node.span.path.startswith("<") else os.getcwd()


def shown_folder(node: Node) -> str:
    """:func:`folder_of` as diagnostics quote it (relative when the flow file was named relatively)."""
    if node.span.path.startswith("<"):
        return os.getcwd()
    return os.path.dirname(node.span.path) or os.getcwd()


@dataclass(frozen=True)
class DatasetFile:
    """One file a dataset declaration names."""

    option: str
    """Which argument or option names it (``path``, ``eval``)."""
    written: str
    """The path as the flow wrote it."""
    path: Path
    """Resolved against the declaring file's folder (relative to the current directory when the
    flow file was named so: :func:`~flowrl.compiler.model_info.shown_path`)."""
    span: Span
    """Where the flow wrote it."""


def dataset_files(node: Node, spec: OpSpec) -> list[DatasetFile]:
    """The files of a dataset declaration (its :attr:`~flowrl.catalog.ops.OpSpec.paths` written as constants)."""
    out = []
    names = [a.name for a in spec.args]
    for option in spec.paths:
        value = node.args[names.index(option)] if option in names and names.index(option) < len(node.args) \
            else node.attr(option)
        if isinstance(value, Const) and isinstance(value.value, str) and value.value:
            out.append(DatasetFile(option, value.value, Path(shown_path(node, value.value)), value.span))
    return out


def text_option(node: Node, key: str) -> str | None:
    value = node.attr(key)
    return value.value if isinstance(value, Const) and isinstance(value.value, str) else None


def read_head(file: DatasetFile, node: Node) -> str | None:
    """The first prompt of a dataset file (None for Parquet, whose values are not decoded; a chat
    prompt's messages as text);
    :class:`~flowrl.data.datasets.DatasetError` if the runtime would refuse the file."""
    spec = OPS[node.op]
    prompt, answer = text_option(node, "prompt") or "prompt", text_option(node, "answer") or "answer"
    fields = row_fields(answer, text_option(node, "completion") or "")
    chat = node.attr("chat")
    chat = isinstance(chat, Const) and chat.value is True
    bad_rows = text_option(node, "bad_rows") or "error"
    return _head(str(file.path), file_version(file), spec.file_format, prompt, fields, shown_folder(node), chat,
                 bad_rows, text_option(node, "template") or "")


def file_version(file: DatasetFile) -> tuple[int, int] | None:
    """``(size, modification time)`` of a dataset file, the key its cached reads are kept under; None if absent."""
    try:
        stat = file.path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=256)
def _head(path: str, version, file_format: str | None, prompt: str, fields: tuple[str, ...], folder: str,
          chat: bool = False, bad_rows: str = "error", template: str = "") -> str | None:
    from flowrl.data.datasets import check_head

    return check_head(path, prompt_field=prompt, answer_fields=fields, format=file_format, relative_to=folder,
                      chat=chat, bad_rows=bad_rows, template=template)


def first_prompts(node: Node) -> list[tuple[DatasetFile, str]]:
    """``(file, its first prompt)`` for each file of a dataset node whose first prompt can be read."""
    spec = OPS.get(node.op)
    if spec is None or not spec.file_format:
        return []
    out = []
    for f in dataset_files(node, spec):
        try:
            text = read_head(f, node)
        except Exception:  # noqa: BLE001 - check_resources reports unreadable files
            continue
        if text is not None:
            out.append((f, text))
    return out


def prompt_datasets(graph: FlowGraph, node: Node) -> list[Node]:
    """The dataset nodes a generate's prompts are sampled from (following pass-through arguments; a
    mixture's parts in its place)."""
    out: list[Node] = []
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        spec = OPS.get(n.op)
        if spec is None or n.id in seen:
            continue
        seen.add(n.id)
        refs = [a for a in n.args if isinstance(a, Ref) and a.target in graph]
        if n.kind == OpKind.SAMPLE or (n.kind == OpKind.DATASET and refs):  # a mixture: its parts
            found = [graph.node(r.target) for r in refs if graph.node(r.target).kind == OpKind.DATASET]
            out += [d for d in found if not any(isinstance(a, Ref) for a in d.args)]
            todo += [d for d in found if any(isinstance(a, Ref) for a in d.args)]
        elif spec.passthrough is not None and spec.passthrough < len(n.args):
            arg = n.args[spec.passthrough]
            if isinstance(arg, Ref) and arg.target in graph:
                todo.append(graph.node(arg.target))
    return out


__all__ = ["checked", "folder_of", "shown_folder", "DatasetFile", "dataset_files", "read_head", "file_version", "first_prompts", "text_option", "prompt_datasets"]
