"""Lower a checked FlowGraph and its schedule to an :class:`ExecutionPlan`.

Requires: every pass in ``PASSES``. The schedule passes already decided pools, placements,
layouts, staleness, protocols and estimates (``graph.sched``); lowering copies them and
adds the step's ops, datasets, rewards and run settings. Without a ``schedule`` block the
default schedule applies: one node with one (logical) GPU, every engine colocated on it,
synchronous (staleness 1), in-place resync, ``torch`` training and ``vllm`` rollout.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... dataset d = jsonl("d.jsonl")
... flow main() { b = sample(d, size = 2)  r = generate(m, b)  return r }''', "/tmp/x.flow")
>>> plan = lower(g, {})
>>> plan.model("m").rollout_engine.kind, plan.staleness
('vllm', 1)
"""

from __future__ import annotations

import os

from flowrl.plan import DatasetPlan, EnvPlan, EnvSizing, ExecutionPlan, ModelPlan, OpPlan, RewardPlan, RunPlan
from flowrl.compiler.sched import SchedState
from flowrl.diagnostics import Collector, SourceMap
from flowrl.hub import is_hub_id
from flowrl.ir.graph import Config, Const, EdgeKind, FlowGraph, Node, Ref, Symbol, plain
from flowrl.catalog.adapters import LoraConfig, lora_modules
from flowrl.catalog.engines import ENGINES
from flowrl.catalog.ops import OPS, OPTIMIZER_OPTIONS, RESOURCE_KINDS, OpKind
from flowrl.syntax import ast

RUN_PARAMS = ("steps", "seed", "eval_every", "save_every", "log", "log_samples", "log_name", "log_project",
              "log_entity", "log_group", "log_tags", "log_uri",
              "keep_last", "keep_best", "export_every")
"""Entry-flow parameters the runtime reads as run settings (``--set steps=100`` overrides)."""



def lower(graph: FlowGraph, run_overrides: dict | None = None) -> ExecutionPlan:
    """The execution plan of a graph that went through every pass of ``PASSES``."""
    st: SchedState | None = graph.sched
    if st is None or st.estimate is None:
        raise ValueError(f"lower() needs a graph that went through every pass (flow `{graph.name}` stopped "
                         "before estimate_cost); compile it without `until`")
    errors = Collector(graph.sources or SourceMap())
    run = _run(graph, run_overrides or {})
    models = _models(graph, st, errors, run)
    datasets, rewards = _resources(graph, errors)
    elided = graph.elided  # passes the update makes redundant (the elide_logprobs pass)
    ops = tuple(_op(n, elided, graph.on_base) for n in graph.topo_order()
                if n.kind not in RESOURCE_KINDS and n.id not in elided)
    resyncs = tuple(st.resyncs[n.id] for n in graph.nodes() if n.kind == OpKind.RESYNC)
    errors.raise_if_any()
    return ExecutionPlan(
        flow=graph.name, source=graph.span.path, cluster=dict(st.spec.cluster), pools=st.pools,
        models=models, datasets=datasets, rewards=rewards, ops=ops, resyncs=resyncs,
        staleness=st.staleness, run=run,
        regions=_regions(graph),
        pipeline=st.pipeline, estimate=st.estimate, search=st.search, auto=st.spec.auto, memory=st.memory,
        scheduled=st.spec.written, envs=_envs(graph, st), params=_params(graph))


def _regions(graph: FlowGraph) -> dict:
    """Each ``repeat`` loop: its turn count, ``until`` field, and the values its TURN edges carry."""
    out = {rid: {"count": plain(r.count), "until": r.until, "carry": {}} for rid, r in graph.regions.items()}
    for src, dst, e in graph.edges():
        if e.kind == EdgeKind.TURN:
            region = graph.node(dst).region or graph.node(src).region
            if region in out:
                out[region]["carry"].setdefault(dst, {})[e.arg] = src
    return out


def _envs(graph: FlowGraph, st: SchedState) -> tuple[EnvPlan, ...]:
    """The environment resources (``python_env(...)``) with their options, ``target`` and their pools'
    ``workers`` as ``size_env_pools`` sized them."""
    out = []
    for n in graph.nodes():
        if n.kind == OpKind.ENV and n.op != "param":
            opts = {k: plain(v) for k, v in n.attrs}
            if n.args:
                opts["target"] = plain(n.args[0])
            sizing = st.envs.get(n.id) or EnvSizing(opts.get("workers") or 1, "no env_step calls it")
            opts["workers"] = sizing.workers
            out.append(EnvPlan(n.id, n.op, opts, str(n.span), workers_why=sizing.why))
    return tuple(out)


def _models(graph: FlowGraph, st: SchedState, errors: Collector, run: RunPlan) -> tuple[ModelPlan, ...]:
    optims = {n.model: _optim(n, run) for n in graph.nodes() if n.kind == OpKind.UPDATE}
    served = {n.args[0].target: n for n in graph.nodes()  # models a resource runs on a train engine (reward_model(m))
              if OPS.get(n.op) is not None and OPS[n.op].serves_model and OPS[n.op].serves_engine == "train"
              and n.args and isinstance(n.args[0], Ref)}
    out = []
    for n in graph.nodes():
        if n.kind != OpKind.MODEL:
            continue
        if n.op == "param":
            errors.error("E501", f"model `{n.id}` is a parameter without a value, so there is nothing to run",
                         n.span, "run a flow whose models are declared (e.g. `model policy = hf(\"dir\")`), "
                                 "or give the parameter a default")
            continue
        base = n.args[0].target if n.args and isinstance(n.args[0], Ref) else None
        args = {k: plain(v) for k, v in n.attrs if k != "lora"}
        facts = st.facts.get(n.id)
        if isinstance(n.attr("lora"), Config):  # targets as module names ("all-linear" expanded where facts say)
            lora = {k: v for k, v in _opt(n.attr("lora")).items() if k != "name"}
            args["lora"] = LoraConfig.from_plan(lora, lora_modules(facts)).to_dict() if facts is not None else lora
        if _path_arg(n) and isinstance(n.args[0], Const):
            args["path"] = _abspath(graph, n, str(n.args[0].value))
            if is_hub_id(str(n.args[0].value)) and not os.path.isfile(os.path.join(args["path"], "config.json")):
                args["hub_id"] = str(n.args[0].value)  # no local checkpoint: the hub cache's snapshot (flowrl.hub)
        _check_served(n, served.get(n.id), st.engines.get(f"{n.id}.train"), errors)
        out.append(ModelPlan(n.id, n.op, args, n.role or "trainable", base, st.engines.get(f"{n.id}.train"),
                             st.engines.get(f"{n.id}.rollout"), optims.get(n.id, {}), str(n.span),
                             facts.to_dict() if facts is not None else {}))
    return tuple(out)


def _check_served(model: Node, user: Node | None, engine, errors: Collector) -> None:
    """A model a resource serves (``reward_model(m)``) needs a train engine whose adapter takes that role."""
    if user is None or engine is None:
        return
    role = OPS[user.op].serves_model
    spec = ENGINES[engine.kind]
    runs = ENGINES[spec.multi_rank_as] if engine.world_size > 1 and spec.multi_rank_as else spec
    if role not in runs.extra_roles:
        able = sorted(k for k, e in ENGINES.items() if role in e.extra_roles)
        errors.error("E512", f"`{user.op}({model.id})` runs `{model.id}` in the `{role}` role, which the `{runs.name}` "
                             f"engine does not serve", user.span,
                     f"schedule `{model.id}.train = {able[0]}()` (one rank)" if able else None)


def _optim(update: Node, run: RunPlan) -> dict:
    """The update's optimizer options; a learning-rate schedule of 0 steps spans the whole run
    (steps x epochs x minibatches optimizer steps)."""
    optim = {k: plain(update.attr(k)) for k in OPTIMIZER_OPTIONS}
    if not optim.get("schedule_steps"):
        optim["schedule_steps"] = run.steps * int(plain(update.attr("epochs", 1)) or 1) \
            * int(plain(update.attr("minibatches", 1)) or 1)
    return optim


def _path_arg(n: Node) -> bool:
    """The op's first argument is a file path (its record names it ``path``: ``hf``, ``jsonl``...)."""
    spec = OPS.get(n.op)
    return bool(n.args and spec is not None and spec.args and spec.args[0].name == "path")


def _abspath(graph: FlowGraph, node: Node, path: str) -> str:
    """Paths in a flow are relative to the file that wrote them (like imports)."""
    if os.path.isabs(path) or node.span.path.startswith("<"):
        return path
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(node.span.path)), path))


def _resources(graph: FlowGraph, errors: Collector):
    datasets, rewards = [], []
    for n in graph.nodes():
        if n.op == "param" and n.kind in (OpKind.DATASET, OpKind.REWARD_FN, OpKind.ENV):
            errors.error("E501", f"`{n.id}` is a parameter without a value, so there is nothing to run", n.span,
                         "run a flow that passes it a declared dataset / reward / environment")
        elif n.kind == OpKind.DATASET:
            datasets.append(_dataset_plan(graph, n))
        elif n.kind == OpKind.REWARD_FN:
            opts = {k: plain(v) for k, v in n.attrs}
            if n.args:
                arg = n.args[0]
                opts["target"] = arg.target if isinstance(arg, Ref) else plain(arg)
            if OPS[n.op].rest is not None:  # weighted_sum: the rewards it combines, in order
                opts["parts"] = [a.target for a in n.args if isinstance(a, Ref)]
            rewards.append(RewardPlan(n.id, n.op, opts, str(n.span)))
    return tuple(datasets), tuple(rewards)


def _dataset_plan(graph: FlowGraph, n: Node) -> DatasetPlan:
    """A dataset declaration as the runtime reads it: a file dataset's paths resolved, its row format
    (prompt or template, answer, system, chat), a mixture's parts and weights, the rest as ``options``."""
    spec = OPS.get(n.op)
    files = spec is not None and bool(spec.paths)  # `eval` names a file (jsonl, parquet), not a split
    path = _abspath(graph, n, str(plain(n.args[0]))) if _path_arg(n) and isinstance(n.args[0], Const) else ""
    # Another constant argument is an option of its source (`reasoning_gym("chain_sum")`'s `task`), and a
    # library's own config (options beyond the record's) is one option, `config`.
    named = {a.name: plain(v) for a, v in zip(spec.args, n.args) if a.name != "path" and isinstance(v, Const)} \
        if spec is not None else {}
    library = {"config": {k: plain(v) for k, v in n.attrs if k not in spec.kwargs}} \
        if spec is not None and spec.library else {}
    ev = str(plain(n.attr("eval")) or "")
    text = {k: str(plain(n.attr(k)) or "") for k in ("template", "system")}
    chat = plain(n.attr("chat"))
    parts = tuple(a.target for a in n.args if isinstance(a, Ref))
    weights = plain(n.attr("weights")) if parts else None
    known = {"prompt", "answer", "eval", "chat", "bad_rows", "eval_reward", "completion", "template", "system",
             "weights"}
    return DatasetPlan(n.id, n.op, path, str(plain(n.attr("prompt")) or "prompt"),
                       str(plain(n.attr("answer")) or "answer"),
                       _abspath(graph, n, ev) if ev and files else "", str(n.span),
                       chat=chat is True, bad_rows=str(plain(n.attr("bad_rows")) or "error"),
                       eval_reward=str(plain(n.attr("eval_reward")) or ""),
                       completion=str(plain(n.attr("completion")) or ""),
                       template=text["template"], system=text["system"],
                       chat_auto=chat is None and bool(text["template"] or text["system"]),
                       parts=parts, weights=tuple(float(w) for w in weights) if weights else (),
                       options={k: plain(v) for k, v in n.attrs if k not in known and not (library and k not in spec.kwargs)}
                       | ({"eval": ev} if ev and not files else {}) | named | library)


def _op(n: Node, elided: dict[str, tuple[str, str]], on_base: dict[str, str]) -> OpPlan:
    spec = OPS.get(n.op)
    inputs = {}
    options = {k: _opt(v) for k, v in n.attrs}
    for i, a in enumerate(n.args):
        if isinstance(a, Ref):
            name = spec.args[i].name if spec and i < len(spec.args) else f"arg{i}"
            if elided.get(a.target, ("",))[0] == n.id:
                options.setdefault("elided", {})[name] = a.target  # argument -> dropped pass (`flowrl plan`)
                if name == "old":
                    options["old_logprobs"] = "forward"  # the pass it read was elided: its own forward stands in
                continue
            inputs[name] = a.target
    consts = [plain(a) for a in n.args if isinstance(a, Const)]
    if consts:
        options["args"] = consts
    if n.id in on_base:  # a frozen reference of a LoRA policy: the policy's engine, adapters off (share_base_weights)
        options.update(adapters="off", reference=on_base[n.id])
    return OpPlan(n.id, n.kind.value, n.op, inputs, options, n.model, spec.engine if spec else None,
                  tuple(sorted(n.fields)), str(n.span), n.region)


def _opt(v):
    if isinstance(v, Config):
        return {"name": v.name, **{k: _opt(x) for k, x in v.options}}
    if isinstance(v, Symbol):
        return None
    return plain(v)


def _params(graph: FlowGraph) -> dict:
    """The entry flow's scalar parameters with their values (``--set`` already applied to the defaults)."""
    return {p.name: p.default.value for p in graph.params if isinstance(p.default, ast.Literal)}


def _run(graph: FlowGraph, overrides: dict) -> RunPlan:
    values = {}
    for p in graph.params:
        if p.name in RUN_PARAMS and isinstance(p.default, ast.Literal):
            values[p.name] = p.default.value
    values.update({k: v for k, v in overrides.items() if k in RUN_PARAMS and v is not None})
    return RunPlan.from_settings(values)


__all__ = ["lower", "RUN_PARAMS"]
