"""Check that every model that reads another model's token ids tokenizes as that model does.

Requires: check_roles (``Node.model`` is set on the ops a model's engine runs), check_resources
(the checkpoints it reads exist).

Guarantees: a model whose engine reads token rows another model generated (a reference's
``logprobs(ref, x)``, a critic's ``values(critic, x)``, an ``update``) has the generating
model's tokenizer, compared as data (:func:`~flowrl.compiler.model_info.tokenizer_of`: a tiny
model's task characters, a checkpoint's ``tokenizer.json`` model, added tokens, normalizer and
pre-tokenizer) wherever both are known without running (E630, at the model argument): with
another tokenizer the same ids are other words, and its log-probs or values are garbage with
nothing failing. Models that read text are not refused: ``reward_model(m)`` with a tokenizer of
its own re-tokenizes the decoded text at run time (:mod:`flowrl.runtime.reward_model`), and
``llm_judge(m)`` always reads its filled template.

The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model policy = tiny(task = "arith")
... model other = tiny(task = "longtail")
... model ref = frozen(other)
... flow main(d: dataset, r: reward) {
...   x = generate(policy, sample(d), n = 2)
...   ref_lp = logprobs(ref, x)
...   update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x), ref_lp, kl = 0.1)
... }''', "doc.flow", until="check_tokenizers")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:7:21: error[E630]: `ref` reads the token ids `policy` generated, but tokenizes differently: `ref` has the character tokenizer of task `longtail`, `policy` the character tokenizer of task `arith`
"""

from __future__ import annotations

from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import source_node, tokenizer_of
from flowrl.diagnostics import Collector
from flowrl.ir.graph import FlowGraph, Node, Ref

TOKEN_FIELD = "response_ids"
"""The field an argument needs when it reads a generation's token rows (``_TOKENS`` of the catalogue)."""


def check_tokenizers(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    known: dict[str, object] = {}
    reported: set[tuple[str, str]] = set()

    def tokenizer(model: str):
        if model not in known:
            known[model] = tokenizer_of(graph, model)
        return known[model]

    for node in graph.nodes():
        spec = OPS.get(node.op)
        if spec is None or not node.model or node.kind == OpKind.GENERATE or node.model not in graph:
            continue
        for arg, aspec in zip(node.args, spec.args):
            if TOKEN_FIELD not in aspec.needs or not isinstance(arg, Ref):
                continue
            for gen in _generators(graph, arg.target):
                reader, writer = node.model, gen.model
                if not writer or writer == reader or (reader, writer) in reported or _same_source(graph, reader, writer):
                    continue
                mine, theirs = tokenizer(reader), tokenizer(writer)
                if mine is None or theirs is None or mine.key == theirs.key:
                    continue
                reported.add((reader, writer))
                span = node.args[0].span if node.args and isinstance(node.args[0], Ref) else node.span
                errors.error("E630", f"`{reader}` reads the token ids `{writer}` generated, but tokenizes "
                                     f"differently: `{reader}` has {mine.words}, `{writer}` {theirs.words}", span,
                             f"make `{reader}` from `{writer}` (`frozen({writer})`, `critic({writer})`) or from a "
                             f"checkpoint saved with `{writer}`'s tokenizer; a reward model may differ "
                             "(`reward_model(m)` re-tokenizes the text)")
    errors.raise_if_any()
    return graph


def _same_source(graph: FlowGraph, a: str, b: str) -> bool:
    """Both models are made from one declaration (``frozen(policy)`` and ``policy``): one tokenizer, nothing
    to read (a checkpoint's tokenizer.json is 7-11 MB for 150k-token vocabularies)."""
    first, second = source_node(graph, a), source_node(graph, b)
    return first is not None and second is not None and first.id == second.id


def _generators(graph: FlowGraph, target: str) -> list[Node]:
    """The ``generate`` nodes whose rows reach ``target``, following the arguments an op passes through
    (:attr:`~flowrl.catalog.ops.OpSpec.passthrough`: ``filter_groups``, ``score``...)."""
    out, todo, seen = [], [target], set()
    while todo:
        nid = todo.pop()
        if nid in seen or nid not in graph:
            continue
        seen.add(nid)
        node = graph.node(nid)
        spec = OPS.get(node.op)
        if spec is None:
            continue
        if node.kind == OpKind.GENERATE:
            out.append(node)
        elif spec.passthrough is not None and spec.passthrough < len(node.args):
            arg = node.args[spec.passthrough]
            if isinstance(arg, Ref):
                todo.append(arg.target)
    return out


__all__ = ["check_tokenizers"]
