"""Check chat datasets reach a model that has a chat template.

Requires: check_roles (``Node.model`` is set on every ``generate``).

Guarantees: every dataset declared with ``chat = true`` whose prompts a ``generate`` samples
is read with the tokenizer of a model that has a chat template (:mod:`flowrl.data.chat`): a
``tiny`` model has none; a checkpoint (a local directory, or a hub id in the local Hugging
Face cache) has one in ``chat_template.jinja`` / ``chat_template.json`` or
``tokenizer_config.json``'s ``chat_template``. A checkpoint flowrl cannot read here (a preset
hub id not downloaded) is not checked (E610). Whether a dataset's rows hold messages or
strings is ``check_resources``'s (E602).

The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... dataset d = jsonl("chat.jsonl", chat = true)
... flow main() { r = generate(m, sample(d))  return r }''', "doc.flow")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:3:13: error[E610]: dataset `d` holds chat prompts (`chat = true`), but `m` (a tiny model) has no chat template to render them
"""

from __future__ import annotations

from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import checkpoint_dir
from flowrl.compiler.resources import prompt_datasets
from flowrl.data.chat import TEMPLATE_FILES, template_source
from flowrl.diagnostics import Collector
from flowrl.ir.graph import Const, FlowGraph, Node, Ref


def check_chat_templates(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    reported: set[tuple[str, str]] = set()
    for node in graph.nodes():
        if node.kind != OpKind.GENERATE or not node.model or node.model not in graph:
            continue
        for dataset in prompt_datasets(graph, node):
            chat = dataset.attr("chat")
            if not (isinstance(chat, Const) and chat.value is True) or (dataset.id, node.model) in reported:
                continue
            why = _no_template(graph, node.model)
            if why is not None:
                reported.add((dataset.id, node.model))
                errors.error("E610", f"dataset `{dataset.id}` holds chat prompts (`chat = true`), but `{node.model}` "
                                     f"({why}) has no chat template to render them", dataset.span,
                             "write `chat = false` and plain-text prompts, or generate with a checkpoint whose "
                             f"tokenizer has a chat template ({' / '.join(TEMPLATE_FILES)}, or "
                             "tokenizer_config.json's `chat_template`)")
    errors.raise_if_any()
    return graph


def _no_template(graph: FlowGraph, model: str, depth: int = 0) -> str | None:
    """Why ``model`` has no chat template (what it is), or None if it has one or it is not known."""
    node: Node = graph.node(model)
    spec = OPS.get(node.op)
    source = spec.facts_from if spec is not None and spec.kind == OpKind.MODEL else None
    if source == "base" and depth < 8 and node.args and isinstance(node.args[0], Ref) and node.args[0].target in graph:
        return _no_template(graph, node.args[0].target, depth + 1)
    if source == "options":
        return f"a {node.op} model"
    folder = checkpoint_dir(graph, model)
    if folder is None or template_source(folder) is not None:
        return None
    return f"{folder}"


__all__ = ["check_chat_templates"]
