"""Log-prob passes an update makes redundant, which lowering drops.

Two cases, both what an experienced veRL/TRL user expects:

* **The old-policy pass.** PPO's ratio needs "old" log-probs; the pass computes them with
  the trainer's current weights right before the update (in the consumer stage, at any
  staleness). When the update makes one optimiser step on the whole batch (``epochs = 1,
  minibatches = 1``), those are exactly what the update's first forward computes, so the
  pass only repeats it (TRL skips it the same way when ``num_iterations == 1``). The
  update gets ``old_logprobs = "forward"`` and its loss measures the rollout/train
  mismatch itself (when both engines hold the same weights). Kept when it computes
  entropy, or when truncated importance sampling needs it before the loss (TIS is also
  what corrects for the behaviour policy's lag under ``staleness > 1``).
* **The reference pass without KL.** With ``kl = 0`` the update never reads the frozen
  reference's log-probs (veRL builds no reference model when ``use_kl_loss`` is off and
  there is no KL in the reward; TRL loads none when ``beta = 0``), so the pass and, when
  nothing else reads it, the reference's engine are dropped.

Either pass is kept whenever any other op reads it (e.g. PPO's KL-in-reward). The cost
model leaves dropped passes out of the step too.
"""

from __future__ import annotations

from flowrl.ir.graph import EdgeKind, FlowGraph, plain
from flowrl.catalog.ops import OpKind


def elided_logprobs(graph: FlowGraph) -> dict[str, tuple[str, str]]:
    """``{logprobs op id: (update op id, the update's argument it fed)}`` for every dropped pass."""
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


def _forward_is_old_policy(update, src) -> bool:
    loss = update.attr("loss")
    return (src.model == update.model
            and getattr(loss, "name", "ppo_clip") != "value_clip"
            and int(plain(update.attr("epochs", 1)) or 1) == 1
            and int(plain(update.attr("minibatches", 1)) or 1) == 1
            and not float(plain(update.attr("tis", 0.0)) or 0.0))


__all__ = ["elided_logprobs"]
