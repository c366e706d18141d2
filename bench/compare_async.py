"""The async comparison, simulated: sync vs one-step-off vs bounded async vs partial rollout.

For a model on a GPU cluster with long-tailed response lengths, each mode gets its best
schedule from ``schedule auto``'s search restricted to that mode, and the simulator's step
time and rollout throughput are set against the published anchors (AReaL, veRL, NeMo-RL,
APRIL). Used by ``bench/async.py`` and ``bench/plan_search.py`` (``sys.path`` holds
``bench/`` when they run); pure Python: the flow is compiled for real, no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.compiler.lower import lower  # noqa: E402
from flowrl.compiler.pipeline import compile_text  # noqa: E402
from flowrl.compiler.schedule.estimate import build_sim  # noqa: E402
from flowrl.compiler.workload import workload  # noqa: E402
from flowrl.cost.sim import simulate  # noqa: E402
from flowrl.ir.graph import FlowGraph  # noqa: E402

ANCHORS = {
    "AReaL": "2.77x step throughput from fully asynchronous RL over synchronous (AReaL, 2025)",
    "veRL": "2.35-2.67x from asynchronous / one-step-off pipelines over synchronous (veRL recipes)",
    "NeMo-RL": "111 s -> 64 s per step with one-step-off (1.73x) (NeMo-RL)",
    "APRIL": "+22.5% rollout throughput from partial rollouts (APRIL)",
}


def compare_async(model: str = "Qwen/Qwen2.5-7B", gpus: int = 64, gpu: str = "H100", *, gpus_per_node: int = 8,
                  batch: int = 512, group: int = 8, max_tokens: int = 8192, median: float | None = None,
                  sigma: float = 1.0, over_provision: float = 1.5, steps: int = 10, seed: int = 0) -> list[dict]:
    """The async comparison of the issue, simulated: sync vs one-step-off vs bounded async (s=4)
    vs partial rollout, for ``model`` on ``gpus`` GPUs with long-tailed response lengths.

    Each mode gets its best schedule from ``schedule auto``'s search restricted to that mode
    (sync: staleness 1; one-step-off: 2; bounded: 4; partial: staleness 2 +
    ``partial_rollout(over_provision)``). Returns one dict per mode: ``mode``, ``step_s``,
    ``speedup`` (vs sync), ``rollout_tokens_per_s`` and ``rollout_gain`` (generated tokens per
    second of generation time, APRIL's metric, vs sync), ``bubble``, ``schedule`` (a one-line
    summary), and the published ``anchor`` it compares with. Imports the compiler (the flow is
    compiled for real); no torch.
    """
    return async_modes(model=model, gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node, batch=batch, group=group,
                       max_tokens=max_tokens, median=median, sigma=sigma, over_provision=over_provision,
                       steps=steps, seed=seed, anchors=ANCHORS)


ASYNC_MODES = (
    ("sync", {"staleness": (1,)}, None),
    ("one-step-off", {"staleness": (2,)}, None),
    ("bounded async (s=4)", {"staleness": (4,)}, None),
    ("partial rollout", {"staleness": (2,)}, "partial"),
)
ANCHOR_OF = {"sync": "", "one-step-off": "NeMo-RL", "bounded async (s=4)": "AReaL", "partial rollout": "APRIL"}


def async_modes(*, model: str, gpus: int, gpu: str, gpus_per_node: int, batch: int, group: int, max_tokens: int,
                median: float | None, sigma: float, over_provision: float, steps: int, seed: int,
                anchors: dict) -> list[dict]:
    """See :func:`compare_async`."""
    nodes = max(1, gpus // gpus_per_node)
    per = min(gpus, gpus_per_node)
    lengths = {"median": median} if median else {}
    lengths["sigma"] = sigma
    rows = []
    base = None
    for mode, auto_opts, extra in ASYNC_MODES:
        partial = f"\n  partial_rollout(over_provision = {over_provision:g})" if extra else ""
        text = ASYNC_FLOW.format(model=model, batch=batch, group=group, max_tokens=max_tokens, nodes=nodes,
                                 per=per, gpu=gpu, limit=max(auto_opts["staleness"]), partial=partial)
        graph = compile_text(text, "<compare_async>", options={
            "auto": {**auto_opts, "sim_steps": steps}, "sim_steps": steps, "lengths": lengths})
        plan = lower(graph)
        est = plan.estimate
        gen_s = est.breakdown.get("generate", 0.0)
        gen_tps = _rollout_tps(graph)
        row = {"mode": mode, "step_s": est.step_s, "samples_per_s": est.samples_per_s,
               "tokens_per_s": est.tokens_per_s, "generate_s": gen_s, "rollout_tokens_per_s": gen_tps,
               "bubble": est.bubble, "schedule": plan.search.winner.summary if plan.search else "",
               "anchor": anchors.get(ANCHOR_OF[mode], "")}
        if base is None:
            base = row
        row["speedup"] = round(base["step_s"] / row["step_s"], 3) if row["step_s"] else 0.0
        row["rollout_gain"] = round(row["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3) \
            if base["rollout_tokens_per_s"] else 0.0
        rows.append(row)
    return rows


def _rollout_tps(graph: FlowGraph) -> float:
    """Rollout throughput per rollout GPU (APRIL's metric, per GPU so that pools of different sizes
    compare): generated tokens per GPU-second the rollout engine had. A pool of its own has the
    whole wall time; colocated GPUs have only the generate phases."""
    st = graph.sched
    spec, _c, _l, _d = build_sim(graph, st, workload(graph))
    res = simulate(spec, steps=st.estimate.assumptions.get("steps_simulated", 6), seed=0)
    gen = next((p for p in spec.phases if p.kind == "generate"), None)
    if gen is None or not spec.lanes.get(gen.lane):
        return 0.0
    shared = any(p.lane == gen.lane and p.kind != "generate" for p in spec.phases)
    wall_share = res.breakdown.get("generate", 0.0) / res.step_s if shared and res.step_s else 1.0
    return res.gen_tokens_per_s / max(wall_share, 1e-12) / spec.lanes[gen.lane]


ASYNC_PROGRAM = '''
model policy = hf("{model}")
dataset prompts = jsonl("prompts.jsonl")
reward correct = verifier("math")

flow main() {{
  ref      = frozen(policy)
  b        = sample(prompts, size = {batch})
  rollouts = generate(policy, b, n = {group}, max_tokens = {max_tokens})
  scores   = correct(rollouts)
  old_lp   = logprobs(policy, rollouts)
  ref_lp   = logprobs(ref, rollouts)
  adv      = group_advantage(scores, group = {group})
  update(policy, rollouts, adv, old_lp, ref_lp, kl = 0.001)
}}
'''
"""The GRPO program of the async comparison (format fields: model, batch, group, max_tokens)."""

ASYNC_FLOW = ASYNC_PROGRAM + '''
schedule main auto on cluster(nodes = {nodes}, gpus_per_node = {per}, gpu = "{gpu}") {{
  staleness <= {limit}{partial}
}}
'''


__all__ = ["ANCHORS", "ASYNC_PROGRAM", "ASYNC_FLOW", "compare_async", "async_modes"]
