"""Pictures of a compiled FlowGraph: Graphviz DOT and Mermaid text (``flowrl graph``).

What the picture encodes:

* **fill colour** = the model whose engine runs the op (``Node.model``; a model node
  takes its own colour). Colours come from a fixed palette, keyed by model id, so a
  model keeps its colour from one graph to the next. Frozen models and the ops that run
  on them are grey; ops with no model (driver math, sampling, scoring) are white.
* **elided** ops (log-prob passes the compiler proved redundant: ``flowrl plan`` lists them)
  and the frozen models only they read are drawn dotted and grey with the reason: they
  never run, so no pool holds them.
* **shape** = what the node is: resources are cylinders (models), folders (datasets),
  notes (rewards) and components (environments); critics are double-bordered
  cylinders; ``update`` is a 3-D box, advantage math an ellipse; a compiler-inserted
  ``resync`` is a bold red double octagon.
* **edges**: data edges are labelled with the fields they carry (``Edge.fields``);
  resource edges are thin and grey; weights edges are blue, and the loop-carried ones
  (read at the next step) are dashed and labelled ``weights d=1`` with their distance;
  a value carried to the next turn of a ``repeat`` loop is dashed and labelled ``turn``.
* **clusters**: the ops of each inlined flow call sit in a box named after the call
  (``grpo``, ``grpo#2``), nested as the calls were; a ``repeat`` loop is a box inside.
* **pools**: when the flow has a ``schedule``, the ops that run on an engine sit in a box
  per pool of GPUs (``pool gen: GPUs 0-3 (node 0)``; colocated engines share one), with the
  call and loop boxes inside it; driver-side ops (sampling, scoring, advantages) stay
  outside, except inside a ``repeat`` loop, which is drawn whole in its engine's pool.
  See :func:`pool_of_nodes`.
* a legend lists the colours and the edge kinds the graph uses.

Both writers are pure and deterministic: the same graph gives the same text, byte for
byte (nodes in topological order with source-order ties, edges and clusters sorted).
Rendering DOT to SVG/PNG needs Graphviz; see :func:`render_dot`.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import zlib
from dataclasses import dataclass, field

import networkx as nx

from flowrl.ir.graph import Config, Const, Edge, EdgeKind, FlowGraph, Node, Symbol
from flowrl.catalog.ops import OpKind

# ---- styling tables ---------------------------------------------------------------------

PALETTE = ("#8dd3c7", "#bebada", "#fdb462", "#80b1d3", "#b3de69",
           "#fccde5", "#ffffb3", "#fb8072", "#bc80bd", "#ccebc5")
"""Fill colours for models (ColorBrewer Set3: pale, distinct, black text stays readable)."""
FROZEN_FILL = "#e0e0e0"
FROZEN_TEXT = "#616161"
DRIVER_FILL = "#ffffff"
ELIDED_GREY = "#9e9e9e"
RESYNC_RED = "#c62828"
CRITIC_BORDER = "#8c510a"
WEIGHTS_BLUE = "#1565c0"
TURN_PURPLE = "#6a1b9a"
RESOURCE_GREY = "#9e9e9e"
INK = "#212121"

# Graphviz shape per op kind; anything not listed is a plain box.
DOT_SHAPES: dict[OpKind, str] = {
    OpKind.MODEL: "cylinder",
    OpKind.DATASET: "folder",
    OpKind.REWARD_FN: "note",
    OpKind.ENV: "component",
    OpKind.SAMPLE: "box",
    OpKind.GENERATE: "box",
    OpKind.SCORE: "box",
    OpKind.LOGPROBS: "box",
    OpKind.VALUES: "box",
    OpKind.ADVANTAGE: "ellipse",
    OpKind.UPDATE: "box3d",
    OpKind.RESYNC: "doubleoctagon",
    OpKind.ENV_STEP: "hexagon",
    OpKind.USER_CALL: "parallelogram",
    OpKind.CALL: "box",
}

# Mermaid node brackets per op kind: (open, close).
MERMAID_SHAPES: dict[OpKind, tuple[str, str]] = {
    OpKind.MODEL: ("[(", ")]"),
    OpKind.DATASET: ("[(", ")]"),
    OpKind.REWARD_FN: (">", "]"),
    OpKind.ENV: ("[[", "]]"),
    OpKind.ADVANTAGE: ("([", "])"),
    OpKind.UPDATE: ("[[", "]]"),
    OpKind.RESYNC: ("{{", "}}"),
    OpKind.ENV_STEP: ("{{", "}}"),
    OpKind.USER_CALL: ("[/", "/]"),
}

# The option worth showing under an op's name (keeps labels short but informative), by op kind.
DETAIL_ATTR = {OpKind.GENERATE: "n", OpKind.SAMPLE: "size", OpKind.UPDATE: "loss", OpKind.RESYNC: "protocol"}

EDGE_WRAP = 24
"""Data-edge labels wrap after this many characters (one field list per edge)."""


# ---- what each node looks like (shared by both writers) -----------------------------------


STYLES = ("model", "frozen", "critic", "resync", "driver", "elided")
"""The style classes a node is drawn in (:attr:`Look.style`; the Mermaid CSS classes and the legend
are named after them). They share words with ops (``frozen``, ``critic``) without being ops."""


@dataclass(frozen=True)
class Look:
    """How one node is drawn: its fill, its text colour and its style class."""

    fill: str
    text: str
    style: str
    """One of :data:`STYLES`: the legend/CSS class."""
    model: str | None
    """The model whose colour the node takes (None: driver-side / frozen)."""


def model_colours(graph: FlowGraph) -> dict[str, str]:
    """Model id -> fill colour for every non-frozen model of the graph.

    The palette slot is ``crc32(id) mod len(PALETTE)`` (so a model keeps its colour
    across graphs); ids are placed in sorted order and a taken slot moves on to the next
    free one, so models of one graph never share a colour unless there are more models
    than colours.
    """
    ids = sorted(n.id for n in graph.nodes() if n.kind == OpKind.MODEL and n.role != "frozen")
    taken: dict[int, str] = {}
    out: dict[str, str] = {}
    for mid in ids:
        slot = zlib.crc32(mid.encode()) % len(PALETTE)
        for step in range(len(PALETTE)):
            if (slot + step) % len(PALETTE) not in taken:
                slot = (slot + step) % len(PALETTE)
                break
        taken[slot] = mid
        out[mid] = PALETTE[slot]
    return out


def elided_nodes(graph: FlowGraph) -> dict[str, str]:
    """Node id -> why it never runs: the log-prob passes the compiler elides
    (:func:`flowrl.compiler.passes.elide_logprobs.elided_logprobs`, as ``flowrl plan`` lists
    them), and frozen models read by nothing else (no engine is started for them)."""
    from flowrl.compiler.passes.elide_logprobs import elided_logprobs

    out: dict[str, str] = {}
    for op_id, (_update, arg) in sorted(elided_logprobs(graph).items()):
        out[op_id] = "elided: the update's forward" if arg == "old" else "elided: kl = 0"
    for n in graph.nodes():
        if n.kind == OpKind.MODEL and n.role == "frozen":
            readers = [v for _, v, e in graph.edges() if e.kind == EdgeKind.RESOURCE and _ == n.id]
            if readers and all(r in out for r in readers):
                out[n.id] = "not loaded: only elided ops read it"
    return out


def node_look(graph: FlowGraph, node: Node, colours: dict[str, str], elided: dict[str, str] | None = None) -> Look:
    """Fill and style class of ``node``: by the model it runs on, greyed if that model is frozen,
    dotted if it never runs (``elided``: :func:`elided_nodes`)."""
    if elided and node.id in elided:
        return Look(DRIVER_FILL, FROZEN_TEXT, "elided", None)
    owner = node.id if node.kind == OpKind.MODEL else node.model
    owner_node = graph.node(owner) if owner is not None and owner in graph else None
    frozen = owner_node is not None and owner_node.role == "frozen"
    if node.kind == OpKind.RESYNC:
        return Look(colours.get(owner, DRIVER_FILL), INK, "resync", owner)
    if frozen:
        return Look(FROZEN_FILL, FROZEN_TEXT, "frozen", None)
    if owner is None or owner not in colours:
        return Look(DRIVER_FILL, INK, "driver", None)
    critic = node.kind == OpKind.MODEL and node.role == "critic"
    return Look(colours[owner], INK, "critic" if critic else "model", owner)


def node_lines(node: Node, graph: FlowGraph | None = None, elided: dict[str, str] | None = None) -> list[str]:
    """The text of a node: its id, then its op (with a role or one telling option), then why it
    never runs if it is ``elided``. A resync shows the protocol the schedule chose (``graph``)."""
    if node.op == "param":
        second = f"{node.kind.value} param"
    else:
        second = node.op
        key = DETAIL_ATTR.get(node.kind)
        value = node.attr(key) if key else None
        chosen = _chosen_protocol(graph, node) if node.kind == OpKind.RESYNC else None
        if chosen is not None:
            second += f" {key}={chosen}"
        elif value is not None:
            second += f" {key}={_short(value)}"
    if node.role and node.role != node.op:  # `frozen(...)` is already a frozen model
        second += f" [{node.role}]"
    lines = [node.id, second]
    if elided and node.id in elided:
        lines.append(f"({elided[node.id]})")
    return lines


def _chosen_protocol(graph: FlowGraph | None, node: Node) -> str | None:
    """The protocol the schedule passes chose for a resync node (None before they ran)."""
    resyncs = getattr(getattr(graph, "sched", None), "resyncs", None) or {}
    chosen = resyncs.get(node.id)
    protocol = getattr(chosen, "protocol", None)
    return protocol if isinstance(protocol, str) and protocol != "auto" else None


def edge_text(edge: Edge) -> str | None:
    """An edge's label: its fields (data), ``weights``/``weights d=N``, ``turn``; None for resources."""
    if edge.kind == EdgeKind.DATA:
        return ", ".join(sorted(edge.fields)) if edge.fields else edge.arg
    if edge.kind == EdgeKind.WEIGHTS:
        return f"weights d={edge.distance}" if edge.distance else "weights"
    if edge.kind == EdgeKind.TURN:
        return "turn" if edge.distance == 1 else f"turn d={edge.distance}"
    return None


def ordered_nodes(graph: FlowGraph) -> list[Node]:
    """Topological order of the intra-step DAG (ties: source order); source order if cyclic."""
    try:
        return graph.topo_order()
    except nx.NetworkXUnfeasible:  # a broken (cyclic) graph still draws, which helps debug it
        return list(graph.nodes())


def sorted_edges(graph: FlowGraph) -> list[tuple[str, str, Edge]]:
    """Every edge as (source id, target id, record), sorted by ids, then kind and argument."""
    return sorted(graph.edges(), key=lambda t: (t[0], t[1], t[2].kind.value, t[2].arg))


# ---- clusters: inlined flow calls and repeat loops -----------------------------------------


@dataclass
class Cluster:
    """A box of the picture: an inlined call (``flow grpo``) or a repeat loop, with children."""

    label: str
    nodes: list[Node] = field(default_factory=list)
    children: dict[str, "Cluster"] = field(default_factory=dict)


def scope_path(node: Node) -> tuple[str, ...]:
    """The call instances a node was inlined through, outermost first (``("mid", "inner#2")``).

    ``Node.scope`` holds flow *names*; two calls of one flow differ only in the id prefix
    the inliner gave them (``inner.b`` vs ``inner#2.b``), so the instance is read from the
    id where the id starts with the scope's names, and the names are used otherwise
    (compiler-made nodes such as ``resync.policy`` carry their scope without the prefix).
    """
    parts = node.id.split(".")
    if len(parts) > len(node.scope) and all(
            p.split("#")[0] == s for p, s in zip(parts, node.scope)):
        return tuple(parts[: len(node.scope)])
    return tuple(node.scope)


def cluster_tree(graph: FlowGraph, nodes: list[Node]) -> Cluster:
    """Nest the nodes into call-instance clusters, with repeat-loop clusters innermost."""
    root = Cluster("")
    for n in nodes:
        box = root
        for inst in scope_path(n):
            box = box.children.setdefault(inst, Cluster(f"flow {inst}"))
        if n.region is not None:
            # "@" sorts loops after nested calls and cannot clash with a call's name
            box = box.children.setdefault(f"@{n.region}", Cluster(_region_label(graph, n.region)))
        box.nodes.append(n)
    return root


def _region_label(graph: FlowGraph, rid: str) -> str:
    region = graph.regions.get(rid)
    if region is None:
        return f"repeat ({rid})"
    text = f"repeat {_short(region.count)}"
    return text + (f" until {region.until}" if region.until else "")


def _short(value) -> str:
    if isinstance(value, Const):
        if value.kind == "bool":
            return "true" if value.value else "false"
        return value.text or str(value.value)
    if isinstance(value, Config):
        return value.name
    if isinstance(value, Symbol):
        return f"${value.name}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


# ---- pools: which GPUs each op runs on (from the schedule) ---------------------------------------

ENGINE_OF_KIND = {OpKind.GENERATE: "rollout", OpKind.LOGPROBS: "train", OpKind.VALUES: "train",
                  OpKind.UPDATE: "train", OpKind.RESYNC: "train"}
"""Which engine of its model an op runs on (a resync is sent by the trainer)."""
POOL_BLUE = "#37474f"


@dataclass(frozen=True)
class PoolBox:
    """One pool of the schedule as the picture shows it."""

    name: str
    label: str
    """``pool gen: GPUs 0-3 (node 0)``."""
    engines: tuple[str, ...]


def pool_of_nodes(graph: FlowGraph) -> tuple[dict[str, str], list[PoolBox]]:
    """``(node id -> pool name, pools in schedule order)`` for ops that run on an engine.

    Empty when the flow has no ``schedule`` block (the compiler's default single pool would
    only wrap the picture in one more box) or was not compiled. An op's engine is
    ``<model>.rollout`` for ``generate`` and ``<model>.train`` for log-probs, values, update
    and resync (:data:`ENGINE_OF_KIND`); its pool is the one that engine was placed on.
    """
    st = getattr(graph, "sched", None)
    if getattr(graph, "schedule", None) is None:
        return {}, []
    engines = getattr(st, "engines", None) or {}
    pools = list(getattr(st, "pools", None) or ())
    if not engines or not pools:
        return {}, []
    per_node = int((getattr(getattr(st, "spec", None), "cluster", None) or {}).get("gpus_per_node", 0) or 0)
    boxes = [PoolBox(p.name, _pool_label(p, per_node), tuple(p.engines)) for p in pools]
    elided = elided_nodes(graph)
    out: dict[str, str] = {}
    for n in graph.nodes():
        role = ENGINE_OF_KIND.get(n.kind)
        e = engines.get(f"{n.model}.{role}") if role and n.model else None
        if e is not None and getattr(e, "pool", None) and n.id not in elided:
            out[n.id] = e.pool
    # A repeat loop is one box: drawn whole in the pool of its engine ops (its driver-side ops,
    # e.g. env_step, inside it too), not split into a loop box per pool.
    regions: dict[str, set[str]] = {}
    for n in graph.nodes():
        if n.region is not None and n.id in out:
            regions.setdefault(n.region, set()).add(out[n.id])
    for n in graph.nodes():
        if n.region is not None and len(regions.get(n.region, ())) == 1 and n.id not in elided:
            out[n.id] = next(iter(regions[n.region]))
    return out, boxes


def _pool_label(pool, per_node: int) -> str:
    ids = sorted(pool.gpu_ids)
    gpus = _ranges(ids) if ids else f"{pool.gpus}"
    nodes = sorted(set(pool.nodes))
    where = f" (node {_ranges(nodes)})" if len(nodes) == 1 else (f" (nodes {_ranges(nodes)})" if nodes else "")
    word = "GPU" if len(ids) == 1 else "GPUs"
    return f"pool {pool.name}: {word} {gpus}{where}"


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts, start, prev = [], None, None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = x
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def pool_groups(graph: FlowGraph, nodes: list[Node]) -> list[tuple[PoolBox | None, list[Node]]]:
    """The nodes split by pool, in schedule order; ``(None, rest)`` last (driver-side ops,
    resources, or every node when there is no schedule). Pools with no op are left out."""
    pool_of, boxes = pool_of_nodes(graph)
    groups: list[tuple[PoolBox | None, list[Node]]] = []
    for box in boxes:
        members = [n for n in nodes if pool_of.get(n.id) == box.name]
        if members:
            groups.append((box, members))
    groups.append((None, [n for n in nodes if n.id not in pool_of]))
    return groups


# ---- DOT ----------------------------------------------------------------------------------------


def to_dot(graph: FlowGraph) -> str:
    """Graphviz DOT text of ``graph`` (see the module docstring for what it shows)."""
    colours = model_colours(graph)
    nodes = ordered_nodes(graph)
    elided = elided_nodes(graph)
    lines = [
        f"// flowrl graph of flow `{graph.name}`; render with: dot -Tsvg FILE -o FILE.svg",
        f"digraph {_q(graph.name)} {{",
        f"  graph [label={_q('flow ' + graph.name)}, labelloc=t, fontname=\"Helvetica\", fontsize=14,"
        " rankdir=TB, nodesep=0.3, ranksep=0.45, newrank=true];",
        f"  node [fontname=\"Helvetica\", fontsize=10, shape=box, style=filled, fillcolor=\"{DRIVER_FILL}\","
        f" color=\"{INK}\"];",
        f"  edge [fontname=\"Helvetica\", fontsize=8, color=\"{INK}\", fontcolor=\"{INK}\"];",
    ]
    counter = [0]
    for box, in_pool in pool_groups(graph, nodes):
        if box is None:
            _dot_cluster(graph, cluster_tree(graph, in_pool), colours, lines, counter, depth=1, elided=elided)
            continue
        lines.append(f"  subgraph {_q('cluster_pool_' + box.name)} {{")
        lines.append(f"    label={_q(box.label)}; fontsize=11; style=\"rounded,bold\"; penwidth=2; "
                     f"color=\"{POOL_BLUE}\"; fontcolor=\"{POOL_BLUE}\";")
        _dot_cluster(graph, cluster_tree(graph, in_pool), colours, lines, counter, depth=2, elided=elided)
        lines.append("  }")
    for u, v, e in sorted_edges(graph):
        lines.append(f"  {_q(u)} -> {_q(v)} [{_dot_edge_attrs(e, u in elided or v in elided)}];")
    lines += _dot_legend(graph, colours, elided)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_cluster(graph, box: Cluster, colours, lines, counter, depth, elided=None) -> None:
    pad = "  " * depth
    for n in box.nodes:
        lines.append(f"{pad}{_q(n.id)} [{_dot_node_attrs(graph, n, colours, elided)}];")
    for name in sorted(box.children):
        child = box.children[name]
        counter[0] += 1
        loop = name.startswith("@")
        lines.append(f"{pad}subgraph {_q(f'cluster_{counter[0]}')} {{")
        lines.append(f"{pad}  label={_q(child.label)}; fontsize=10; style=\"rounded,dashed\"; "
                     f"color=\"{TURN_PURPLE if loop else '#757575'}\"; fontcolor=\"{INK}\";")
        _dot_cluster(graph, child, colours, lines, counter, depth + 1, elided)
        lines.append(f"{pad}}}")


def _dot_node_attrs(graph: FlowGraph, n: Node, colours, elided=None) -> str:
    look = node_look(graph, n, colours, elided)
    attrs = {"label": "\\n".join(_esc(s) for s in node_lines(n, graph, elided)),
             "shape": DOT_SHAPES.get(n.kind, "box"), "fillcolor": look.fill}
    styles = ["filled"]
    if n.kind in (OpKind.SAMPLE, OpKind.GENERATE, OpKind.SCORE, OpKind.LOGPROBS, OpKind.VALUES):
        styles.append("rounded")
    if look.style == "frozen":
        attrs.update(fontcolor=look.text, color=RESOURCE_GREY)
        styles.append("dashed")
    if look.style == "elided":
        attrs.update(fontcolor=look.text, color=ELIDED_GREY)
        styles.append("dotted")
    if look.style == "critic":
        attrs.update(peripheries="2", color=CRITIC_BORDER, penwidth="1.5")
    if look.style == "resync":
        attrs.update(color=RESYNC_RED, fontcolor=RESYNC_RED, penwidth="2.5")
        styles.append("bold")
    attrs["style"] = ",".join(styles)
    return _attrs(attrs)


def _dot_edge_attrs(e: Edge, elided: bool = False) -> str:
    """An edge's attributes; ``elided``: it touches a node that never runs (drawn dotted grey)."""
    label = edge_text(e)
    attrs: dict[str, str] = {}
    if e.kind == EdgeKind.DATA and label is not None:
        attrs["label"] = "\\n".join(_esc(s) for s in textwrap.wrap(label, EDGE_WRAP)) or _esc(label)
    elif label is not None:
        attrs["label"] = _esc(label)
    if e.kind == EdgeKind.RESOURCE:
        attrs.update(color=RESOURCE_GREY, penwidth="0.6", arrowsize="0.5")
    elif e.kind == EdgeKind.WEIGHTS:
        attrs.update(color=WEIGHTS_BLUE, fontcolor=WEIGHTS_BLUE, penwidth="1.5")
    elif e.kind == EdgeKind.TURN:
        attrs.update(color=TURN_PURPLE, fontcolor=TURN_PURPLE)
    if e.distance:
        # Loop-carried edges point backwards in time: keep them out of the ranking so the
        # step still reads top to bottom. Their labels become external labels (`xlabel`),
        # placed after layout where they overlap no node or other label.
        attrs.update(style="dashed", constraint="false")
        if "label" in attrs:
            attrs["xlabel"] = attrs.pop("label")
    if elided:
        attrs.update(style="dotted", color=ELIDED_GREY, fontcolor=ELIDED_GREY)
    return _attrs(attrs)


def _dot_legend(graph: FlowGraph, colours, elided=None) -> list[str]:
    """One compact table: the colours, the special nodes and the edge kinds the graph uses."""
    looks = {node_look(graph, n, colours, elided).style for n in graph.nodes()}
    rows = [_legend_row(f'<TD BGCOLOR="{c}" WIDTH="40"> </TD>', f"runs on {_html(m)}")
            for m, c in sorted(colours.items())]
    special = [
        ("frozen", f'<TD BGCOLOR="{FROZEN_FILL}" STYLE="dashed"> </TD>', "frozen model (read-only)"),
        ("driver", f'<TD BGCOLOR="{DRIVER_FILL}"> </TD>', "no model (driver side)"),
        ("critic", f'<TD COLOR="{CRITIC_BORDER}" BORDER="3"> </TD>', "critic (value model)"),
        ("resync", f'<TD COLOR="{RESYNC_RED}" BORDER="3"><FONT COLOR="{RESYNC_RED}"><B>resync</B></FONT></TD>',
         "weights to the rollout engine"),
        ("elided", f'<TD STYLE="dotted" COLOR="{ELIDED_GREY}"> </TD>', "never runs (elided by the compiler)"),
    ]
    rows += [_legend_row(cell, text) for style, cell, text in special if style in looks]
    for _, arrow, colour, text in sorted({_legend_edge(e) for _, _, e in graph.edges()}):
        rows.append(_legend_row(f'<TD><FONT COLOR="{colour}"><B>{arrow}</B></FONT></TD>', text))
    table = ('<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2" CELLPADDING="3">'
             '<TR><TD COLSPAN="2"><B>legend</B></TD></TR>' + "".join(rows) + "</TABLE>>")
    return [f'  "legend" [shape=plaintext, style="", fontsize=9, label={table}];']


def _legend_row(cell: str, text: str) -> str:
    return f'<TR>{cell}<TD ALIGN="LEFT" BORDER="0">{text}</TD></TR>'


def _legend_edge(e: Edge) -> tuple[int, str, str, str]:
    """(order, arrow drawn in text, colour, meaning) of one kind of edge, for the legend."""
    solid, dashed = "&#8212;&#8212;&gt;", "- - -&gt;"
    if e.kind == EdgeKind.DATA:
        return 0, solid, INK, "data; the label lists its fields"
    if e.kind == EdgeKind.RESOURCE:
        return 1, solid, RESOURCE_GREY, "reads a model, dataset, reward or env"
    if e.kind == EdgeKind.WEIGHTS and e.distance:
        return 3, dashed, WEIGHTS_BLUE, "weights d=N: read N steps later"
    if e.kind == EdgeKind.WEIGHTS:
        return 2, solid, WEIGHTS_BLUE, "weights, same step"
    return 4, dashed, TURN_PURPLE, "turn: value for the next turn of a repeat"


def _q(s: str) -> str:
    """A DOT double-quoted string."""
    return '"' + _esc(s) + '"'


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _html(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _attrs(attrs: dict[str, str]) -> str:
    """``k="v", ...`` sorted by key. Labels come already escaped (their ``\\n`` are line
    breaks for Graphviz), every other value is escaped here."""
    return ", ".join(f'{k}="{v}"' if k in ("label", "xlabel") else f"{k}={_q(v)}" for k, v in sorted(attrs.items()))


# ---- Mermaid --------------------------------------------------------------------------------------


def to_mermaid(graph: FlowGraph) -> str:
    """Mermaid flowchart text of ``graph`` (paste into Markdown inside a ```mermaid block)."""
    colours = model_colours(graph)
    nodes = ordered_nodes(graph)
    elided = elided_nodes(graph)
    ids = mermaid_ids(n.id for n in nodes)
    lines = ["%% flowrl graph of flow `" + graph.name + "`", "flowchart TB"]
    members: dict[str, list[str]] = {}  # class name -> mermaid ids of its nodes
    css: dict[str, str] = {}  # class name -> its style
    for n in nodes:
        cls, style = mermaid_class(node_look(graph, n, colours, elided))
        members.setdefault(cls, []).append(ids[n.id])
        css[cls] = style
    counter = [0]
    for box, in_pool in pool_groups(graph, nodes):
        if box is None:
            _mermaid_cluster(cluster_tree(graph, in_pool), ids, lines, depth=1, counter=counter,
                             graph=graph, elided=elided)
            continue
        pool_id = "pool_" + "".join(c if c.isalnum() else "_" for c in box.name)
        lines.append(f"  subgraph {pool_id}[{_mq(box.label)}]")
        _mermaid_cluster(cluster_tree(graph, in_pool), ids, lines, depth=2, counter=counter,
                         graph=graph, elided=elided)
        lines.append("  end")
        lines.append(f"  style {pool_id} stroke:{POOL_BLUE},stroke-width:2px")
    link_styles: list[str] = []
    for i, (u, v, e) in enumerate(sorted_edges(graph)):
        label = edge_text(e)
        arrow = "-.->" if e.distance else "-->"
        text = f"|{_mq(label)}|" if label else ""
        lines.append(f"  {ids[u]} {arrow}{text} {ids[v]}")
        style = f"stroke:{ELIDED_GREY},stroke-dasharray:2 2" if u in elided or v in elided else _mermaid_link_style(e)
        if style:  # linkStyle counts edges in the order they were written
            link_styles.append(f"  linkStyle {i} {style}")
    lines += link_styles
    lines += _mermaid_legend(colours, css)
    for cls in sorted(css):
        lines.append(f"  classDef {cls} {css[cls]}")
        if cls in members:
            lines.append(f"  class {','.join(members[cls])} {cls}")
    return "\n".join(lines) + "\n"


def mermaid_class(look: Look) -> tuple[str, str]:
    """(class name, CSS) of a node look: one class per model and style, plus frozen/driver."""
    if look.style == "frozen":
        return "frozen", f"fill:{FROZEN_FILL},color:{FROZEN_TEXT},stroke:{RESOURCE_GREY},stroke-dasharray:4 2"
    if look.style == "driver":
        return "driver", f"fill:{DRIVER_FILL},stroke:{INK}"
    if look.style == "elided":
        return "elided", f"fill:{DRIVER_FILL},color:{FROZEN_TEXT},stroke:{ELIDED_GREY},stroke-dasharray:2 2"
    name = "m_" + "".join(c if c.isalnum() else "_" for c in (look.model or "none"))
    if look.style == "resync":
        return (name + "_resync",
                f"fill:{look.fill},stroke:{RESYNC_RED},stroke-width:3px,color:{RESYNC_RED},font-weight:bold")
    if look.style == "critic":
        return name + "_critic", f"fill:{look.fill},stroke:{CRITIC_BORDER},stroke-width:3px"
    return name, f"fill:{look.fill},stroke:{INK}"


def mermaid_ids(node_ids) -> dict[str, str]:
    """Node id -> a Mermaid-safe id (letters, digits, ``_``), unique, in the given order."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for nid in node_ids:
        base = "n_" + "".join(c if c.isalnum() else "_" for c in nid)
        name, i = base, 2
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        out[nid] = name
    return out


def _mermaid_cluster(box: Cluster, ids, lines, depth, counter, graph=None, elided=None) -> None:
    pad = "  " * depth
    for n in box.nodes:
        open_, close = MERMAID_SHAPES.get(n.kind, ("[", "]"))
        label = "<br/>".join(node_lines(n, graph, elided))
        lines.append(f"{pad}{ids[n.id]}{open_}{_mq(label)}{close}")
    for name in sorted(box.children):
        child = box.children[name]
        counter[0] += 1
        lines.append(f"{pad}subgraph cluster_{counter[0]}[{_mq(child.label)}]")
        _mermaid_cluster(child, ids, lines, depth + 1, counter, graph, elided)
        lines.append(f"{pad}end")


def _mermaid_link_style(e: Edge) -> str | None:
    if e.kind == EdgeKind.RESOURCE:
        return f"stroke:{RESOURCE_GREY},stroke-width:1px"
    if e.kind == EdgeKind.WEIGHTS:
        return f"stroke:{WEIGHTS_BLUE},stroke-width:2px"
    if e.kind == EdgeKind.TURN:
        return f"stroke:{TURN_PURPLE}"
    return None


def _mermaid_legend(colours: dict[str, str], css: dict[str, str]) -> list[str]:
    """A legend subgraph: one swatch per model, then the special nodes and dashed edges.
    Adds the classes its swatches use to ``css``."""
    lines = ['  subgraph legend["legend"]', "    direction LR"]
    for m in sorted(colours):
        cls, style = mermaid_class(Look(colours[m], INK, "model", m))
        css.setdefault(cls, style)
        lines.append(f"    legend_{cls}[{_mq('runs on ' + m)}]:::{cls}")
    if "frozen" in css:
        lines.append('    legend_frozen["frozen model (read-only)"]:::frozen')
    if "elided" in css:
        lines.append('    legend_elided["never runs (elided by the compiler)"]:::elided')
    if any(c.endswith("_resync") for c in css):
        lines.append('    legend_resync{{"resync: weights to the rollout engine"}}')
        lines.append(f"    style legend_resync stroke:{RESYNC_RED},stroke-width:3px,color:{RESYNC_RED}")
    lines.append('    legend_loop["dashed edge: loop-carried (weights d=N: N steps later; turn: next turn)"]')
    lines.append("  end")
    return lines


def _mq(s: str) -> str:
    """A Mermaid quoted label: ``#`` and ``"`` become entity codes (``#35;``, ``#quot;``)."""
    return '"' + s.replace("#", "#35;").replace('"', "#quot;") + '"'


# ---- rendering with Graphviz ------------------------------------------------------------------


class GraphvizError(RuntimeError):
    """Graphviz is missing or failed; the message is one line meant for the user."""


DOT_MISSING = "Graphviz `dot` not found; install it (apt-get install graphviz)"


def render_dot(dot_text: str, fmt: str, timeout: float = 120.0) -> bytes:
    """Run ``dot -T<fmt>`` on DOT text; returns the image bytes (SVG text is UTF-8)."""
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizError(DOT_MISSING)
    try:
        from flowrl.runtime.environment import GIVEN, scrubbed

        proc = subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode("utf-8"), env=scrubbed(given=GIVEN["tool"]),
                              capture_output=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise GraphvizError(DOT_MISSING) from None
    except subprocess.TimeoutExpired:
        raise GraphvizError(f"Graphviz `dot -T{fmt}` took longer than {timeout:.0f} s") from None
    if proc.returncode != 0:
        first = (proc.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"])[0]
        raise GraphvizError(f"Graphviz `dot -T{fmt}` failed (exit {proc.returncode}): {first}")
    return proc.stdout
