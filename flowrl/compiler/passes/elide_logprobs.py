"""Find the log-prob passes an update makes redundant; lowering drops them, the cost model skips them.

Requires: insert_resyncs (every op knows its model; the update's inputs are checked).

Guarantees: ``graph.elided`` maps each redundant ``logprobs`` op to ``(update op, the
update's argument it fed)``; the graph itself is unchanged (``flowrl graph`` and the IR
dumps still show the pass, marked). Two cases, both what an experienced veRL/TRL user
expects:

* **The old-policy pass.** PPO's ratio needs "old" log-probs; the pass computes them with
  the trainer's current weights right before the update (in the consumer stage, at any
  staleness). When the update makes one optimiser step on the whole batch (``epochs = 1,
  minibatches = 1``) with a loss that trains a policy, those are exactly what the update's
  first forward computes, so the pass only repeats it (TRL skips it the same way when
  ``num_iterations == 1``). The update gets ``old_logprobs = "forward"`` and its loss
  measures the rollout/train mismatch itself (when both engines hold the same weights).
  Kept when it computes entropy, or when truncated importance sampling needs it before the
  loss (TIS is also what corrects for the behaviour policy's lag under ``staleness > 1``).
* **The reference pass without KL.** With ``kl = 0`` the update never reads the frozen
  reference's log-probs (veRL builds no reference model when ``use_kl_loss`` is off and
  there is no KL in the reward; TRL loads none when ``beta = 0``), so the pass and, when
  nothing else reads it, the reference's engine are dropped.

Either pass is kept whenever any other op reads it (e.g. PPO's KL-in-reward).

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... reward v = verifier("exact")
... flow f(d: dataset) {
...   ref = frozen(m)  b = sample(d)  r = generate(m, b, n = 2)
...   lp = logprobs(m, r)  ref_lp = logprobs(ref, r)
...   update(m, r, group_advantage(v(r), group = 2), lp, ref_lp)
... }''', "doc.flow", until="elide_logprobs", allow_missing=True)
>>> sorted(g.elided.items())
[('lp', ('update', 'old')), ('ref_lp', ('update', 'ref_logprobs'))]
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.ir.graph import Config, EdgeKind, FlowGraph, Node, plain


def elide_logprobs(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    return replace(graph, elided=elided_logprobs(graph))


def elided_logprobs(graph: FlowGraph) -> dict[str, tuple[str, str]]:
    """``{logprobs op id: (update op id, the update's argument it fed)}`` for every redundant pass."""
    out = {}
    for n in graph.nodes():
        if n.kind != OpKind.UPDATE:
            continue
        producers = graph.producers(n.id)
        for arg in ("old", "ref_logprobs"):
            src_id = producers.get(arg)
            if src_id is None:
                continue
            src = graph.node(src_id)
            if (src.kind != OpKind.LOGPROBS or set(graph.users(src_id, EdgeKind.DATA)) != {n.id}
                    or plain(src.attr("entropy", False))):
                continue
            if arg == "old" and _forward_is_old_policy(n, src):
                out[src_id] = (n.id, arg)
            elif arg == "ref_logprobs" and not float(plain(n.attr("kl", 0.0)) or 0.0):
                out[src_id] = (n.id, arg)
    return out


def _loss_name(update: Node) -> str:
    loss = update.attr("loss")
    if isinstance(loss, Config):
        return loss.name
    return str(plain(loss) if loss is not None else OPS[update.op].kwargs["loss"].default)


def _forward_is_old_policy(update: Node, src: Node) -> bool:
    loss = LOSSES.get(_loss_name(update))
    return (src.model == update.model
            and loss is not None and loss.model_role == "trainable"  # a policy loss (a critic's old values differ)
            and int(plain(update.attr("epochs", 1)) or 1) == 1
            and int(plain(update.attr("minibatches", 1)) or 1) == 1
            and not float(plain(update.attr("tis", 0.0)) or 0.0))


__all__ = ["elide_logprobs", "elided_logprobs"]
