"""Check the entry flow's run settings: the parameters the runtime reads (``RUN_PARAMS``).

Requires: resolve_names (the entry flow's parameters are known).

Guarantees: every run setting the flow declares has the type the runtime reads and a default
it accepts: ``steps``, ``seed``, ``eval_every``, ``save_every``, ``keep_last``, ``keep_best``,
``export_every``, ``log_samples`` are ``int``
(``steps`` >= 1, the others >= 0); ``log`` is a ``str`` naming known experiment trackers
(:data:`flowrl.catalog.loggers.LOGGERS`, comma-separated); the tracker settings
(:data:`flowrl.catalog.loggers.TRACKING_SETTINGS`: ``log_name``, ``log_tags``, ``log_uri``...) are
``str``, and ``log_uri`` holds no password (E513: it would be written to ``plan.json``). The graph
is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('flow main(log: str = "tensorbord") { }', "doc.flow", until="check_run_settings")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:1:22: error[E511]: unknown logger `tensorbord`: the known loggers are tensorboard, wandb, mlflow (comma-separated); did you mean `tensorboard`?
"""

from __future__ import annotations

from flowrl.catalog.loggers import TRACKING_SETTINGS, URI_HINT, UnknownLoggerError, parse_loggers, uri_problem
from flowrl.compiler.context import CompileContext
from flowrl.compiler.kwargs import PLANNED, PLANNED_SHOWN, short
from flowrl.diagnostics import Collector
from flowrl.ir.graph import FlowGraph
from flowrl.syntax import ast

SETTING_TYPES = {"steps": ("int", 1, "20"), "seed": ("int", 0, "0"), "eval_every": ("int", 0, "10"),
                 "save_every": ("int", 0, "0"), "keep_last": ("int", 0, "3"), "keep_best": ("int", 0, "1"),
                 "export_every": ("int", 0, "0"), "log_samples": ("int", 0, "0"), "log": ("str", None, '"tensorboard"'),
                 **{name: ("str", None, '"..."') for name in TRACKING_SETTINGS}}
"""Run setting -> (the type the runtime reads, the least value an int may have, an example default)."""


def check_run_settings(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    for p in graph.params:
        if p.name not in SETTING_TYPES:
            continue
        want, least, example = SETTING_TYPES[p.name]
        if p.type != want:
            errors.error("E510", f"run setting `{p.name}` must be declared `{want}`, not `{p.type}`", p.span,
                         f"write `{p.name}: {want} = {example}`; the runtime reads it as a run setting")
            continue
        value = p.default.value if isinstance(p.default, ast.Literal) else None
        if value is None:
            continue
        if want == "int" and isinstance(value, int) and not isinstance(value, bool) and value > PLANNED["int"]:
            errors.error("E510", f"run setting `{p.name} = {short(value)}` is more than flowrl plans for (at most "
                                 f"{PLANNED_SHOWN['int']})", p.default.span, "check the number for a typo")
        elif want == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            errors.error("E510", f"run setting `{p.name} = {value}` must be an integer >= {least}", p.default.span,
                         "`steps` counts RL steps (at least one); `flowrl eval` measures a model without training"
                         if p.name == "steps" else f"write `{p.name}: int = {example}`")
        elif p.name == "log":
            try:
                parse_loggers(value)
            except UnknownLoggerError as e:
                errors.error("E511", str(e), p.default.span, 'e.g. `log: str = "tensorboard,wandb"`')
        elif p.name == "log_uri" and isinstance(value, str) and uri_problem(value):
            errors.error("E513", uri_problem(value), p.default.span, URI_HINT)
    errors.raise_if_any()
    return graph
