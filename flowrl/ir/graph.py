"""The FlowGraph IR: a networkx MultiDiGraph whose nodes and edges each hold one typed record.

* node attribute ``op``: a :class:`Node` (kind from the closed :class:`OpKind` set)
* edge attribute ``edge``: an :class:`Edge` (what travels: fields, weights, or a resource)

Edges with ``distance >= 1`` are *loop-carried*: ``update -> generate`` with distance 1
means generate at step k+1 reads the weights update wrote at step k. Everything with
distance 0 forms a DAG (checked by :func:`flowrl.ir.lint.lint`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterator, Union

import networkx as nx

from flowrl.diagnostics import SourceMap, Span
from flowrl.catalog.ops import OpKind


# ---- values held in node records -----------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """A reference to another node (by node id once resolved; by source name before)."""

    target: str
    span: Span


@dataclass(frozen=True)
class Const:
    """A literal: int, float, str, bool, size (bytes, ``kind == "size"``) or a tuple (list)."""

    value: object
    kind: str
    span: Span
    text: str | None = None
    """How the literal was written (sizes keep ``512MB``)."""


@dataclass(frozen=True)
class Config:
    """A configuration value such as ``ppo_clip(clip = 0.2)``: a name and sorted options.

    ``args`` holds positional values until check_edge_types names them from the catalogue.
    """

    name: str
    options: tuple[tuple[str, "Value"], ...]
    span: Span
    args: tuple["Value", ...] = ()

    def get(self, key: str, default=None):
        for k, v in self.options:
            if k == key:
                return v.value if isinstance(v, Const) else v
        return default


@dataclass(frozen=True)
class Symbol:
    """A scalar flow parameter without a value (checking a library flow on its own)."""

    name: str
    type: str
    span: Span


Value = Union[Ref, Const, Config, Symbol, tuple]


def plain(value: "Value"):
    """The Python value of a Const / tuple of Consts; other values are returned as they are."""
    if isinstance(value, Const):
        return value.value
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


# ---- node and edge records ---------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One op of the step (or a resource an op reads)."""

    id: str
    """Unique in the graph; inlined flows prefix it (``grpo.rollouts``)."""
    kind: OpKind
    op: str
    """The built-in op name (``generate``), or the flow name of an unresolved CALL."""
    args: tuple[Value, ...]
    """Positional arguments: Refs to other nodes, or constants."""
    attrs: tuple[tuple[str, Value], ...]
    """Keyword options, sorted by name; defaults are filled in by check_edge_types."""
    span: Span
    fields: frozenset[str] = frozenset()
    """Fields this node's result carries (written by check_edge_types)."""
    model: str | None = None
    """The model node whose engine runs this op (written by check_roles)."""
    role: str | None = None
    """MODEL nodes: ``trainable`` | ``frozen`` | ``critic``."""
    region: str | None = None
    """The ``repeat`` loop this op belongs to, if any."""
    scope: tuple[str, ...] = ()
    """The flow-call chain this node was inlined through, outermost first."""
    key_spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)
    """Where each keyword option's name was written, for diagnostics about the name itself."""

    def attr(self, key: str, default=None):
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def key_span(self, key: str) -> Span | None:
        """The span of the name of keyword option ``key`` as written (None if not written)."""
        for k, s in self.key_spans:
            if k == key:
                return s
        return None

    def with_attrs(self, **updates) -> "Node":
        merged = dict(self.attrs)
        merged.update(updates)
        return replace(self, attrs=tuple(sorted(merged.items())))


class EdgeKind(str, Enum):
    DATA = "data"          # fields of the experience table
    RESOURCE = "resource"  # a dataset / reward function / environment / model's weights read by an op
    WEIGHTS = "weights"    # trained weights: update -> resync -> readers (loop-carried)
    TURN = "turn"          # a value carried to the next turn of a repeat loop


@dataclass(frozen=True)
class Edge:
    kind: EdgeKind
    arg: str
    """The consumer's parameter this edge feeds (``rollouts``, ``model``, ``weights``...)."""
    fields: frozenset[str] = frozenset()
    """DATA edges: the fields the consumer uses (written by check_edge_types)."""
    distance: int = 0
    """0 within a step; >= 1 loop-carried (steps for WEIGHTS, turns for TURN)."""


@dataclass(frozen=True)
class Region:
    """A ``repeat COUNT [until FIELD]`` loop: its ops run up to COUNT turns within one step."""

    id: str
    count: "Value"
    until: str | None
    span: Span
    parent: str | None = None
    """The enclosing loop of a ``repeat`` written inside another (rejected by check_edge_types)."""


# ---- the graph ---------------------------------------------------------------------------------


@dataclass
class FlowGraph:
    """The compiler's IR for one flow (after resolve_names: with every call inlined)."""

    name: str
    span: Span
    g: nx.MultiDiGraph = field(default_factory=nx.MultiDiGraph)
    params: tuple = ()
    """The flow's parameters (ast.Param), for the printer and for abstract checking."""
    returns: Value | None = None
    schedule: object | None = None
    """The flow's ``schedule`` block (ast.ScheduleDef) if the file has one."""
    sources: SourceMap = field(default_factory=SourceMap, compare=False, repr=False)
    unit: object | None = field(default=None, compare=False, repr=False)
    """The compilation unit (modules and imports) this graph was built from."""
    regions: dict = field(default_factory=dict)
    """``repeat`` loops: region id -> Region."""
    bindings: dict = field(default_factory=dict, compare=False)
    """node id -> the source name its value is bound to (absent for call statements). In a
    resolved graph: the name in the outermost flow that binds it (a flow call's result is
    named by its caller), or None where a call statement drops the value a flow returns."""
    sched: object | None = field(default=None, compare=False, repr=False)
    """What the schedule passes decided (``flowrl.compiler.sched.SchedState``): pools,
    placements, layouts, staleness, sync protocols, estimates. None before assign_placement."""
    binding_spans: dict = field(default_factory=dict, compare=False, repr=False)
    """node id -> where the name of ``bindings`` is written (the call statement for a dropped value)."""
    warnings: tuple = field(default=(), compare=False, repr=False)
    """Warning diagnostics found while compiling this graph (passes append theirs)."""
    elided: dict = field(default_factory=dict, compare=False, repr=False)
    """Log-prob passes an update makes redundant (written by the ``elide_logprobs`` pass):
    logprobs op id -> (update op id, the update's argument it fed). Lowering drops them and
    the cost model does not count them."""
    on_base: dict = field(default_factory=dict, compare=False, repr=False)
    """Log-prob passes of a LoRA policy's frozen reference that run on the policy's train engine with
    its adapters disabled (written by the ``share_base_weights`` pass): op id -> the frozen model
    (the op's ``model`` is the policy). Lowering marks them ``adapters = "off"``."""

    # -- nodes
    def add(self, node: Node) -> Node:
        if node.id in self.g:
            raise ValueError(f"duplicate node id {node.id!r}")  # a compiler bug, never user input
        self.g.add_node(node.id, op=node)
        return node

    def replace(self, node: Node) -> None:
        self.g.nodes[node.id]["op"] = node

    def node(self, node_id: str) -> Node:
        return self.g.nodes[node_id]["op"]

    def nodes(self) -> Iterator[Node]:
        """Nodes in insertion (source) order."""
        for nid in self.g.nodes:
            yield self.g.nodes[nid]["op"]

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.g

    def fresh_id(self, base: str) -> str:
        if base not in self.g:
            return base
        i = 2
        while f"{base}#{i}" in self.g:
            i += 1
        return f"{base}#{i}"

    # -- edges
    def connect(self, src: str, dst: str, edge: Edge) -> None:
        self.g.add_edge(src, dst, key=f"{edge.kind.value}:{edge.arg}", edge=edge)

    def edges(self) -> Iterator[tuple[str, str, Edge]]:
        for u, v, data in self.g.edges(data=True):
            yield u, v, data["edge"]

    # The two below read networkx's adjacency dicts (``_pred``/``_succ``, documented as its
    # data structure) directly: an edge-data view object per call was most of the time
    # check_edge_types spent on large flows. Same edges, same order.
    def in_edges(self, node_id: str) -> Iterator[tuple[str, Edge]]:
        for u, keyed in self.g._pred[node_id].items():
            for data in keyed.values():
                yield u, data["edge"]

    def out_edges(self, node_id: str) -> Iterator[tuple[str, Edge]]:
        for v, keyed in self.g._succ[node_id].items():
            for data in keyed.values():
                yield v, data["edge"]

    def set_edge(self, src: str, dst: str, edge: Edge) -> None:
        """Replace the record of the edge with the same kind and arg."""
        self.g.edges[src, dst, f"{edge.kind.value}:{edge.arg}"]["edge"] = edge

    def remove_edge(self, src: str, dst: str, edge: Edge) -> None:
        self.g.remove_edge(src, dst, key=f"{edge.kind.value}:{edge.arg}")

    def step_dag(self) -> nx.MultiDiGraph:
        """The intra-step graph: every edge with distance 0."""
        view = nx.subgraph_view(self.g, filter_edge=lambda u, v, k: self.g.edges[u, v, k]["edge"].distance == 0)
        return view

    def topo_order(self) -> list[Node]:
        """Nodes in a deterministic topological order of the intra-step DAG (ties: source order).

        Kahn's algorithm with a heap of source positions: the order of networkx's
        ``lexicographical_topological_sort(step_dag(), key=position)``, without the
        filtered view, which cost a view object per edge visit (half of check_edge_types'
        time on large flows). Raises ``nx.NetworkXUnfeasible`` on a cycle, as networkx does.
        """
        ids = list(self.g.nodes)
        pos = {nid: i for i, nid in enumerate(ids)}
        indegree = [0] * len(ids)
        successors: list[list[int]] = [[] for _ in ids]
        for u, v, edge in self.g.edges(data="edge"):
            if edge.distance == 0:  # one entry per parallel edge, as a multigraph counts them
                indegree[pos[v]] += 1
                successors[pos[u]].append(pos[v])
        ready = [i for i, d in enumerate(indegree) if d == 0]
        heapq.heapify(ready)
        out: list[Node] = []
        while ready:
            i = heapq.heappop(ready)
            out.append(self.node(ids[i]))
            for j in successors[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    heapq.heappush(ready, j)
        if len(out) != len(ids):
            raise nx.NetworkXUnfeasible("the intra-step graph has a cycle; no topological order")
        return out

    def copy(self) -> "FlowGraph":
        """A shallow copy: records are frozen, so sharing them is safe."""
        return FlowGraph(self.name, self.span, self.g.copy(), self.params, self.returns,
                         self.schedule, self.sources, self.unit, dict(self.regions), dict(self.bindings),
                         self.sched, binding_spans=dict(self.binding_spans), warnings=self.warnings,
                         elided=dict(self.elided), on_base=dict(self.on_base))

    def users(self, node_id: str, kind: EdgeKind | None = None) -> list[str]:
        return [v for v, e in self.out_edges(node_id) if kind is None or e.kind == kind]

    def producers(self, node_id: str) -> dict[str, str]:
        """arg name -> source node id, for the intra-step DATA/RESOURCE inputs of a node."""
        return {e.arg: u for u, e in self.in_edges(node_id)
                if e.kind in (EdgeKind.DATA, EdgeKind.RESOURCE) and e.distance == 0}
