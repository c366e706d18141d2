"""The facts of a flow's model nodes (:class:`~flowrl.catalog.models.ModelFacts`): which source each comes from.

Layout checks (tp divides heads, pp divides layers), the memory model and the cost model
need these numbers, and ``flowrl plan`` must answer without a model hub or torch. So
facts come from, in this order:

* ``tiny(...)``: the constructor's options (``hidden``, ``layers``, ``heads``, ``kv_heads``)
  and the task's character set (vocab = 4 special tokens + one per character);
* ``hf("dir")``: the ``config.json`` in that local directory (relative paths are relative
  to the flow file, as for datasets);
* ``hf("Qwen/Qwen2.5-7B")``: a built-in table of public configs (:data:`PRESETS`), so a
  plan for a cluster can be made on a laptop that does not hold the checkpoint;
* ``frozen(m)`` / ``critic(m)``: the facts of ``m`` (a critic's value head, ``hidden + 1``
  parameters, is negligible and not counted).

Anything else (a flow parameter without a value, an ``hf`` path with no ``config.json``
that is not a preset) has no facts: the checks that need them are skipped, and
``flowrl plan`` says so.

>>> from flowrl.catalog.models import PRESETS
>>> PRESETS["qwen/qwen2.5-7b"].layers
28
"""

from __future__ import annotations

import os

from flowrl.catalog.models import ConfigError, ModelFacts, from_config, preset, tiny_facts
from flowrl.ir.graph import Const, FlowGraph, Node, Ref, plain
from flowrl.catalog.ops import OpKind


def facts_of(graph: FlowGraph, model_id: str, _depth: int = 0) -> ModelFacts | None:
    """The facts of a model node of ``graph`` (None when nothing is known)."""
    node: Node = graph.node(model_id)
    if node.kind != OpKind.MODEL or _depth > 8:
        return None
    if node.op in ("frozen", "critic"):
        base = node.args[0] if node.args else None
        return facts_of(graph, base.target, _depth + 1) if isinstance(base, Ref) and base.target in graph else None
    attrs = {k: plain(v) for k, v in node.attrs}
    if node.op == "tiny":
        if not all(isinstance(v, (int, str)) for v in attrs.values()):
            return None  # an abstract option (a symbol): shape unknown
        return tiny_facts(attrs)
    if node.op == "hf" and node.args and isinstance(node.args[0], Const):
        return _hf_facts(node, str(node.args[0].value))
    return None


def _hf_facts(node: Node, path: str) -> ModelFacts | None:
    local = path if os.path.isabs(path) or node.span.path.startswith("<") else \
        os.path.join(os.path.dirname(os.path.abspath(node.span.path)), path)
    facts = None
    if os.path.isfile(os.path.join(local, "config.json")):
        try:
            facts = from_config(local)
        except ConfigError:
            facts = None
    if facts is None:
        facts = preset(path)
    return facts  # bytes per weight are the cluster's (bf16 on GPUs, fp32 on CPU): see flowrl.cost.model


def model_facts(graph: FlowGraph) -> dict[str, ModelFacts | None]:
    """Facts of every model node of ``graph`` (None where unknown)."""
    return {n.id: facts_of(graph, n.id) for n in graph.nodes() if n.kind == OpKind.MODEL}


__all__ = ["facts_of", "model_facts"]
