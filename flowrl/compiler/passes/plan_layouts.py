"""Give every engine a parallel layout and check it against its pool, the model and memory.

Requires: assign_placement (``graph.sched`` holds pools and placed engines).

Guarantees: each engine in ``graph.sched.engines`` has its engine kind, ``tp``/``pp``/``dp``/``cp``,
options, one GPU per rank (tp fastest, then cp, dp, pp: a tensor-parallel group is
contiguous) and its estimated memory per GPU; the layout

* uses exactly its pool: ``tp x pp x dp x cp = pool GPUs`` (E424); a ``dp`` that is not
  written fills the pool;
* fits the model, when its shape is known: tp divides the attention heads (E425) and
  the KV heads (E426; vLLM/SGLang also accept tp a multiple of them, replicating KV heads),
  pp divides the layers (E427);
* keeps each tensor-parallel group on one node (E429);
* fits in memory (E428): weights, gradients, optimizer states, activations (train
  engines), or weights + workspace inside the rollout engine's reservation, with room
  for at least one sequence of KV cache (E430);

and every ``generate`` asks its rollout engine only for sampling options it takes (E438).

An engine without a layout gets one: a frozen model or critic colocated with its base's
trainer shares that trainer's engine and layout (as veRL does for the reference); a
rollout engine gets the smallest tp that fits; anything else the default engine
(``torch`` / ``vllm``) with dp filling its pool.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... flow f(d: dataset) { b = sample(d)  r = generate(m, b) }
... schedule f on cluster(gpus_per_node = 4) { m.rollout = vllm(tp = 2) }
... ''', "doc.flow", until="plan_layouts")
>>> e = g.sched.engines["m.rollout"]
>>> (e.tp, e.dp, e.gpus)
(2, 2, (0, 1, 2, 3))
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.catalog.models import ModelFacts
from flowrl.plan import EnginePlan, PoolPlan
from flowrl.compiler.sched import DEFAULT_ENGINE, LayoutSpec, SchedState, model_of, role_of
from flowrl.compiler.workload import Workload, prompt_tokens, seq_len, workload
from flowrl.cost.model import Memory, rollout_memory, train_memory
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Collector, Diagnostic, Span
from flowrl.ir.graph import FlowGraph
from flowrl.catalog.ops import OpKind

PARALLEL = {"megatron": ("tp", "pp", "dp", "cp"), "vllm": ("tp", "dp"), "sglang": ("tp", "dp"),
            "fsdp": ("dp",), "torch": ("dp",), "hf_generate": ("dp",)}
"""Which parallel dimensions each engine has."""
KV_REPLICATES = {"vllm", "sglang"}
"""Engines that replicate KV heads when tp exceeds them (tp a multiple of the KV heads)."""


def plan_layouts(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    errors = Collector(ctx.sources)
    work = workload(graph)
    trained = {n.model for n in graph.nodes() if n.kind == OpKind.UPDATE and n.model}
    pools = {p.name: p for p in st.pools}
    engines = dict(st.engines)
    bases = _bases(graph)
    failed: set[str] = set()
    for key in st.engines_needed:
        placed = engines[key]
        lspec = st.spec.layouts.get(key)
        span = _span_of(st, key)
        inherited = lspec is None and _inherited(key, bases, engines, st)
        if inherited:
            lspec = inherited
        plan, problems = layout_engine(key, placed, lspec, st.facts.get(model_of(key)), st.hw, pools[placed.pool],
                                       work, model_of(key) in trained, span, chosen=key not in st.spec.layouts,
                                       strict=st.spec.written)
        if problems:
            failed.add(key)
            if not (inherited and f"{bases.get(model_of(key))}.train" in failed):
                errors.items.extend(problems)  # a layout borrowed from a failing base is reported once, there
        engines[key] = plan
    errors.items.extend(sampling_problems(graph, engines))
    errors.raise_if_any()
    return replace(graph, sched=replace(st, engines=engines))


SAMPLING_LIMITS = {"vllm": {"temperature": 2.0}}
"""Sampling options a rollout engine refuses above a limit: vLLM's ``SamplingParams`` takes
temperatures in [0, 2] (transformers ``generate`` and SGLang take any)."""


def sampling_problems(graph: FlowGraph, engines: dict[str, EnginePlan]) -> list[Diagnostic]:
    """E438: a ``generate`` option its rollout engine would refuse at the first step."""
    out = []
    for n in graph.nodes():
        e = engines.get(f"{n.model}.rollout") if n.kind == OpKind.GENERATE and n.model else None
        for opt, limit in SAMPLING_LIMITS.get(e.kind if e else "", {}).items():
            c = n.attr(opt)
            v = getattr(c, "value", None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limit:
                out.append(Diagnostic(
                    "E438", f"`{opt} = {v}` for `{n.id}` is above {limit:g}, the most the `{e.kind}` rollout engine "
                            f"of `{n.model}` accepts", getattr(c, "span", None) or n.key_span(opt) or n.span,
                    f"use {opt} <= {limit:g}, or the rollout engine `hf_generate`, which takes any {opt}"))
    return out


def _span_of(st: SchedState, key: str) -> Span:
    if key in st.spec.layouts:
        return st.spec.layouts[key].span
    if key in st.spec.placement:
        return st.spec.placement[key].span
    return st.spec.span


def _bases(graph: FlowGraph) -> dict[str, str]:
    from flowrl.compiler.passes.assign_placement import base_models

    return base_models(graph)


def _inherited(key: str, bases: dict, engines: dict, st: SchedState) -> LayoutSpec | None:
    """A frozen model / critic without a layout, on its base trainer's GPUs: the base's layout."""
    base = bases.get(model_of(key))
    if base is None or role_of(key) != "train":
        return None
    base_key = f"{base}.train"
    src = engines.get(base_key)
    if src is None or src.pool != engines[key].pool or base_key not in st.spec.layouts:
        return None
    written = st.spec.layouts[base_key]
    return LayoutSpec(written.kind, dict(written.options), written.span)


def layout_engine(key: str, placed: EnginePlan, lspec: LayoutSpec | None, facts: ModelFacts | None, hw: Profile,
                  pool: PoolPlan, work: Workload, trainable: bool, span: Span, chosen: bool = False,
                  strict: bool = True) -> tuple[EnginePlan, list[Diagnostic]]:
    """The layout of one engine on its pool, and the problems with it (empty when it fits).

    ``lspec`` None: choose one (see the module docstring). ``strict`` False (the default
    schedule of a flow without a ``schedule`` block) reports no memory problems: the plan
    shows the estimate instead.
    """
    role = role_of(key)
    if lspec is None:
        if role == "rollout":
            return _choose_rollout(key, placed, facts, hw, pool, work, span, strict)
        lspec = LayoutSpec(DEFAULT_ENGINE[role], {}, span)
    kind, opts = lspec.kind, dict(lspec.options)
    dims = PARALLEL.get(kind, ("dp",))
    par = {d: int(opts.pop(d, 1)) if d in dims else 1 for d in ("tp", "pp", "cp")}
    dp_written = "dp" in lspec.options
    dp = int(opts.pop("dp", 1))
    problems: list[Diagnostic] = []
    inner = par["tp"] * par["pp"] * par["cp"]
    if not dp_written:
        if pool.gpus % inner:
            problems.append(Diagnostic(
                "E424", f"`{key}` = {_label(kind, par, None)}: tp x pp x cp = {inner} does not divide the "
                        f"{pool.gpus} GPUs of pool `{pool.name}`", span,
                f"choose tp x pp x cp dividing {pool.gpus}, or place `{key}` on a pool of a multiple of {inner} GPUs"))
            dp = 1
        else:
            dp = pool.gpus // inner
    elif inner * dp != pool.gpus:
        problems.append(Diagnostic(
            "E424", f"`{key}` = {_label(kind, par, dp)} uses {inner * dp} GPUs (tp x pp x dp x cp), but pool "
                    f"`{pool.name}` has {pool.gpus}", span,
            _fill_hint(pool.gpus, inner, key, pool.name)))
    plan = replace(placed, kind=kind, options=opts, dp=dp, chosen=chosen, origin=str(span), **par)
    if problems:
        return plan, problems
    problems += shape_problems(key, kind, par["tp"], par["pp"], facts, span)
    problems += node_problems(key, plan, pool, span)
    plan = replace(plan, gpus=tuple(pool.gpu_ids[:plan.world_size]), bundles=tuple(range(plan.world_size)))
    if facts is not None and not problems:
        mem = engine_memory(kind, role, plan, facts, hw, work, trainable, model_of(key))
        plan = replace(plan, memory=mem)
        if strict:
            problems += memory_problems(key, kind, role, plan, mem, facts, hw, work, span)
    return plan, problems


def _label(kind: str, par: dict, dp: int | None) -> str:
    dims = PARALLEL.get(kind, ("dp",))
    parts = [f"{d} = {par[d]}" for d in ("tp", "pp", "cp") if d in dims and (d != "cp" or par[d] != 1)]
    if dp is not None:
        parts.append(f"dp = {dp}")
    return f"{kind}({', '.join(parts)})"


def _fill_hint(gpus: int, inner: int, key: str, pool: str) -> str:
    if gpus % inner == 0:
        return f"make tp x pp x dp x cp = {gpus}: dp = {gpus // inner}, or leave dp out to fill the pool"
    return f"choose tp x pp x cp dividing {gpus}, or place `{key}` on another pool than `{pool}`"


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def shape_problems(key: str, kind: str, tp: int, pp: int, facts: ModelFacts | None, span: Span) -> list[Diagnostic]:
    """tp against heads and KV heads, pp against layers (nothing when the shape is unknown)."""
    if facts is None:
        return []
    out, model = [], model_of(key)
    if facts.heads % tp:
        out.append(Diagnostic("E425", f"tp = {tp} does not divide the {facts.heads} attention heads of `{model}` "
                                      f"({facts.name})", span,
                              f"tp must divide {facts.heads}: {', '.join(map(str, _divisors(facts.heads, 64)))}"))
    elif facts.kv_heads % tp and not (kind in KV_REPLICATES and tp % facts.kv_heads == 0):
        ok = _divisors(facts.kv_heads)
        if kind in KV_REPLICATES:
            ok = sorted(set(ok) | {d for d in _divisors(facts.heads) if d % facts.kv_heads == 0})
            why = f"{kind} needs tp to divide the {facts.kv_heads} KV heads or be a multiple of them"
        else:
            why = f"{kind} splits the {facts.kv_heads} KV-head groups across tensor-parallel ranks"
        out.append(Diagnostic("E426", f"tp = {tp} does not divide the {facts.kv_heads} KV heads of `{model}` "
                                      f"({facts.name})", span,
                              f"{why}: tp in {', '.join(map(str, ok))}"))
    if facts.layers % pp:
        out.append(Diagnostic("E427", f"pp = {pp} does not divide the {facts.layers} layers of `{model}` "
                                      f"({facts.name})", span,
                              f"pp must divide {facts.layers}: {', '.join(map(str, _divisors(facts.layers, 64)))}"))
    return out


def node_problems(key: str, plan: EnginePlan, pool: PoolPlan, span: Span) -> list[Diagnostic]:
    """Each tensor-parallel group (tp consecutive ranks) must sit on one node."""
    tp = plan.tp
    if tp <= 1:
        return []
    for start in range(0, min(plan.world_size, len(pool.nodes)), tp):
        group = pool.nodes[start:start + tp]
        if len(set(group)) > 1:
            here = sum(1 for n in pool.nodes if n == group[0])
            return [Diagnostic(
                "E429", f"a tensor-parallel group of `{key}` spans nodes {group[0]} and {group[-1]}: tp = {tp}, "
                        f"but pool `{pool.name}` has {here} GPUs on node {group[0]}", span,
                "tensor parallelism needs the fast links inside a node: keep tp within a node's GPUs "
                "and use pp or dp across nodes")]
    return []


def engine_memory(kind: str, role: str, plan: EnginePlan, facts: ModelFacts, hw: Profile, work: Workload,
                  trainable: bool, model: str) -> Memory:
    """Estimated memory per GPU of one engine (see flowrl.cost.model)."""
    max_tokens = work.max_tokens.get(model) or _base_max_tokens(work)
    seq = seq_len(facts, max_tokens)
    if role == "rollout":
        gen = work.gen_of(model)
        per_replica = -(-gen.samples // max(plan.dp, 1)) if gen else 1
        return rollout_memory(facts, hw, kind, tp=plan.tp, options=plan.options, seq_len=seq, batch=per_replica)
    if kind == "megatron":  # Megatron's own micro-batch option; the others use the update's
        mb = int(plan.options.get("micro_batch", 1))
    else:
        mb = work.micro_batch.get(model, 8)
    samples = max((g.samples for g in work.gens), default=mb)
    n_micro = max(1, samples // max(plan.dp * mb, 1))
    return train_memory(facts, hw, kind, tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp, trainable=trainable,
                        micro_batch=mb, seq_len=seq, offload=bool(plan.options.get("offload", False)),
                        n_micro=n_micro)


def _base_max_tokens(work: Workload) -> int:
    return max((g.max_tokens for g in work.gens), default=64)


def memory_problems(key: str, kind: str, role: str, plan: EnginePlan, mem: Memory, facts: ModelFacts, hw: Profile,
                    work: Workload, span: Span) -> list[Diagnostic]:
    cap = hw.hbm_gb
    label = _label(kind, {"tp": plan.tp, "pp": plan.pp, "cp": plan.cp}, plan.dp)
    if role == "rollout":
        if kind != "hf_generate" and mem.weights_gb + mem.other_gb > mem.reserved_gb:
            share = plan.options.get("gpu_memory_utilization", plan.options.get("mem_fraction", 0.5))
            knob = "mem_fraction" if kind == "sglang" else "gpu_memory_utilization"
            return [Diagnostic(
                "E428", f"`{key}` = {label} needs {mem.weights_gb:.1f} GB of weights + {mem.other_gb:.1f} GB "
                        f"workspace per GPU, more than {knob} {share:g} x {cap:g} GB = {mem.reserved_gb:.1f} GB",
                span, f"raise tp (tp = {_min_tp(facts, hw, mem, plan)} would fit) or {knob}")]
        if kind == "hf_generate" and mem.total_gb > cap:
            return [_too_big(key, label, mem, hw, span, "raise dp (fewer requests per replica) or lower max_tokens")]
        max_tokens = work.max_tokens.get(model_of(key)) or _base_max_tokens(work)
        seq = seq_len(facts, max_tokens)
        if kind != "hf_generate" and mem.kv_tokens < seq:
            return [Diagnostic(
                "E430", f"the KV cache of `{key}` = {label} holds {mem.kv_tokens} tokens per GPU, less than one "
                        f"sequence of {seq} tokens (prompt {prompt_tokens(facts)} + max_tokens {max_tokens})", span,
                "raise gpu_memory_utilization or tp, or lower max_tokens")]
        return []
    if mem.total_gb > cap:
        hint = ("shard more: raise tp or pp, use fsdp (shards everything by dp), fsdp(offload = true), "
                "or a smaller micro_batch") if mem.optimizer_gb else "shard it: raise tp/pp, or use fsdp(dp = N)"
        return [_too_big(key, label, mem, hw, span, hint)]
    return []


def _too_big(key: str, label: str, mem: Memory, hw: Profile, span: Span, hint: str) -> Diagnostic:
    parts = [("weights", mem.weights_gb), ("grads", mem.grads_gb), ("optimizer", mem.optimizer_gb),
             ("activations", mem.activations_gb), ("KV cache", mem.kv_cache_gb), ("other", mem.other_gb)]
    detail = " + ".join(f"{name} {gb:.1f}" for name, gb in parts if gb >= 0.05)
    return Diagnostic("E428", f"`{key}` = {label} needs {mem.total_gb:.1f} GB per GPU ({detail}), but "
                              f"{'an' if hw.name[0] in 'AH' else 'a'} {hw.name} GPU has {hw.hbm_gb:g} GB", span, hint)


def _min_tp(facts: ModelFacts, hw: Profile, mem: Memory, plan: EnginePlan) -> int:
    for tp in (2, 4, 8, 16, 32, 64):
        if facts.heads % tp == 0 and mem.weights_gb * plan.tp / tp + mem.other_gb <= mem.reserved_gb:
            return tp
    return 64


def _choose_rollout(key: str, placed: EnginePlan, facts, hw, pool: PoolPlan, work: Workload, span: Span,
                    strict: bool) -> tuple[EnginePlan, list[Diagnostic]]:
    """The smallest tp (dividing the pool, within a node, fitting the model and memory) for an unlaid-out
    rollout engine; tp = 1 with its problems when none fits."""
    kind = DEFAULT_ENGINE["rollout"]
    per_node = max((pool.nodes.count(n) for n in set(pool.nodes)), default=1)
    first = None
    for tp in _divisors(pool.gpus, per_node):
        plan, problems = layout_engine(key, placed, LayoutSpec(kind, {"tp": tp}, span), facts, hw, pool, work,
                                       False, span, chosen=True, strict=True)
        if first is None:
            first = (plan, problems)
        if not problems:
            return plan, []
    if not strict:
        return layout_engine(key, placed, LayoutSpec(kind, {"tp": 1}, span), facts, hw, pool, work, False, span,
                             chosen=True, strict=False)
    return first


__all__ = ["plan_layouts", "layout_engine", "shape_problems", "node_problems", "memory_problems", "engine_memory",
           "PARALLEL"]
