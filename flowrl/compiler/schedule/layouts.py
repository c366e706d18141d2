"""Parallel layouts: an engine's tp/pp/dp/cp on its pool, checked against the pool, the model,
the platform and memory.

Everything here reads the engine's record (:class:`~flowrl.catalog.engines.EngineSpec`): its
parallel axes, the options it takes, whether it replicates KV heads, its sampling limits,
its memory model, how its ranks become processes, and the platforms it runs on with their
limits. A layout

* uses exactly its pool: ``tp x pp x dp x cp = pool GPUs`` (E424); a ``dp`` that is not
  written fills the pool;
* runs on the cluster's platform (E440: Megatron-core on AMD GPUs does not), within the
  limits the record gives for that platform (E441: e.g. ``{"tp": 1}``);
* fits the model, when its shape is known: tp divides the attention heads (E425) and
  the KV heads (E426; engines that replicate KV heads also accept tp a multiple of them),
  pp divides the layers (E427); an engine that splits experts (Megatron's ``ep`` option)
  splits them as it can: ``ep`` only for a mixture of experts, dividing its experts per layer
  and ``dp``, with tp = 1 for a mixture of experts
  (:func:`~flowrl.catalog.architectures.expert_layout_problems`, read by the engine too) (E614);
* keeps each tensor-parallel group on one node (E429) (a train engine's other ranks may
  span nodes: each is a Ray actor on its own GPU's node);
* fits in memory (E428): weights, gradients, optimizer states, activations (train
  engines), or weights + workspace inside the rollout engine's reservation, with room
  for at least one sequence of KV cache (E430);

and every ``generate`` asks its rollout engine only for sampling options it takes (E438), and the
engine runs the model's architecture, and can convert this checkpoint's variant of it when it
converts weights by family (E607), and splits a model with tied word embeddings only over the axes
its record allows (E621); ``schedule auto`` reads :func:`architecture_problems`, the
``check_model_fit`` pass words the same refusals at length.

>>> from flowrl.catalog.models import tiny_facts
>>> shape_problems("m.rollout", "vllm", 3, 1, tiny_facts({}), None)[0].code  # 4 heads
'E425'
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from flowrl.catalog.adapters import lora_params
from flowrl.catalog.precision import train_bytes
from flowrl.catalog.architectures import expert_layout_problems
from flowrl.catalog.engines import ENGINES, EngineSpec, default_engine
from flowrl.catalog.models import ModelFacts
from flowrl.catalog.ops import OpKind
from flowrl.compiler.sched import LayoutSpec, model_of, role_of
from flowrl.compiler.workload import Workload, prompt_tokens, seq_len
from flowrl.cost.model import Memory, rollout_memory, train_memory
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Diagnostic, Span
from flowrl.ir.graph import FlowGraph
from flowrl.plan import EnginePlan, PoolPlan

INNER_AXES = ("tp", "pp", "cp")
"""Axes within one data-parallel replica."""


def layout_engine(key: str, placed: EnginePlan, lspec: LayoutSpec | None, facts: ModelFacts | None, hw: Profile,
                  pool: PoolPlan, work: Workload, trainable: bool, span: Span, chosen: bool = False,
                  strict: bool = True) -> tuple[EnginePlan, list[Diagnostic]]:
    """The layout of one engine on its pool, and the problems with it (empty when it fits).

    ``lspec`` None: choose one (a rollout engine gets the smallest tp that fits; anything else
    its role's default engine with dp filling the pool). ``strict`` False (the default
    schedule of a flow without a ``schedule`` block) reports no memory problems: the plan
    shows the estimate instead.
    """
    role = role_of(key)
    if lspec is None:
        if role == "rollout":
            return _choose_rollout(key, placed, facts, hw, pool, work, span, strict)
        lspec = LayoutSpec(default_engine(role).name, {}, span)
    kind, opts = lspec.kind, dict(lspec.options)
    spec = ENGINES[kind]
    par = {d: int(opts.pop(d, 1)) if d in spec.axes else 1 for d in INNER_AXES}
    dp_written = "dp" in lspec.options or "dp" not in spec.axes
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
            _fill_hint(pool.gpus, inner, key, pool.name, spec)))
    plan = replace(placed, kind=kind, options=opts, dp=dp, chosen=chosen, origin=str(span), **par)
    if problems:
        return plan, problems
    problems += platform_problems(key, spec, plan, hw, span)
    if problems:
        return plan, problems
    problems += shape_problems(key, kind, par["tp"], par["pp"], facts, span)
    problems += expert_problems(key, plan, facts, span)
    problems += node_problems(key, plan, pool, span)
    plan = replace(plan, gpus=tuple(pool.gpu_ids[:plan.world_size]), bundles=tuple(range(plan.world_size)))
    if facts is not None and not problems:
        mem = engine_memory(kind, role, plan, facts, hw, work, trainable, model_of(key))
        plan = replace(plan, memory=mem)
        if strict:
            problems += memory_problems(key, kind, role, plan, mem, facts, hw, work, span)
    return plan, problems


def _label(kind: str, par: dict, dp: int | None) -> str:
    axes = ENGINES[kind].axes
    parts = [f"{d} = {par[d]}" for d in INNER_AXES if d in axes and (d != "cp" or par[d] != 1)]
    if dp is not None and "dp" in axes:
        parts.append(f"dp = {dp}")
    return f"{kind}({', '.join(parts)})"


def label_of(plan: EnginePlan) -> str:
    """The layout as a schedule writes it: ``vllm(tp = 2, dp = 4)``."""
    return _label(plan.kind, {"tp": plan.tp, "pp": plan.pp, "cp": plan.cp}, plan.dp)


def _fill_hint(gpus: int, inner: int, key: str, pool: str, spec: EngineSpec) -> str:
    if gpus % inner == 0 and "dp" in spec.axes:
        return f"make tp x pp x dp x cp = {gpus}: dp = {gpus // inner}, or leave dp out to fill the pool"
    if gpus % inner == 0:
        return f"`{spec.name}` has no dp axis: make its parallel sizes multiply to {gpus}"
    return f"choose tp x pp x cp dividing {gpus}, or place `{key}` on another pool than `{pool}`"


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def platform_problems(key: str, spec: EngineSpec, plan: EnginePlan, hw: Profile, span: Span) -> list[Diagnostic]:
    """E440: the engine does not run on the cluster's platform; E441: a parallel size or option
    above the platform's limit (both from the record's ``platforms``)."""
    platform = hw.platform
    sup = spec.support(platform)
    where = _where(hw)
    if not sup.ok:
        return [Diagnostic("E440", f"`{key}` = {label_of(plan)}: `{spec.name}` does not run on {where}", span,
                           sup.why or f"{spec.name} runs on {', '.join(sorted(spec.platforms)) or 'no platform'}")]
    out = []
    for opt, limit in sup.limits.items():
        default = spec.options[opt].default if opt in spec.options else None
        value = getattr(plan, opt) if opt in INNER_AXES + ("dp",) else plan.options.get(opt, default)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            out.append(Diagnostic(
                "E441", f"`{key}` = {label_of(plan)}: {spec.name} on {where} runs {opt} <= {limit:g}, not {value:g}",
                span, sup.why or f"use {opt} <= {limit:g}"))
    return out


def _where(hw: Profile) -> str:
    """``cpu (cluster gpu = "cpu")`` / ``rocm (cluster gpu = "MI300X")``."""
    return f"{hw.platform} (cluster gpu = \"{hw.name}\")"


def shape_problems(key: str, kind: str, tp: int, pp: int, facts: ModelFacts | None, span: Span) -> list[Diagnostic]:
    """tp against heads and KV heads, pp against layers (nothing when the shape is unknown)."""
    if facts is None:
        return []
    out, model = [], model_of(key)
    replicates = ENGINES[kind].kv_replicates
    if facts.heads % tp:
        out.append(Diagnostic("E425", f"tp = {tp} does not divide the {facts.heads} attention heads of `{model}` "
                                      f"({facts.name})", span,
                              f"tp must divide {facts.heads}: {', '.join(map(str, _divisors(facts.heads, 64)))}"))
    elif facts.kv_heads % tp and not (replicates and tp % facts.kv_heads == 0):
        ok = _divisors(facts.kv_heads)
        if replicates:
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


def expert_problems(key: str, plan: EnginePlan, facts: ModelFacts | None, span: Span) -> list[Diagnostic]:
    """Megatron's expert-parallel layout (its ``ep`` option) for this model (E614); nothing for an engine
    without expert parallelism, a model of unknown shape, or an architecture the engine refuses (E607
    says so later)."""
    spec = ENGINES[plan.kind]
    arch = facts.architecture if facts is not None else ""
    if facts is None or "ep" not in spec.options or (arch and spec.architectures is not None
                                                      and arch not in spec.architectures):
        return []
    ep = plan.options.get("ep", spec.options["ep"].default)
    if not isinstance(ep, int):
        return []
    model = model_of(key)
    what = f"a mixture of {facts.experts} experts per layer" if facts.experts else "a dense model"
    out = []
    for option, reason in expert_layout_problems(facts.experts, tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp,
                                                 ep=ep):
        if option != "ep":
            hint = f"use {option} = 1 and split the model with ep (and pp)"
        elif facts.experts:
            hint = f"choose ep dividing both the {facts.experts} experts and dp (dp = {plan.dp})"
        else:
            hint = "use ep = 1 for a dense model"
        out.append(Diagnostic("E614", f"`{key}` = {plan.kind}(...) cannot lay out `{model}` ({what}): {reason}",
                              span, hint))
    return out


def node_problems(key: str, plan: EnginePlan, pool: PoolPlan, span: Span) -> list[Diagnostic]:
    """Each tensor-parallel group (tp consecutive ranks) must sit on one node."""
    tp = plan.tp
    if tp <= 1:
        return []
    for start in range(0, min(plan.world_size, len(pool.nodes)), tp):
        group = pool.nodes[start:start + tp]
        if len(set(group)) > 1:
            here = pool.nodes.count(group[0])
            return [Diagnostic(
                "E429", f"a tensor-parallel group of `{key}` spans nodes {group[0]} and {group[-1]}: tp = {tp}, "
                        f"but pool `{pool.name}` has {here} GPUs on node {group[0]}", span,
                "tensor parallelism needs the fast links inside a node: keep tp within a node's GPUs "
                "and use pp or dp across nodes")]
    return []


def sampling_problems(graph: FlowGraph, engines: dict[str, EnginePlan]) -> list[Diagnostic]:
    """E438: a ``generate`` option its rollout engine would refuse at the first step."""
    out = []
    for n in graph.nodes():
        e = engines.get(f"{n.model}.rollout") if n.kind == OpKind.GENERATE and n.model else None
        if e is None:
            continue
        for opt, limit in ENGINES[e.kind].sampling_limits.items():
            c = n.attr(opt)
            v = getattr(c, "value", None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limit:
                others = sorted(k for k, s in ENGINES.items() if s.serves == "rollout" and opt not in s.sampling_limits)
                out.append(Diagnostic(
                    "E438", f"`{opt} = {v}` for `{n.id}` is above {limit:g}, the most the `{e.kind}` rollout engine "
                            f"of `{n.model}` accepts", getattr(c, "span", None) or n.key_span(opt) or n.span,
                    f"use {opt} <= {limit:g}" + (f", or a rollout engine that takes any {opt}: "
                                                 + ", ".join(f"`{k}`" for k in others) if others else "")))
    return out


def runs_on(kind: str, world_size: int) -> list[EngineSpec]:
    """The engines whose code runs an engine of ``kind`` with ``world_size`` ranks: its own, and a
    single-rank engine's ``multi_rank_as`` engine when it has several (``torch(dp = 2)`` on fsdp's ranks)."""
    spec = ENGINES[kind]
    several = world_size > 1 and spec.multi_rank_as in ENGINES
    return [spec] + ([ENGINES[spec.multi_rank_as]] if several else [])


def refusing_engine(kind: str, architecture: str, world_size: int) -> EngineSpec | None:
    """The first of :func:`runs_on` whose architectures (:attr:`EngineSpec.architectures`) exclude
    ``architecture``; None when all run it (or the architecture is not known)."""
    if not architecture:
        return None
    return next((e for e in runs_on(kind, world_size)
                 if e.architectures is not None and architecture not in e.architectures), None)


def tied_axis(plan: EnginePlan, facts: ModelFacts | None) -> str | None:
    """The parallel axis of ``plan`` above 1 that its engine (or the engine its ranks run on) cannot split a
    model with tied word embeddings over (:attr:`~flowrl.catalog.engines.EngineSpec.untied_axes`), if the
    model ties them; else None."""
    if facts is None or not facts.tied or plan.role != "train":
        return None
    for engine in runs_on(plan.kind, plan.world_size):
        for axis in engine.untied_axes:
            if getattr(plan, axis, 1) > 1:
                return axis
    return None


def architecture_problems(key: str, plan: EnginePlan, facts: ModelFacts | None, span: Span) -> list[Diagnostic]:
    """E607: ``plan``'s engine does not run the model's architecture, or converts weights by family
    and cannot convert this checkpoint's variant (:attr:`~flowrl.catalog.models.ModelFacts.unconvertible`)."""
    if facts is None or not facts.architecture:
        return []
    refusing = refusing_engine(plan.kind, facts.architecture, plan.world_size)
    if refusing is not None:
        return [Diagnostic("E607", f"`{key}` = {label_of(plan)}: `{model_of(key)}` is a {facts.architecture}, which "
                                   f"`{refusing.name}` does not run", span,
                           f"`{refusing.name}` runs {', '.join(sorted(refusing.architectures))}")]
    axis = tied_axis(plan, facts)
    if axis is not None:  # E621: the search does not know the model's role; a critic's layout is skipped too
        return [Diagnostic("E621", f"`{key}` = {label_of(plan)}: `{model_of(key)}` ties its output layer to its word "
                                   f"embedding, which `{plan.kind}` runs only with {axis} = 1", span,
                           f"give `{key}` {axis} = 1")]
    converting = next((e for e in runs_on(plan.kind, plan.world_size) if e.converts_weights), None)
    if converting is not None and facts.unconvertible:
        return [Diagnostic("E607", f"`{key}` = {label_of(plan)}: `{converting.name}` cannot convert `{model_of(key)}`: "
                                   f"{facts.unconvertible}", span,
                           "use an engine that runs the checkpoint with transformers' code")]
    return []


def engine_memory(kind: str, role: str, plan: EnginePlan, facts: ModelFacts, hw: Profile, work: Workload,
                  trainable: bool, model: str) -> Memory:
    """Estimated memory per GPU of one engine (see flowrl.cost.model)."""
    spec = ENGINES[kind]
    max_tokens = work.max_tokens.get(model) or _base_max_tokens(work)
    seq = seq_len(facts, max_tokens)
    if role == "rollout":
        gen = work.gen_of(model)
        per_replica = -(-gen.samples // max(plan.dp, 1)) if gen else 1
        return rollout_memory(facts, hw, kind, tp=plan.tp, options=plan.options, seq_len=seq, batch=per_replica)
    mb = micro_batch(spec, plan.options, work.micro_batch.get(model, 8))
    samples = max((g.samples for g in work.gens), default=mb)
    n_micro = max(1, samples // max(plan.dp * mb, 1))
    budget = work.micro_batch_tokens.get(model, 0) if spec.token_batches else 0
    if budget:  # a micro-batch holds at most the budget's token slots, or one longer sequence alone
        mb, seq = 1, max(budget, seq)  # (flowrl.engines.batching.micro_batches)
    offload = spec.memory_model.offload_option
    lora = work.lora.get(model)  # LoRA: only the adapters have gradients and optimizer states
    precision = work.precision.get(model)  # a flow naming the model's dtype: its bytes, not the profile's
    return train_memory(facts, hw, kind, tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp,
                        ep=int(plan.options.get("ep", 1)), trainable=trainable,
                        micro_batch=mb, seq_len=seq, offload=bool(plan.options.get(offload, False)) if offload else False,
                        n_micro=n_micro, trained_params=lora_params(facts, *lora) if lora else None,
                        param_bytes=train_bytes(*precision) if precision else None)


def lora_engine_problem(model: str, role: str, plan: EnginePlan, r: int,
                        facts: ModelFacts | None = None) -> tuple[str, str] | None:
    """Why ``model``'s ``role`` engine (``plan``) cannot take its LoRA of rank ``r`` (message, hint), or None:
    the engine that runs the layout (a single-rank engine with more ranks runs on its ``multi_rank_as``)
    must train adapters (``train``) or serve them (``adapters``, ``merged``), within its largest rank, and
    of a mixture of experts (``facts``) serve them unless its record says why not (``lora_experts_refused``)."""
    spec = ENGINES[plan.kind]
    runs = ENGINES[spec.multi_rank_as] if spec.multi_rank_as and plan.world_size > 1 else spec
    wanted = ("train",) if role == "train" else ("adapters", "merged")
    key = f"{model}.{role}"
    if runs.lora not in wanted:
        able = sorted(k for k, e in ENGINES.items() if e.serves == spec.serves and e.lora in wanted)
        via = f" (with {plan.world_size} ranks it runs on `{runs.name}`'s)" if runs is not spec else ""
        why = f": {runs.lora_refused}" if runs.lora_refused else ""
        one_rank = {k for k in able if ENGINES[k].multi_rank_as and ENGINES[ENGINES[k].multi_rank_as].lora not in wanted}
        return (f"`{model}` trains LoRA adapters, but its {role} engine `{plan.kind}`{via} cannot "
                + ("train them" if role == "train" else "serve them") + why,
                f"give `{key}` " + " or ".join(f"`{k}(...)`" + (" with one rank" if k in one_rank else "")
                                             for k in able) + ", or drop `lora` to train the full weights")
    if runs.lora_max_rank is not None and r > runs.lora_max_rank:
        return (f"`lora` of `{model}` has rank r = {r}, above the {runs.lora_max_rank} its {role} engine "
                f"`{plan.kind}` loads adapters of", f"use r <= {runs.lora_max_rank}")
    if facts is not None and facts.experts and runs.lora_experts_refused:
        merged = sorted(k for k, e in ENGINES.items() if e.serves == spec.serves and e.lora == "merged")
        return (f"`{model}` is a mixture of experts ({facts.experts} experts) with LoRA adapters, which its {role} "
                f"engine `{plan.kind}` cannot serve: {runs.lora_experts_refused}",
                f"give `{key}` " + " or ".join(f"`{k}(...)`" for k in merged) + " (they get the adapters merged "
                "into the base weights)")
    return None


def micro_batch(spec: EngineSpec, options: dict, update_micro_batch: int) -> int:
    """Sequences per micro-batch: the engine's own ``micro_batch`` option when its record has one
    (Megatron's), else the update's."""
    if "micro_batch" in spec.options:
        return int(options.get("micro_batch", spec.options["micro_batch"].default))
    return update_micro_batch


def _base_max_tokens(work: Workload) -> int:
    return max((g.max_tokens for g in work.gens), default=64)


def memory_problems(key: str, kind: str, role: str, plan: EnginePlan, mem: Memory, facts: ModelFacts, hw: Profile,
                    work: Workload, span: Span) -> list[Diagnostic]:
    cap = hw.hbm_gb
    spec = ENGINES[kind]
    label = _label(kind, {"tp": plan.tp, "pp": plan.pp, "cp": plan.cp}, plan.dp)
    if role == "rollout":
        reserved = spec.memory_model.kv_cache == "reserved"
        fixed_kv = reserved and hw.platform == "cpu" and spec.cpu_kv_cache_gib is not None
        if fixed_kv:  # its KV cache is a fixed size in host memory (the record's cpu_kv_cache_gib)
            if mem.total_gb > cap:
                return [_too_big(key, label, mem, hw, span, "raise tp (it shards the weights; the KV cache is "
                                                            f"{spec.cpu_kv_cache_gib} GiB per rank on cpu)")]
            reserved = False  # the KV check below, with a hint that does not name the memory option
        if reserved and mem.weights_gb + mem.other_gb > mem.reserved_gb:
            knob = spec.memory_option
            share = plan.options.get(knob, spec.options[knob].default)
            return [Diagnostic(
                "E428", f"`{key}` = {label} needs {mem.weights_gb:.1f} GB of weights + {mem.other_gb:.1f} GB "
                        f"workspace per GPU, more than {knob} {share:g} x {cap:g} GB = {mem.reserved_gb:.1f} GB",
                span, f"raise tp (tp = {_min_tp(facts, hw, mem, plan)} would fit) or {knob}")]
        if not reserved and not fixed_kv and mem.total_gb > cap:
            return [_too_big(key, label, mem, hw, span, "raise dp (fewer requests per replica) or lower max_tokens")]
        max_tokens = work.max_tokens.get(model_of(key)) or _base_max_tokens(work)
        seq = seq_len(facts, max_tokens)
        if (reserved or fixed_kv) and mem.kv_tokens < seq:
            raise_ = "tp" if fixed_kv else f"{spec.memory_option} or tp"
            return [Diagnostic(
                "E430", f"the KV cache of `{key}` = {label} holds {mem.kv_tokens} tokens per GPU, less than one "
                        f"sequence of {seq} tokens (prompt {prompt_tokens(facts)} + max_tokens {max_tokens})", span,
                f"raise {raise_}, or lower max_tokens")]
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
    """The smallest tp (dividing the pool, within a node, fitting the model, the platform and memory)
    of the default rollout engine for an unlaid-out rollout engine; tp = 1 with its problems when
    none fits."""
    kind = default_engine("rollout").name
    per_node = max(Counter(pool.nodes).values(), default=1)  # one pass: a pool may hold 10^5 GPUs
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


__all__ = ["layout_engine", "shape_problems", "node_problems", "platform_problems",
           "memory_problems", "engine_memory", "sampling_problems", "label_of", "micro_batch"]
