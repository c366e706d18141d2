"""The pass manager: parse -> build -> PASSES, one ordered tuple.

``compile_text`` / ``compile_file`` compile one flow; ``check_file`` compiles every
flow of a file (what ``flowrl check`` does). With ``lint=True`` the IR is linted after
every pass, and a broken invariant names the pass that broke it and the passes before.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flowrl.compiler.context import CompileContext
from flowrl.compiler.passes.assign_placement import assign_placement
from flowrl.compiler.passes.check_adapters import check_adapters
from flowrl.compiler.passes.check_packing import check_packing
from flowrl.compiler.passes.check_chat_templates import check_chat_templates
from flowrl.compiler.passes.check_datasets import check_datasets
from flowrl.compiler.passes.check_agents import check_agents
from flowrl.compiler.passes.check_edge_types import check_edge_types
from flowrl.compiler.passes.check_model_fit import check_model_fit
from flowrl.compiler.passes.check_env_libraries import check_env_libraries
from flowrl.compiler.passes.check_platform import check_platform
from flowrl.compiler.passes.check_resources import check_resources
from flowrl.compiler.passes.check_roles import check_roles
from flowrl.compiler.passes.check_routing import check_routing
from flowrl.compiler.passes.check_run_settings import check_run_settings
from flowrl.compiler.passes.check_schedule import check_schedule
from flowrl.compiler.passes.check_schedule_once import check_schedule_once
from flowrl.compiler.passes.check_tokenizers import check_tokenizers
from flowrl.compiler.passes.choose_schedule import choose_schedule
from flowrl.compiler.passes.elide_logprobs import elide_logprobs
from flowrl.compiler.passes.eliminate_dead_code import eliminate_dead_code
from flowrl.compiler.passes.estimate_cost import estimate_cost
from flowrl.compiler.passes.insert_resyncs import insert_resyncs
from flowrl.compiler.passes.plan_layouts import plan_layouts
from flowrl.compiler.passes.resolve_names import resolve_names
from flowrl.compiler.passes.resolve_staleness import resolve_staleness
from flowrl.compiler.passes.size_env_pools import size_env_pools
from flowrl.compiler.passes.select_sync_protocol import select_sync_protocol
from flowrl.compiler.passes.share_base_weights import share_base_weights
from flowrl.compiler.unit import Unit, read_source as _read_source
from flowrl.diagnostics import Collector, Diagnostic, FlowError, SourceMap, Span, did_you_mean
from flowrl.ir.build import build_flow
from flowrl.ir.graph import FlowGraph
from flowrl.ir.lint import LintError, lint
from flowrl.syntax import ast

Pass = Callable[[FlowGraph, CompileContext], FlowGraph]

PASSES: tuple[Pass, ...] = (
    resolve_names,
    check_run_settings,
    check_edge_types,
    check_agents,
    check_roles,
    eliminate_dead_code,
    insert_resyncs,
    elide_logprobs,
    check_schedule_once,
    check_schedule,
    check_platform,
    share_base_weights,
    choose_schedule,
    assign_placement,
    plan_layouts,
    resolve_staleness,
    size_env_pools,
    select_sync_protocol,
    estimate_cost,
    check_chat_templates,
    check_datasets,
    check_resources,
    check_tokenizers,
    check_model_fit,
    check_env_libraries,
    check_routing,
    check_adapters,
    check_packing,
)
PASS_NAMES = tuple(p.__name__ for p in PASSES)


@dataclass
class Compiled:
    graph: FlowGraph
    dumps: dict[str, FlowGraph]
    """Graphs after the passes asked for with ``dump_after`` (``"build"`` is the raw graph)."""


def run_passes(raw: FlowGraph, ctx: CompileContext, until: str | None = None,
               dump_after: tuple[str, ...] = (), lint_each: bool = False) -> Compiled:
    if until is not None and until not in PASS_NAMES and until != "build":
        raise ValueError(f"unknown pass {until!r}; passes: {', '.join(PASS_NAMES)}")
    dumps = {"build": raw} if "build" in dump_after else {}
    graph = raw
    if until == "build":
        return Compiled(graph, dumps)
    done: list[str] = []
    for p in PASSES:
        try:
            graph = p(graph, ctx)
        except FlowError as e:  # report the warnings of the passes before with the errors
            raise FlowError(list(e.diagnostics) + [w for w in graph.warnings if w not in e.diagnostics],
                            e.sources) from None
        done.append(p.__name__)
        if lint_each:
            problems = lint(graph)
            if problems:
                raise LintError(f"IR invariant broken after pass `{p.__name__}` "
                                f"(passes run: {', '.join(done)}):\n  " + "\n  ".join(problems))
        if p.__name__ in dump_after:
            dumps[p.__name__] = graph
        if p.__name__ == until:
            break
    return Compiled(graph, dumps)


def entry_flow(module: ast.Module, requested: str | None = None) -> ast.FlowDef:
    """The flow a file runs: ``requested``, else the flow of its schedule, else ``main``, else the last flow."""
    flows = {i.name: i for i in module.items if isinstance(i, ast.FlowDef)}
    if requested is not None:
        if requested not in flows:
            hint = did_you_mean(requested, flows)
            # The request came from the command line; point at the flow it most likely meant.
            close = hint.split("`")[1] if hint else None
            span = flows[close].name_span if close else module.span
            raise FlowError([Diagnostic("E121", f"no flow `{requested}` in {module.path}", span,
                                        hint or f"flows: {', '.join(flows) or 'none'}")])
        return flows[requested]
    for item in module.items:
        if isinstance(item, ast.ScheduleDef) and item.flow in flows:
            return flows[item.flow]
    if "main" in flows:
        return flows["main"]
    if not flows:
        raise FlowError([Diagnostic("E123", f"{module.path} defines no flow", module.span,
                                    "define one: `flow main() { ... }`")])
    return list(flows.values())[-1]


def replace_flow(module: ast.Module, fdef: ast.FlowDef) -> ast.Module:
    from dataclasses import replace

    items = tuple(fdef if isinstance(i, ast.FlowDef) and i.name == fdef.name else i for i in module.items)
    return replace(module, items=items)


def _check_schedule_targets(module: ast.Module, sources: SourceMap) -> None:
    flows = [i.name for i in module.items if isinstance(i, ast.FlowDef)]
    errors = Collector(sources)
    seen: dict[str, ast.ScheduleDef] = {}
    for item in module.items:
        if isinstance(item, ast.ScheduleDef):
            if item.flow not in flows:
                errors.error("E401", f"schedule for unknown flow `{item.flow}`", item.flow_span,
                             did_you_mean(item.flow, flows) or f"flows in this file: {', '.join(flows) or 'none'}")
            elif item.flow in seen:
                errors.error("E421", f"flow `{item.flow}` has two schedules", item.flow_span,
                             "keep one; pick between schedules with separate files",
                             notes=(("first schedule", seen[item.flow].flow_span),))
            seen[item.flow] = item
    errors.raise_if_any()


def apply_overrides(flow: ast.FlowDef, overrides: dict[str, str], sources: SourceMap) -> ast.FlowDef:
    """``--set name=value``: replace the defaults of the entry flow's scalar parameters."""
    if not overrides:
        return flow
    from dataclasses import replace

    errors = Collector(sources)
    params = {p.name: p for p in flow.params}
    new = dict(params)
    for key, text in overrides.items():
        p = params.get(key)
        if p is None:
            errors.error("E125", f"--set {key}={text}: flow `{flow.name}` has no parameter `{key}`", flow.name_span,
                         did_you_mean(key, params) or f"parameters: {', '.join(params) or 'none'}")
            continue
        try:
            value, kind = _convert(p.type, text)
        except ValueError:
            shown = text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text):,} characters)"
            errors.error("E126", f"--set {key}={shown}: `{key}` is {p.type}, and `{shown}` is not", p.span,
                         f"give a value of type {p.type}")
            continue
        new[key] = replace(p, default=ast.Literal(value, kind, text, p.span))
    errors.raise_if_any()
    return replace(flow, params=tuple(new[p.name] for p in flow.params))


def _convert(typ: str, text: str) -> tuple[object, str]:
    from flowrl.syntax.parser import _parse_size

    if typ == "int":
        return int(text), "int"
    if typ == "float":
        return float(text), "float"
    if typ == "bool":
        if text not in ("true", "false"):
            raise ValueError(text)
        return text == "true", "bool"
    if typ == "str":
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text, "str"
    if typ == "size":
        return _parse_size(text), "size"
    raise ValueError(text)  # models, datasets, lists: change the flow instead


def compile_module(module: ast.Module, unit: Unit, flow: str | None = None, **kw) -> Compiled:
    _check_schedule_targets(module, unit.sources)
    unit.visible(module)  # import errors first, with their positions
    try:
        fdef = entry_flow(module, flow)
    except FlowError as e:  # entry_flow has no source map; quote the file's lines
        raise FlowError(e.diagnostics, unit.sources) from None
    overrides = kw.get("options", {}).get("overrides")
    if overrides:
        fdef = apply_overrides(fdef, overrides, unit.sources)
        module = replace_flow(module, fdef)
    raw = build_flow(fdef, module, unit.sources)
    ctx = CompileContext(unit, module, kw.pop("options", {}))
    return run_passes(raw, ctx, **kw)


def compile_text(text: str | bytes, path: str = "<input>", flow: str | None = None,
                 until: str | None = None, allow_missing: bool = False, **kw) -> FlowGraph:
    """Compile the entry flow of a source text. ``allow_missing`` is accepted for doctests."""
    with _few_collections():
        unit = Unit()
        module = unit.add_text(text, path)
        return compile_module(module, unit, flow, until=until, **kw).graph


def read_source(path: str | Path) -> bytes:
    """The bytes of a source file; FlowError E124 if it cannot be read (see unit.read_source)."""
    return _read_source(path)


def compile_file(path: str | Path, flow: str | None = None, **kw) -> Compiled:
    with _few_collections():
        unit = Unit()
        module = unit.add_text(read_source(path), str(path))
        return compile_module(module, unit, flow, **kw)


def check_file(path: str | Path, unit: Unit | None = None) -> dict[str, FlowGraph]:
    """Compile every flow in a file; raise one FlowError with all their diagnostics."""
    with _few_collections():
        unit = unit or Unit()
        module = unit.add_text(read_source(path), str(path))
        _check_schedule_targets(module, unit.sources)
        unit.visible(module)
        graphs: dict[str, FlowGraph] = {}
        diagnostics: dict[Diagnostic, None] = {}  # ordered and de-duplicated: flows share callees
        for item in module.items:
            if isinstance(item, ast.FlowDef):
                try:
                    graphs[item.name] = compile_module(module, unit, item.name).graph
                    diagnostics.update(dict.fromkeys(graphs[item.name].warnings))
                except FlowError as e:
                    diagnostics.update(dict.fromkeys(e.diagnostics))
        if any(d.is_error for d in diagnostics):
            raise FlowError(diagnostics, unit.sources)
        return graphs


@contextmanager
def _few_collections(gen0: int = 50_000):
    """Run a compilation with a higher generation-0 threshold of the garbage collector.

    A compilation allocates hundreds of thousands of small acyclic objects (tokens, AST
    and IR records); at the default threshold (700) the collector ran over the growing
    heap again and again, about a fifth of the time of a 10,000-op flow. The previous
    thresholds are restored on exit.
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], gen0), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
