"""Check every op's arguments and options against the op catalogue; compute fields.

Requires: resolve_names (edges drawn, no CALL nodes).

Guarantees: every op has the right number and kinds of arguments; every data argument
carries the fields the op needs (``Node.fields`` of each node and ``Edge.fields`` of each
data edge are filled in); keyword options are known, well-typed and in range, with
defaults filled in; ``group`` of a group advantage matches the ``n`` of the generate it
comes from; a ``repeat ... until F`` loop produces ``F``.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset) { b = sample(d, size = 2)  r = generate(m, b, n = 2) }
... ''', "doc.flow", until="check_edge_types")
>>> sorted(g.node("r").fields)[:4]
['answers', 'group_ids', 'prompt_ids', 'response_ids']
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.diagnostics import Collector, did_you_mean
from flowrl.ir.graph import Config, Const, EdgeKind, FlowGraph, Node, Ref, Symbol, Value, plain
from flowrl.compiler.kwargs import check_kwargs, show
from flowrl.catalog.ops import LOSSES, OPS, RESOURCE_KINDS, RESOURCE_TYPES, OpKind

ANY = "*"
"""A field set containing ANY satisfies every need (abstract ``data`` parameters)."""

_KIND_WORDS = {OpKind.MODEL: "a model", OpKind.DATASET: "a dataset", OpKind.REWARD_FN: "a reward",
               OpKind.ENV: "an environment"}


def check_edge_types(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    out = graph.copy()
    errors = Collector(ctx.sources)
    for node in out.topo_order():
        spec = OPS.get(node.op)
        if node.op == "param" or spec is None:
            continue
        library = _library_options(node, spec, errors) if spec.library and node.kind == OpKind.DATASET else ()
        own = tuple((k, v) for k, v in node.attrs if k not in dict(library))
        attrs = check_kwargs(own, spec.kwargs, errors, f"`{node.op}`", node.span, node.key_spans)
        node = replace(node, attrs=tuple(sorted(attrs + library)))
        loss = _loss_spec(node)
        fields = set(spec.produces)
        _check_arity(node, spec, errors)
        producers = out.producers(node.id)
        for i, value in enumerate(node.args):
            aspec = spec.arg_spec(i)
            if aspec is None:
                continue
            needs = set(aspec.needs)
            if node.kind == OpKind.UPDATE and loss is not None:
                if aspec.name == "targets":
                    needs = {loss.needs_targets}
                elif aspec.name == "old":
                    needs = {loss.needs_old} if loss.needs_old else set()
            _check_arg(out, node, i, aspec, value, needs, producers, errors)
            if spec.passthrough == i and isinstance(value, Ref) and value.target in out:
                fields |= out.node(value.target).fields - {ANY}
        if node.kind == OpKind.UPDATE and loss is not None and loss.needs_old and len(node.args) < 4:
            errors.error("E215", f"`{loss.name}` needs the old {loss.needs_old} as the 4th argument of update",
                         node.span, "e.g. `update(policy, rollouts, adv, old_lp, loss = ppo_clip(0.2))` with "
                                    "`old_lp = logprobs(policy, rollouts)`")
        if node.kind == OpKind.LOGPROBS and node.attr("entropy") and node.attr("entropy").value:
            fields.add("entropy")
        if node.kind == OpKind.USER_CALL:
            fields |= {str(v.value) for v in (node.attr("produces") or ()) if isinstance(v, Const)}
        if spec.per_argument is not None:
            _check_per_argument(node, spec, errors)
        if spec.variadic:
            for i in range(len(spec.args), len(node.args)):
                _check_variadic(out, node, i, errors)
        out.replace(replace(node, fields=frozenset(fields)))
    _check_groups(out, errors)
    _check_regions(out, errors)
    _check_continuations(out, errors)
    errors.raise_if_any()
    return out


def _library_options(node: Node, spec, errors: Collector) -> tuple:
    """The options of a library's dataset beyond its record's own (the library's config, ``min_terms = 2``):
    constants or lists of constants, kept as written; ``check_resources`` checks them against the library."""
    out = []
    spans = dict(node.key_spans)
    for key, value in node.attrs:
        if key in spec.kwargs:
            continue
        items = value if isinstance(value, tuple) else (value,)
        if all(isinstance(v, (Const, Symbol)) for v in items):  # a Symbol: a parameter without a value yet
            out.append((key, value))
            continue
        bad = next(v for v in items if not isinstance(v, (Const, Symbol)))
        errors.error("E207", f"option `{key}` of `{node.op}` (a {spec.library} config option) must be a number, a "
                             "string, a bool or a list of them" + (f", got the name `{bad.target}`"
                                                                  if isinstance(bad, Ref) else ""),
                     getattr(bad, "span", None) or spans.get(key, node.span),
                     f"strings are in double quotes: `{key} = \"{bad.target}\"`" if isinstance(bad, Ref)
                     else f"write the value itself, e.g. `{key} = 2`")
        out.append((key, value))
    return tuple(out)


def _loss_spec(node: Node):
    if node.kind != OpKind.UPDATE:
        return None
    loss = node.attr("loss")
    if isinstance(loss, Config):
        return LOSSES.get(loss.name)
    if isinstance(loss, Const) and loss.value in LOSSES:
        return LOSSES[loss.value]
    return None


def _check_arity(node: Node, spec, errors: Collector) -> None:
    if len(node.args) > len(spec.args) and not spec.variadic and spec.rest is None:
        extra = node.args[len(spec.args)]
        errors.error("E201", f"`{node.op}` takes {len(spec.args)} positional argument"
                             f"{'s' if len(spec.args) != 1 else ''}, got {len(node.args)}",
                     getattr(extra, "span", node.span), f"signature: {_signature(spec)}"
                     + (f"; options are passed by name: {', '.join(sorted(spec.kwargs))}" if spec.kwargs else ""))
    for aspec in spec.args[len(node.args):]:
        if not aspec.optional:
            errors.error("E202", f"`{node.op}` needs argument `{aspec.name}` ({aspec.type})", node.span,
                         f"signature: {_signature(spec)}")


def _check_per_argument(node: Node, spec, errors: Collector) -> None:
    """E220: the list option ``spec.per_argument`` has one number per positional argument, and no
    argument is given twice (``weighted_sum(acc, fmt, weights = [1.0, 0.2])``)."""
    key = spec.per_argument
    seen: dict[str, Value] = {}
    for a in node.args:
        if isinstance(a, Ref) and a.target in seen:
            errors.error("E220", f"`{a.target}` is given to `{node.op}` twice", a.span,
                         f"name each once and give it the sum of its weights in `{key}`")
        elif isinstance(a, Ref):
            seen[a.target] = a
    values = node.attr(key)
    if not isinstance(values, tuple):
        return  # missing (E209 said so), not a list (E207), or a parameter without a value
    span = node.key_span(key) or node.span
    for v in values:
        if not (isinstance(v, Const) and v.kind in ("int", "float")) and not isinstance(v, Symbol):
            errors.error("E220", f"`{key}` of `{node.op}` holds numbers, got {show(plain(v))}",
                         getattr(v, "span", span), f"e.g. `{key} = [1.0, 0.5]`")
            return
    if len(values) != len(node.args):
        errors.error("E220", f"`{key}` has {len(values)} number{'s' if len(values) != 1 else ''} for "
                             f"{len(node.args)} argument{'s' if len(node.args) != 1 else ''} of `{node.op}`",
                     span, f"one weight per argument, in order: `{key} = "
                           f"[{', '.join('1.0' for _ in node.args)}]`")


def _check_arg(graph: FlowGraph, node: Node, i: int, aspec, value: Value, needs: set[str],
               producers: dict[str, str], errors: Collector) -> None:
    span = getattr(value, "span", node.span)
    if aspec.type == "str":
        if not (isinstance(value, Const) and value.kind == "str") and not isinstance(value, Symbol):
            errors.error("E204", f"argument `{aspec.name}` of `{node.op}` must be a string", span,
                         f"e.g. `{node.op}(\"...\")`")
        elif aspec.choices and isinstance(value, Const) and value.value not in aspec.choices:
            known = ", ".join(f'"{c}"' for c in aspec.choices)
            errors.error("E204", f"`{node.op}(\"{value.value}\")`: `{aspec.name}` must be one of {known}", span,
                         did_you_mean(value.value, aspec.choices) or f"the known values are {known}")
        return
    if not isinstance(value, Ref) or value.target not in graph:
        if isinstance(value, Ref):
            return  # an unresolved name: resolve_names reported it
        errors.error("E203", f"argument `{aspec.name}` of `{node.op}` must be "
                             f"{_want_word(aspec.type)}, got a constant", span, f"signature: {_signature(OPS[node.op])}")
        return
    src = graph.node(value.target)
    want = RESOURCE_TYPES.get(aspec.type)
    if want is not None:
        if src.kind != want:
            errors.error("E203", f"argument `{aspec.name}` of `{node.op}` must be {_want_word(aspec.type)}, "
                                 f"but `{src.id}` is {_what(src)}", span,
                         f"signature: {_signature(OPS[node.op])}")
        return
    if src.kind in RESOURCE_KINDS:
        errors.error("E203", f"argument `{aspec.name}` of `{node.op}` must be data, but `{src.id}` is "
                             f"{_what(src)}", span, f"signature: {_signature(OPS[node.op])}")
        return
    have = set(src.fields)
    missing = sorted(needs - have) if ANY not in have else []
    if missing:
        errors.error("E205", f"`{node.op}` needs field{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)} in argument `{aspec.name}`, but `{src.id}` "
                             f"(`{src.op}` at {src.span.line}:{src.span.column}) carries "
                             f"{', '.join(sorted(have)) or 'nothing'}", span, _field_hint(missing))
    key = f"{EdgeKind.DATA.value}:{aspec.name}"
    if graph.g.has_edge(src.id, node.id, key):
        edge = graph.g.edges[src.id, node.id, key]["edge"]
        graph.set_edge(src.id, node.id, replace(edge, fields=frozenset(needs & have if ANY not in have else needs)))


def _check_variadic(graph: FlowGraph, node: Node, i: int, errors: Collector) -> None:
    value = node.args[i]
    if isinstance(value, Ref) and value.target in graph:
        src = graph.node(value.target)
        key = f"{EdgeKind.DATA.value}:arg{i}"
        if graph.g.has_edge(src.id, node.id, key):
            edge = graph.g.edges[src.id, node.id, key]["edge"]
            graph.set_edge(src.id, node.id, replace(edge, fields=frozenset(src.fields - {ANY})))


_FIELD_HINTS = {
    "advantages": "compute advantages first, e.g. `adv = group_advantage(scores, group = 8)`",
    "returns": "returns come from `gae(scores, values, rollouts)`",
    "rewards": "score the rollouts first, e.g. `scores = reward(rollouts)`",
    "logprobs": "compute them with `logprobs(model, rollouts)`",
    "values": "compute them with `values(critic, rollouts)`",
    "response_ids": "completions come from `generate(model, prompts)`",
    "response_mask": "completions come from `generate(model, prompts)`",
    "prompt_ids": "prompts come from `sample(dataset, size = N)`",
}


def _field_hint(missing: list[str]) -> str:
    return _FIELD_HINTS.get(missing[0], "see the field table in docs/language.md")


def _check_groups(graph: FlowGraph, errors: Collector) -> None:
    """A group-wise op (``OpSpec.group_option``, e.g. ``group_advantage(scores, group = g)``)
    normalises over the n completions of one prompt: ``g`` must equal the ``n`` of the
    generate upstream, and a group of one makes every result 0 (its mean is itself)."""
    for node in graph.nodes():
        spec = OPS.get(node.op)
        if spec is None or spec.group_option is None:
            continue
        key = spec.group_option
        group = node.attr(key)
        least = spec.kwargs[key].min or 1
        if not isinstance(group, Const) or group.kind != "int":
            continue  # a parameter without a value (a library flow checked on its own)
        gen = _upstream_generate(graph, node)
        n = gen.attr("n") if gen is not None else None
        n = n.value if isinstance(n, Const) and n.kind == "int" else None
        notes = (("generate is", gen.span),) if gen is not None else ()
        if group.value < least:  # E208 said so; its hint names the group size that fits the generate
            if n is not None and n >= max(2, least):
                _rehint(errors, "E208", group.span, f"groups are the n completions of one prompt: use `{key} = {n}`")
            continue
        if group.value == 1:
            hint = (f"use `{key} = {n}`: the generate makes {n} completions per prompt" if n is not None and n >= 2
                    else f"generate several completions per prompt and group them: `n = 8` in generate and "
                         f"`{key} = 8` here")
            errors.error("E218", f"`{key} = 1`: every group is one completion, so every result of `{node.op}` "
                                 f"would be 0", group.span, hint, notes=notes)
        elif n is not None and n != group.value:
            hint = (f"groups are the n completions of one prompt: use `{key} = {n}`" if n >= max(2, least)
                    else f"the generate makes {n} completion{'s' if n != 1 else ''} per prompt, too few to group: "
                         f"write `n = {group.value}` in it")
            errors.error("E213", f"`{key} = {group.value}` but the rollouts come from `generate(..., n = {n})`",
                         group.span, hint, notes=notes)


def _rehint(errors: Collector, code: str, span, hint: str) -> None:
    """Give the diagnostic ``code`` at ``span`` a better hint (one that knows the graph)."""
    errors.items[:] = [replace(d, hint=hint) if d.code == code and d.span == span else d for d in errors.items]


def _upstream_generate(graph: FlowGraph, node: Node) -> Node | None:
    """The generate that made the groups: the nearest upstream generate whose prompts are
    not already grouped (a later turn of a multi-turn loop continues each conversation,
    usually with n = 1, and keeps the first turn's ``group_ids``)."""
    seen = set()
    frontier = [node.id]
    while frontier:
        nid = frontier.pop()
        for src, e in graph.in_edges(nid):
            if e.kind != EdgeKind.DATA or e.distance != 0 or src in seen:
                continue
            seen.add(src)
            s = graph.node(src)
            if s.kind == OpKind.GENERATE and not _continues_groups(graph, s):
                return s
            frontier.append(src)
    return None


def _continues_groups(graph: FlowGraph, gen: Node) -> bool:
    """True if ``gen``'s prompts already carry ``group_ids`` (a continuation turn)."""
    return any(e.kind == EdgeKind.DATA and e.distance == 0 and "group_ids" in graph.node(src).fields
               for src, e in graph.in_edges(gen.id))


def _check_continuations(graph: FlowGraph, errors: Collector) -> None:
    """A generate continuing conversations (its prompts carry ``done``: an env_step's) makes one turn each."""
    for node in graph.nodes():
        if node.kind != OpKind.GENERATE:
            continue
        n = node.attr("n")
        continues = any(e.kind == EdgeKind.DATA and "done" in graph.node(src).fields for src, e in graph.in_edges(node.id))
        if continues and isinstance(n, Const) and n.kind == "int" and n.value != 1:
            errors.error("E219", f"`n = {n.value}`: this generate continues conversations (its prompts come from "
                                 "env_step), one next turn each", n.span or node.span,
                         "drop `n` here; groups are made by the first generate's `n`")


def _check_regions(graph: FlowGraph, errors: Collector) -> None:
    nested = {r.parent for r in graph.regions.values() if r.parent is not None}
    for rid, region in graph.regions.items():
        if region.parent is not None:
            errors.error("E217", "`repeat` inside `repeat` is not supported", region.span,
                         "one loop per turn structure: merge the loops, or unroll the inner one")
            continue
        count = region.count
        if isinstance(count, Const) and (count.kind != "int" or count.value < 1):
            errors.error("E214", f"`repeat` needs a positive integer turn count, got "
                                 f"{count.text or show(count.value)}", count.span, "e.g. `repeat 4 until done { ... }`")
        elif not isinstance(count, (Const, Symbol)) and not isinstance(count, Ref):
            errors.error("E214", "`repeat` needs a positive integer turn count", region.span)
        if region.until and rid not in nested:  # an outer loop's `until` waits for the inner one's fix
            produced = set()
            for n in graph.nodes():
                if n.region == rid:
                    produced |= n.fields
            if region.until not in produced and ANY not in produced:
                errors.error("E216", f"`until {region.until}`: no op in this loop produces field `{region.until}`",
                             region.span, "`env_step(env, x)` produces `done`")


def _signature(spec) -> str:
    parts = [f"{a.name}{'?' if a.optional else ''}: {a.type}" for a in spec.args]
    if spec.rest is not None:
        parts.append(f"{spec.rest.name}: {spec.rest.type}...")
    if spec.variadic:
        parts.append("...")
    return f"{spec.name}({', '.join(parts)})"


def _want_word(t: str) -> str:
    return {"model": "a model", "dataset": "a dataset", "reward": "a reward", "env": "an environment",
            "data": "data"}.get(t, t)


def _what(node: Node) -> str:
    return _KIND_WORDS.get(node.kind, f"data (from `{node.op}`)")


def _short(nid: str) -> str:
    return nid
