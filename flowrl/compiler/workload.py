"""What one step of a flow asks of its engines: prompts, completions, tokens, micro-batches.

The memory model and the cost model need the step's sizes; they come from the ops'
options (``sample(size)``, ``generate(n, max_tokens)``, ``update(micro_batch, epochs)``,
``repeat`` counts). Two things a flow does not say are assumptions, shown by
``flowrl plan``:

* prompt length: :func:`prompt_tokens` = a quarter of the model's context, at most 512, where
  the datasets' first rows cannot be counted (:mod:`flowrl.compiler.data_workload`, which the
  estimate prefers);
* response lengths: long-tailed, lognormal with median ``max_tokens / 4`` and log-space
  sigma 1.0, capped at ``max_tokens`` (about 8% of responses hit the cap, as in
  reasoning RL where some responses run to the limit); where a dataset names reference
  completions, the estimate keeps the shape and takes their mean (``data_workload``).

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset) { b = sample(d, size = 4)  r = generate(m, b, n = 8, max_tokens = 32)  return r }
... ''', "doc.flow")
>>> w = workload(g)
>>> (w.gens[0].prompts, w.gens[0].samples, w.gens[0].max_tokens)
(4, 32, 32)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import networkx as nx

from flowrl.catalog.adapters import ALL_LINEAR
from flowrl.catalog.models import ModelFacts
from flowrl.cost.sim import LengthDist
from flowrl.ir.graph import Config, Const, EdgeKind, FlowGraph, Node, Ref, plain
from flowrl.catalog.ops import OPS, PRODUCER_KINDS, OpKind

LENGTH_MEDIAN_FRACTION = 0.25
LENGTH_SIGMA = 1.0
MAX_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class GenWork:
    op: str
    model: str
    prompts: int
    n: int
    max_tokens: int
    turns: int = 1
    """``repeat`` count of the loop the generate is in (1 outside loops)."""
    draws: float = 1.0
    """Expected draws per step: above 1 when an op after it draws again until it keeps enough
    groups (:attr:`~flowrl.catalog.ops.OpSpec.redraw`: DAPO's dynamic sampling)."""

    @property
    def samples(self) -> int:
        """Completions of one draw: the batch the step trains on."""
        return self.prompts * self.n

    @property
    def generated(self) -> int:
        """Completions generated per step, every expected draw counted."""
        return math.ceil(self.samples * self.draws)


@dataclass(frozen=True)
class Workload:
    gens: tuple[GenWork, ...]
    samples: dict = field(default_factory=dict)
    """Op id -> rows its result carries per step."""
    micro_batch: dict = field(default_factory=dict)
    """Model id -> sequences per micro-batch of its update (default 8)."""
    epochs: dict = field(default_factory=dict)
    max_tokens: dict = field(default_factory=dict)
    """Model id -> the largest ``max_tokens`` of its generate ops (its training sequences' length)."""
    lora: dict = field(default_factory=dict)
    """Model id -> ``(r, targets)`` of a model that trains LoRA adapters (``lora = lora(...)``)."""
    micro_batch_tokens: dict = field(default_factory=dict)
    """Model id -> its update's token budget per micro-batch (``micro_batch_tokens``; absent or 0: by rows)."""
    precision: dict = field(default_factory=dict)
    """Model id -> ``(dtype, precision)`` of a model whose flow names its ``dtype`` (:func:`precision_of`);
    absent: the hardware profile's assumption (:func:`flowrl.cost.model.train_memory`)."""

    def gen_of(self, model: str) -> GenWork | None:
        return next((g for g in self.gens if g.model == model), None)


def prompt_tokens(facts: ModelFacts | None) -> int:
    """Assumed prompt length: a quarter of the model's context, at most 512 tokens."""
    if facts is None:
        return 128
    return max(8, min(MAX_PROMPT_TOKENS, facts.max_len // 4))


def lengths(max_tokens: int, kind: str = "lognormal", sigma: float = LENGTH_SIGMA,
            median: float | None = None) -> LengthDist:
    """The assumed response-length distribution for a generate with ``max_tokens``."""
    return LengthDist(kind, median or max(1.0, max_tokens * LENGTH_MEDIAN_FRACTION), sigma=sigma,
                      cap=max(int(max_tokens), 1))


def seq_len(facts: ModelFacts | None, max_tokens: int) -> int:
    """Tokens of one training sequence: prompt + the longest response."""
    return prompt_tokens(facts) + max_tokens


def int_option(node: Node, key: str, default: int) -> int:
    """An int option of ``node``: its value, else its catalogue default, else ``default``."""
    v = node.attr(key)
    if isinstance(v, Const) and isinstance(v.value, (int, float)) and not isinstance(v.value, bool):
        return int(v.value)
    spec = OPS.get(node.op)
    if spec is not None and key in spec.kwargs and isinstance(spec.kwargs[key].default, int):
        return int(spec.kwargs[key].default)
    return default


def workload(graph: FlowGraph) -> Workload:
    """The step's sizes, from the ops of ``graph`` (abstract options take the catalogue's defaults)."""
    samples: dict[str, int] = {}
    for n in graph.topo_order():
        samples[n.id] = _rows(graph, n, samples)
    gens, micro, epochs, max_tok, budget = [], {}, {}, {}, {}
    for n in graph.nodes():
        if n.kind == OpKind.GENERATE and n.model:
            prompts_in = _input(graph, n, "prompts")
            prompts = samples.get(prompts_in, 64) if prompts_in else 64
            turns = 1
            if n.region and n.region in graph.regions:
                c = graph.regions[n.region].count
                turns = int(c.value) if isinstance(c, Const) and isinstance(c.value, int) else 1
            env = _env_of(graph, n)
            if env is not None and OPS.get(env.op) is not None and "max_turns" in OPS[env.op].kwargs:
                turns = max(turns, int_option(env, "max_turns", 1))  # an agent's calls: one row of up to that many turns
            g = GenWork(n.id, n.model, prompts, int_option(n, "n", 1), int_option(n, "max_tokens", 64), turns)
            gens.append(g)
            max_tok[n.model] = max(max_tok.get(n.model, 0), g.max_tokens)
        elif n.kind == OpKind.UPDATE and n.model:
            micro[n.model] = int_option(n, "micro_batch", 8)
            budget[n.model] = int_option(n, "micro_batch_tokens", 0)
            epochs[n.model] = int_option(n, "epochs", 1)
    draws = _expected_draws(graph, samples)
    for op_id, d in draws.items():  # the ops before a redrawing op run once per draw
        samples[op_id] = math.ceil(samples[op_id] * d)
    gens = [replace(g, draws=draws.get(g.op, 1.0)) for g in gens]
    return Workload(tuple(gens), samples, micro, epochs, max_tok, lora_of(graph), micro_batch_tokens=budget,
                    precision=precision_of(graph))


def precision_of(graph: FlowGraph) -> dict[str, tuple[str, str]]:
    """Model id -> ``(dtype, precision)`` of each model declared with a ``dtype`` (``hf(..., dtype = "bfloat16")``;
    ``precision`` its option or the catalogue's default): what its train engine holds per parameter
    (:func:`flowrl.catalog.precision.train_bytes`)."""
    out = {}
    for n in graph.nodes():
        dtype, spec = n.attr("dtype"), OPS.get(n.op)
        if n.kind != OpKind.MODEL or spec is None or "precision" not in spec.kwargs or n.key_span("dtype") is None \
                or not isinstance(dtype, Const):  # the catalogue's default is filled in; only a written one counts
            continue
        precision = n.attr("precision")
        out[n.id] = (str(dtype.value), str(precision.value) if isinstance(precision, Const)
                     else str(spec.kwargs["precision"].default))
    return out


def lora_of(graph: FlowGraph) -> dict[str, tuple[int, object]]:
    """Model id -> ``(r, targets)`` of each model declared with ``lora = lora(...)``."""
    return {n.id: _lora(n.attr("lora")) for n in graph.nodes()
            if n.kind == OpKind.MODEL and isinstance(n.attr("lora"), Config)}


def _lora(value: Config) -> tuple[int, object]:
    """``(r, targets)`` of a ``lora(...)`` value (targets: ``"all-linear"`` or a tuple of module names)."""
    targets = dict(value.options).get("targets")
    if targets is None:
        return int(value.get("r", 8)), ALL_LINEAR
    return int(value.get("r", 8)), tuple(plain(targets)) if isinstance(targets, tuple) else plain(targets)


def _expected_draws(graph: FlowGraph, samples: dict) -> dict[str, float]:
    """Op id -> expected runs per step of the producer ops an op with a ``redraw`` record re-runs."""
    out: dict[str, float] = {}
    dag = graph.step_dag()
    for n in graph.nodes():
        spec = OPS.get(n.op)
        if spec is None or spec.redraw is None:
            continue
        r = spec.redraw
        rows = next((samples[u] for u, e in graph.in_edges(n.id) if e.kind == EdgeKind.DATA and u in samples), 0)
        groups = max(rows // max(int_option(n, spec.group_option, 1), 1), 1)
        keep = n.attr(r.keep)
        keep = float(keep.value) if isinstance(keep, Const) else float(spec.kwargs[r.keep].default)
        d = r.expected_draws(int_option(n, r.size, 0), groups, int_option(n, r.max_draws, 1), keep)
        for u in nx.ancestors(dag, n.id):
            if graph.node(u).kind in PRODUCER_KINDS:
                out[u] = max(out.get(u, 1.0), d)
    return out


def _env_of(graph: FlowGraph, n: Node) -> Node | None:
    """The environment resource an op takes as an argument (``agent_rollout``'s agent), if any."""
    spec = OPS.get(n.op)
    for i, a in enumerate(spec.args if spec is not None else ()):
        if a.type == "env" and i < len(n.args) and isinstance(n.args[i], Ref) and n.args[i].target in graph:
            return graph.node(n.args[i].target)
    return None


def _input(graph: FlowGraph, n: Node, arg: str) -> str | None:
    for u, e in graph.in_edges(n.id):
        if e.kind == EdgeKind.DATA and e.arg == arg and e.distance == 0:
            return u
    return None


def _rows(graph: FlowGraph, n: Node, samples: dict) -> int:
    if n.kind == OpKind.SAMPLE:
        return int_option(n, "size", 64)
    if n.kind == OpKind.GENERATE:
        src = _input(graph, n, "prompts")
        return samples.get(src, 64) * int_option(n, "n", 1) if src else 64
    spec = OPS.get(n.op)
    if spec is not None and spec.redraw is not None and int_option(n, spec.redraw.size, 0):
        return int_option(n, spec.redraw.size, 0) * int_option(n, spec.group_option, 1)  # the groups it keeps
    for u, e in graph.in_edges(n.id):  # rows follow the first data input
        if e.kind == EdgeKind.DATA and e.distance == 0 and u in samples:
            return samples[u]
    return 0


__all__ = ["Workload", "GenWork", "workload", "lora_of", "precision_of", "prompt_tokens", "lengths", "seq_len", "int_option"]
