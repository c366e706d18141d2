"""Check a flow's ``schedule`` block against the graph and the schedule vocabulary.

Requires: insert_resyncs (resync nodes exist, so ``resync MODEL via ...`` can be checked).

Guarantees: every target (``policy.train``, ``ref``) names a model of the flow and an
engine role it has; layouts name known engines that serve that role, with valid options;
pools, colocation and placement refer to declared pools; ``staleness`` is >= 1 (``<=``
only in ``auto`` schedules); ``resync`` names a model that is resynced, with a known
protocol; schedule calls (``partial_rollout``) are known. The schedule issue's passes
(placement, layouts, staleness, sync protocol) execute what this pass accepts.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset) { b = sample(d)  r = generate(m, b)  return r }
... schedule f on cluster(gpus_per_node = 2) { m.rollout = sglang(tp = 2) }
... ''', "doc.flow")
>>> g.schedule.body[0].engine.func
'sglang'
"""

from __future__ import annotations

from flowrl.compiler.context import CompileContext
from flowrl.compiler.kwargs import check_kwargs, short, suggest
from flowrl.compiler.sched import engines_needed
from flowrl.diagnostics import Collector, did_you_mean
from flowrl.ir.build import _Builder, key_spans
from flowrl.ir.graph import FlowGraph
from flowrl.catalog.ops import OpKind
from flowrl.catalog.schedule import AUTO_MAX_GPUS, CLUSTER, MAX_GPUS, MAX_STALENESS, POOL, ROLES, SCHED_CALLS
from flowrl.catalog.engines import ENGINES
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.syntax import ast


def check_schedule(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    sched = graph.schedule
    if sched is None:
        return graph
    errors = Collector(ctx.sources)
    _Checker(graph, errors).run(sched)
    errors.raise_if_any()
    return graph


class _Checker:
    def __init__(self, graph: FlowGraph, errors: Collector):
        self.graph = graph
        self.errors = errors
        self.models = [n for n in graph.nodes() if n.kind == OpKind.MODEL]
        self.pools = {"all"}

    def run(self, sched: ast.ScheduleDef) -> None:
        if sched.cluster is not None:  # optional only for `auto`
            self.options(sched.cluster, CLUSTER, "cluster", expect="cluster")
            self.size(sched.cluster, sched.auto)
        layouts: dict[str, ast.Layout] = {}
        placed: dict[str, object] = {}
        for st in sched.body:
            if isinstance(st, ast.Pool):
                if st.name in self.pools:
                    self.errors.error("E417", f"pool `{st.name}` is declared twice", st.span,
                                      "give each pool its own name" if st.name != "all"
                                      else "`all` is the whole cluster; pick another name")
                self.pools.add(st.name)
                self.options(st.value, POOL, "a pool", expect="gpus")
        for st in sched.body:
            if isinstance(st, ast.Layout):
                self.layout(st, layouts)
            elif isinstance(st, (ast.Colocate, ast.Place)):
                if st.pool is not None and st.pool not in self.pools:
                    self.errors.error("E415", f"unknown pool `{st.pool}`", st.span,
                                      did_you_mean(st.pool, self.pools) or "declare it: `pool NAME = gpus(N)`")
                for t in st.targets:
                    mid = self.target(t)
                    if mid is None:
                        continue
                    key = f"{mid}.{t.role}" if t.role else mid
                    if key in placed:
                        self.errors.error("E418", f"`{t}` is placed twice", t.span, "place each engine once",
                                          notes=(("first placed", placed[key]),))
                    placed[key] = t.span
            elif isinstance(st, ast.Staleness):
                if st.value < 1:
                    self.errors.error("E408", f"staleness must be >= 1, got {st.value}", st.span,
                                      "1 is synchronous (on-policy), 2 is one-step-off")
                elif st.value > MAX_STALENESS:
                    self.errors.error("E408", f"staleness must be <= {MAX_STALENESS}, got {short(st.value)}", st.span,
                                      "staleness counts the steps rollouts may lag the trainer (1 is on-policy, "
                                      "2 one-step-off; a few is asynchronous): check it for a typo")
                if st.bound_only and not sched.auto:
                    self.errors.error("E409", "`staleness <= N` is a limit for `schedule ... auto`", st.span,
                                      "write `staleness N` to set it")
                if sched.auto and not st.bound_only:
                    self.errors.error("E409", "an auto schedule chooses the staleness; give a limit", st.span,
                                      f"write `staleness <= {st.value}`")
            elif isinstance(st, ast.Resync):
                self.resync(st)
            elif isinstance(st, ast.SchedCall):
                spec = SCHED_CALLS.get(st.call.func)
                if spec is None:
                    self.errors.error("E412", f"unknown schedule statement `{st.call.func}(...)`", st.call.func_span,
                                      did_you_mean(st.call.func, SCHED_CALLS) or
                                      f"known: {', '.join(sorted(SCHED_CALLS))}")
                else:
                    self.options(st.call, spec, f"`{st.call.func}`")
        if sched.auto:
            for st in sched.body:
                if isinstance(st, (ast.Layout, ast.Colocate, ast.Place, ast.Pool)):
                    self.errors.error("E419", "an auto schedule chooses placement and layouts itself", st.span,
                                      "remove this line, or write a manual schedule `schedule NAME on cluster(...)`")

    # ---- pieces -----------------------------------------------------------------------------
    def target(self, t: ast.Target) -> str | None:
        ids = [m.id for m in self.models]
        exact = [i for i in ids if i == t.model]
        matches = exact or [i for i in ids if i.endswith("." + t.model)]
        if not matches:
            short = sorted({i.rsplit(".", 1)[-1] for i in ids})
            self.errors.error("E402", f"`{t.model}` is not a model of flow `{self.graph.name}`", t.span,
                              did_you_mean(t.model, short) or f"models: {', '.join(short) or 'none'}")
            return None
        if len(matches) > 1:
            self.errors.error("E403", f"`{t.model}` is ambiguous: {', '.join(matches)}", t.span,
                              "a schedule target is `MODEL` or `MODEL.ROLE`, so it cannot name either one; "
                              "give the models distinct names")
            return None
        mid = matches[0]
        if t.role is not None:
            if t.role not in ROLES:
                self.errors.error("E404", f"unknown engine role `{t.role}` of `{t.model}`", t.span,
                                  did_you_mean(t.role, ROLES) or "roles are `train` and `rollout`")
                return None
            if t.role == "rollout" and f"{mid}.rollout" not in engines_needed(self.graph):
                self.errors.error("E404", f"`{t.model}` has no rollout engine: nothing generates with it", t.span,
                                  f"write `{t.model}.train` or `{t.model}`")
                return None
        return mid

    def layout(self, st: ast.Layout, layouts: dict) -> None:
        mid = self.target(st.target)
        spec = ENGINES.get(st.engine.func)
        if spec is None:
            self.errors.error("E406", f"unknown engine `{st.engine.func}`", st.engine.func_span,
                              did_you_mean(st.engine.func, ENGINES) or f"engines: {', '.join(sorted(ENGINES))}")
            return
        if mid is not None:
            role = st.target.role or "train"  # a bare model name means its forward/train engine
            if spec.serves != role:
                self.errors.error("E405", f"`{st.engine.func}` is a {spec.serves} engine; `{st.target}` needs a "
                                          f"{role} engine", st.engine.func_span,
                                  "train engines: " + ", ".join(sorted(k for k, e in ENGINES.items() if e.serves == role))
                                  if role == "train" else
                                  "rollout engines: " + ", ".join(sorted(k for k, e in ENGINES.items()
                                                                          if e.serves == "rollout")))
            key = str(st.target)
            if key in layouts:
                self.errors.error("E407", f"`{key}` has two layouts", st.span, "keep one",
                                  notes=(("first layout", layouts[key].span),))
            layouts[key] = st
        self.options(st.engine, spec.kwargs, f"`{st.engine.func}`")

    def resync(self, st: ast.Resync) -> None:
        mid = self.target(ast.Target(st.model, None, st.span))
        if mid is not None and not any(n.kind == OpKind.RESYNC and n.model == mid for n in self.graph.nodes()):
            self.errors.error("E410", f"`{st.model}` is never resynced: it is not both trained and generated with",
                              st.span, "resync applies to a trained model that a rollout engine reads")
        spec = PROTOCOLS.get(st.protocol.func)
        if spec is None:
            self.errors.error("E411", f"unknown weight-sync protocol `{st.protocol.func}`", st.protocol.func_span,
                              did_you_mean(st.protocol.func, PROTOCOLS) or f"protocols: {', '.join(sorted(PROTOCOLS))}")
        else:
            self.options(st.protocol, spec.options, f"`{st.protocol.func}`")
        if st.every is not None and st.every < 1:
            self.errors.error("E408", f"`every` must be >= 1, got {st.every}", st.span,
                              "`every N` resyncs after every N-th update; 1 is after each step")
        elif st.every is not None and st.every > MAX_STALENESS:
            self.errors.error("E408", f"`every` must be <= {MAX_STALENESS}, got {short(st.every)}", st.span,
                              "`every N` resyncs after every N-th update; rollouts lag up to N - 1 versions: "
                              "check it for a typo")

    def size(self, cluster: ast.Call, auto: bool) -> None:
        """A cluster larger than flowrl plans for (E446): every GPU gets a record in the plan; an auto
        schedule's search places every candidate on every GPU, so it searches up to AUTO_MAX_GPUS."""
        given = {k.name: k.value for k in cluster.kwargs}
        counts = [given[k].value for k in ("nodes", "gpus_per_node") if isinstance(given.get(k), ast.Literal)]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
            return  # the options' own checks report it
        total = 1
        for c in counts:
            total *= c
        if total > MAX_GPUS:
            self.errors.error("E446", f"the cluster has {short(total)} GPUs, more than flowrl plans for "
                                      f"({MAX_GPUS:,})", cluster.span,
                              "`nodes` x `gpus_per_node` is the whole cluster: check them for a typo")
        elif auto and total > AUTO_MAX_GPUS:
            self.errors.error("E446", f"`schedule ... auto` searches clusters of up to {AUTO_MAX_GPUS:,} GPUs; this "
                                      f"one has {total:,}", cluster.span,
                              "write the schedule by hand (`schedule NAME on cluster(...) { ... }`: "
                              "`flowrl plan --explain` of an auto schedule on a slice of the cluster shows a "
                              "layout to start from)")

    def options(self, call: ast.Call, spec: dict, what: str, expect: str | None = None) -> None:
        if expect is not None and call.func != expect:
            self.errors.error("E413", f"expected `{expect}(...)`, got `{call.func}(...)`", call.func_span,
                              f"write `{expect}(" + ", ".join(f"{k} = {suggest(s)}" for k, s in spec.items()
                                                             if s.required or k in ("nodes", "gpus_per_node", "gpus"))
                              + ")`")
            return
        if call.args:
            self.errors.error("E420", f"{what} takes keyword options only", call.args[0].span,
                              f"options: {', '.join(sorted(spec))}")
        b = _Builder(FlowGraph("", call.span))
        attrs = tuple((k.name, b.expr(k.value, None)) for k in call.kwargs)
        check_kwargs(attrs, spec, self.errors, what, call.span, key_spans(call))

