"""The human view of an ExecutionPlan (``flowrl plan``): which engine runs on which GPUs, and how.

Sections, in order: the cluster and staleness; the inputs (hub models read from the local
cache, and whether each dataset's prompts are raw text or rendered by a chat template); the engines (a table: engine, layout, pool,
GPUs, share of each GPU, memory per GPU); a picture of the GPU grid (one letter per
engine on each GPU, one row per node); the pools; the step's ops in order with their
estimated times; weight sync (protocol and why, route, bucket plan, resharding);
staleness (steps in flight, buffer, partial rollout); the estimated step (time,
throughput, bubble, a bar per phase, the modulo-schedule bounds, memory per GPU and the
memory phases of shared GPUs (which engine sleeps or offloads when, each phase's peak),
utilisation, assumptions); and, with ``explain=True``, what ``schedule auto`` searched
(the winner as a schedule block, the runners-up, what it rejected and why).

Plain text, no colour, deterministic for a given plan.
"""

from __future__ import annotations

import os
import string

from flowrl.catalog.engines import ENGINES
from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.reshard import rank_elements, rank_shardable
from flowrl.compiler.sched import engine_label
from flowrl.compiler.schedule.placement import ranges
from flowrl.plan import EnginePlan, ExecutionPlan, PoolMemory

BAR = 32
"""Width of the longest bar in the step-time breakdown."""


def describe_plan(plan: ExecutionPlan, explain: bool = False) -> str:
    """The text of ``flowrl plan`` (``explain``: add the auto search's report)."""
    out: list[str] = []
    for section in (_header, _inputs, _engines, _grid, _pools, _envs, _steps, _sync, _staleness, _estimate):
        lines = section(plan)
        if lines:
            out += lines + [""]
    if explain:
        out += _search(plan) + [""]
    r = plan.run
    out.append(f"run: steps={r.steps} seed={r.seed} eval_every={r.eval_every} save_every={r.save_every}"
               + (f" log={','.join(r.log)}" if getattr(r, "log", ()) else "")
               + (f" log_samples={r.log_samples}" if getattr(r, "log_samples", 0) else ""))
    return "\n".join(out) + "\n"


def _engines_of(plan: ExecutionPlan) -> list[tuple[str, EnginePlan, str]]:
    out = []
    for m in plan.models:
        lora = m.args.get("lora")
        what = m.role + (f" (LoRA r={lora['r']}: {', '.join(lora['targets'])})" if lora else "")
        for e in (m.train_engine, m.rollout_engine):
            if e is not None:
                out.append((f"{m.id}.{e.role}", e, what))
    return out


def _header(plan: ExecutionPlan) -> list[str]:
    c = plan.cluster
    s = plan.staleness
    mode = "synchronous" if s == 1 else ("async: one-step-off" if s == 2 else f"async: bounded, {s} steps in flight")
    how = ("chosen by `schedule auto`" if plan.auto else "as scheduled" if plan.scheduled
           else "the default schedule (the file has no `schedule` block)")
    return [f"plan for flow `{plan.flow}` ({plan.source})",
            f"cluster: {c['nodes']} node(s) x {c['gpus_per_node']} GPU(s) ({c['gpu']}); "
            f"staleness {s} ({mode}); {how}"]


def _inputs(plan: ExecutionPlan) -> list[str]:
    """Where hub models come from and how each dataset's prompts are read (raw, or a chat template)."""
    gen = next((op.model for op in plan.ops if op.kind == OpKind.GENERATE), None)
    lines = [f"  {m.id}: `{m.args['hub_id']}` from the local Hugging Face cache (offline)"
             for m in plan.models if m.args.get("hub_id")]
    for d in plan.datasets:
        if d.parts:
            weights = d.weights or tuple(1.0 for _ in d.parts)
            total = sum(weights) or 1.0
            lines.append(f"  {d.id}: mix of " + ", ".join(f"{p} ({w / total:.0%})" for p, w in zip(d.parts, weights)))
            continue
        how = (f"chat messages rendered with the chat template of `{gen}`'s tokenizer (add_generation_prompt)"
               if d.chat else
               f"rendered with the chat template of `{gen}`'s tokenizer where it has one, else raw text"
               if d.chat_auto else "raw text (with the tokenizer's BOS where it has one)")
        made = (" written by the template" if d.template else "") + (" after a system prompt" if d.system else "")
        streamed = " (streamed)" if d.options.get("stream") == "on" else ""
        lines.append(f"  {d.id}: {d.format} {os.path.basename(d.path)}{streamed}: prompts{made} as {how}")
    return ["inputs:"] + lines if lines else []


def _gpus(ids) -> str:
    return ranges(ids) if ids else "-"


def _layout(e: EnginePlan) -> str:
    return engine_label(e) + (" (chosen)" if e.chosen else "")


def _engines(plan: ExecutionPlan) -> list[str]:
    rows = [("engine", "layout", "pool", "GPUs", "GPU/rank", "memory/GPU", "model")]
    for key, e, role in _engines_of(plan):
        mem = _bytes(e.memory.total_gb * 1e9) if e.memory is not None else "?"
        rows.append((key, _layout(e), e.pool, _gpus(e.gpus), f"{e.gpus_per_rank:.3g}", mem, role))
    return ["engines:"] + _table(rows)


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _grid(plan: ExecutionPlan) -> list[str]:
    engines = _engines_of(plan)
    if not engines:
        return []
    letters = {key: string.ascii_uppercase[i % 26] for i, (key, _e, _r) in enumerate(engines)}
    per = int(plan.cluster["gpus_per_node"])
    nodes = int(plan.cluster["nodes"])
    on: dict[int, str] = {}
    for key, e, _r in engines:
        for g in e.gpus:
            on[g] = on.get(g, "") + letters[key]
    width = max((len(v) for v in on.values()), default=1)
    lines = ["GPU grid (" + ", ".join(f"{l} = {k}" for k, l in letters.items()) + "):"]
    shown = nodes if nodes <= 16 else 8
    for n in range(shown):
        cells = [f"[{on.get(n * per + i, '.').ljust(width)}]" for i in range(per)]
        if per > 16:
            cells = cells[:8] + [f"... {per - 16} more ..."] + cells[-8:]
        lines.append(f"  node {n:<3} " + " ".join(cells))
    if shown < nodes:
        lines.append(f"  ... {nodes - shown} more nodes: "
                     + "; ".join(f"{p.name}: GPUs {_gpus(p.gpu_ids)}" for p in plan.pools))
    return lines


def _pools(plan: ExecutionPlan) -> list[str]:
    rows = [("pool", "GPUs", "nodes", "Ray strategy", "engines")]
    for p in plan.pools:
        nodes = sorted(set(p.nodes))
        rows.append((p.name, f"{p.gpus} ({_gpus(p.gpu_ids)})", _gpus(nodes), p.strategy, ", ".join(p.engines) or "-"))
    return ["pools:"] + _table(rows)


def _envs(plan: ExecutionPlan) -> list[str]:
    """Each environment's pool: its class, workers and why (``size_env_pools``)."""
    if not plan.envs:
        return []
    return ["environments:"] + [f"  {e.id}: {e.kind}(\"{e.options.get('target', '')}\"), {e.options['workers']} "
                                f"worker{'s' if e.options['workers'] != 1 else ''} ({e.workers_why}), "
                                f"timeout {e.options.get('timeout', 0):g} s "
                                f"{'an episode' if getattr(OPS.get(e.kind), 'protocol', None) else 'a call'}"
                                for e in plan.envs]


def _steps(plan: ExecutionPlan) -> list[str]:
    costs = {o.id: o for o in plan.estimate.ops} if plan.estimate else {}
    lines = ["step (in order):"]
    for op in plan.ops:
        where = f"{op.model}.{'rollout' if op.engine == 'rollout' and op.kind != OpKind.RESYNC else 'train'}" \
            if op.model and op.engine in ("rollout", "train") else (op.engine or "driver")
        cost = costs.get(op.id)
        est = f"  ~{_s(cost.seconds)}" if cost is not None else ""
        if cost is not None and op.kind == OpKind.SCORE and cost.where != where:  # a reward model's, a judge's
            where += f" (its pass on {cost.where})"
        if op.options.get("adapters") == "off":  # flowrl.compiler.passes.share_base_weights
            where += f" (adapters off: `{op.options['reference']}` is its base, no copy)"
        lines.append(f"  {op.id:<28} {op.op:<16} on {where}{est}")
        for arg, dropped in sorted(op.options.get("elided", {}).items()):
            why = _ELIDED_WHY.get(arg, "nothing reads it")
            lines.append(f"  {'':<28} (elided `{dropped}`: {why})")
    return lines


_ELIDED_WHY = {
    "old": "old log-probs from the update's own forward: with one optimiser step on the batch they are "
           "the same numbers",
    "ref_logprobs": "kl = 0: the update never reads the reference's log-probs",
}
"""Update argument -> why lowering dropped the pass that fed it (the ``elide_logprobs`` pass)."""


def _s(x: float) -> str:
    if x >= 100:
        return f"{x:.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _sync(plan: ExecutionPlan) -> list[str]:
    if not plan.resyncs:
        return []
    lines = ["weight sync:"]
    for r in plan.resyncs:
        size = f"buckets of {_bytes(r.bucket_bytes)}" if r.bucket_bytes else "whole files"
        lines.append(f"  {r.model}: {r.protocol} after `{r.after}` every {r.every} step(s), {size}, checksummed")
        lines.append(f"    why: {r.reason}")
        lines.append(f"    route: {r.route or '?'} over {r.transport or '?'}"
                     + ("; packing and sending overlap the next generation" if r.overlap else ""))
        if r.total_bytes:
            lines.append(f"    buckets: {_bytes(r.total_bytes)} in {r.buckets} bucket(s); largest tensor "
                         f"{r.largest_tensor} ({_bytes(r.largest_bytes)})"
                         + (" is split across buckets" if r.bucket_bytes and r.largest_bytes > r.bucket_bytes else "")
                         + f"; ~{_s(r.seconds)} per resync")
        if r.reshard is not None:
            acts: dict[str, int] = {}
            for t in r.reshard.tensors:
                acts[t.action] = acts.get(t.action, 0) + 1
            pieces = sum(len(t.pieces) for t in r.reshard.tensors)
            lines.append(f"    reshard {r.reshard.src} -> {r.reshard.dst}: "
                         + ", ".join(f"{a} x{n}" for a, n in sorted(acts.items()))
                         + f" tensor families; {pieces} pieces (rows of a train rank that a rollout rank needs, those of "
                         "layer tensors per layer); " + _delivery(plan, r))
            for t in r.reshard.tensors:
                if t.action == "regroup":
                    lines.append(f"      regroup {t.name}: {' + '.join(p.rsplit('.', 2)[-2] for p in t.parts)} "
                                 f"({t.src_shards} -> {t.dst_shards} shards)")
    return lines


def _delivery(plan: ExecutionPlan, r) -> str:
    """What the runtime executes of ``r``'s reshard plan, with the bytes each rollout rank is given."""
    model = next((m for m in plan.models if m.id == r.model), None)
    rollout = model.rollout_engine if model is not None else None
    facts = (model.facts or {}) if model is not None else {}
    params = facts.get("params")
    if rollout is None or r.reshard.dst_tp < 2 or not ENGINES[rollout.kind].rank_shards or not params \
            or not rank_shardable(facts):
        return "each replica is sent whole tensors, its engine shards them"
    per = [n * r.total_bytes / params for n in rank_elements(r.reshard)]
    return (f"each replica is sent whole tensors, then each of its {len(per)} ranks only its shards: "
            f"{_bytes(max(per))} per rank, {_bytes(sum(per))} in all")


def _staleness(plan: ExecutionPlan) -> list[str]:
    p = plan.pipeline
    if p is None:
        return []
    lines = [f"staleness: {p.in_flight} step(s) in flight; trained samples at most {p.max_version_lag} version(s) "
             f"behind; buffer {p.buffer_samples} samples ({p.samples_per_step} per step)"]
    if p.over_provision > 1:
        lines.append(f"  partial rollout: {p.requests_per_step} requests per step ({p.over_provision:g}x), stop at "
                     f"{p.samples_per_step}; unfinished ones are " + ("recycled" if p.recycle else "dropped"))
    return lines


def _estimate(plan: ExecutionPlan) -> list[str]:
    e = plan.estimate
    if e is None or e.step_s <= 0:
        return []
    lines = [f"estimated step ({e.profile}):",
             f"  {_s(e.step_s)} per step: {e.samples_per_s:.4g} samples/s, {e.tokens_per_s:.4g} tokens/s; "
             f"bubble {e.bubble:.0%}"]
    top = max(e.breakdown.values(), default=0.0) or 1.0
    for name, secs in sorted(e.breakdown.items(), key=lambda kv: -kv[1]):
        bar = "#" * max(1, round(BAR * secs / top)) if secs > 0 else ""
        lines.append(f"  {name:<12} {_s(secs):>9}  {bar}")
    b = e.bounds
    if b:
        lines.append(f"  bounds: busiest pool {_s(b.get('resource_s', 0))}; weight cycle {_s(b.get('cycle_s', 0))} / "
                     f"staleness {plan.staleness} = {_s(b.get('recurrence_s', 0))}")
    phases = {m.pool: m for m in plan.memory}
    for pool, m in e.memory.items():
        lines.append(f"  memory per GPU, pool {pool}: peak {_bytes(m['peak_gb'] * 1e9)} of {m['capacity_gb']:g} GB "
                     f"({m['engines']})")
        if pool in phases:
            lines += _phases(phases[pool])
    shared = {op.options["reference"]: op.model for op in plan.ops if op.options.get("adapters") == "off"}
    lines += [f"  no weights of `{ref}`: its passes run on {base}.train with the LoRA adapters off (its base)"
              for ref, base in sorted(shared.items())]
    if e.utilization:
        lines.append("  utilisation: " + ", ".join(f"{k} {v:.0%}" for k, v in e.utilization.items()))
    a = e.assumptions
    if a:
        why = a.get("response_source", {})
        dists = "; ".join(f"{op}: {_dist(d)}" + (f" ({why[op]})" if op in why else "")
                          for op, d in a.get("response_lengths", {}).items())
        sources = a.get("prompt_source", {})
        prompts = "; ".join(dict.fromkeys(
            f"{v:g} tokens" + (f" ({sources[op]})" if op in sources else "")
            for op, v in a.get("prompt_tokens", {}).items()))
        lines.append(f"  workload: prompts of {prompts or '? tokens'}; responses {dists or '-'}; "
                     f"{a.get('steps_simulated')} steps simulated (seed {a.get('seed')})")
    lines += [f"  note: {n}" for n in e.notes]
    return lines


_RELEASED = {"sleep": "asleep", "offload": "offloaded"}


def _phases(m: PoolMemory) -> list[str]:
    """The pool's memory phases: what runs, what gave its memory back, each phase's peak."""
    if not m.turns:
        if len(m.engines) < 2:
            return []
        return ["    engines resident together (they do not take turns on these GPUs): "
                + " + ".join(m.engines)]
    out = ["    engines take turns:"]
    for ph in m.phases:
        parts = [f"runs {', '.join(ph.active)}"]
        if ph.released:
            parts.append(", ".join(f"{k} {_RELEASED.get(how, how)}" for k, how in ph.released))
        if ph.resident:
            parts.append(f"{', '.join(ph.resident)} resident")
        out.append(f"      {ph.name:<9} {_bytes(ph.peak_gb * 1e9):>9}: " + "; ".join(parts))
    return out


def _dist(d: dict) -> str:
    shape = f"sigma {d['sigma']:g}" if d.get("kind") == "lognormal" else f"alpha {d.get('alpha', 0):g}"
    return (f"{d.get('kind')} (mean {d.get('mean', 0):.3g}, median {d.get('median', 0):.3g}, {shape}) "
            f"capped at {d.get('cap')}")


def _search(plan: ExecutionPlan) -> list[str]:
    r = plan.search
    if r is None:
        return ["search: none: the schedule was written by hand (write `schedule NAME auto` to have it chosen)"]
    lines = [f"schedule auto: {r.considered} candidate(s) considered, {r.feasible} feasible, {r.simulated} simulated, "
             f"in {r.seconds:.3g} s (staleness <= {r.staleness_limit})",
             f"  winner: {r.winner.summary}",
             f"    {_s(r.winner.step_s)} per step, {r.winner.samples_per_s:.4g} samples/s, bubble {r.winner.bubble:.0%}",
             f"    {r.winner.why}",
             "    as a schedule:"]
    lines += ["      " + l for l in r.winner.schedule.splitlines()]
    if r.engines:
        lines.append("  engines (every one the catalogue has for the flow's roles):")
        width = max(len(v.engine) for v in r.engines)
        for v in r.engines:
            took = f" ({_s(v.seconds)} per step at best)" if v.verdict in ("chosen", "feasible") else ""
            lines.append(f"    {v.role:<8} {v.engine:<{width}}  {v.verdict}{took}: {v.why}")
    if r.runners_up:
        lines.append("  runners-up:")
        for c in r.runners_up:
            lines.append(f"    {c.rank}. {c.summary}")
            lines.append(f"       {_s(c.step_s)} per step, {c.samples_per_s:.4g} samples/s: {c.why}")
    if r.rejected:
        lines.append("  rejected:")
        for reason, n in r.rejected.items():
            lines.append(f"    {n:>6}  {reason}")
            lines.append(f"            e.g. {r.examples.get(reason, '')}")
    return lines


__all__ = ["describe_plan"]
