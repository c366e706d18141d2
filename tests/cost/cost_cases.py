"""Shared data and helpers of the cost-model tests (a module of its own: test folders' conftest
modules share one name, so tests must not import from them)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"

# One step of a synthetic run of TEST_FLOW, in seconds from the step's start:
# (op id, start, end, engine span name or None, engine start, engine end). The engine span
# starts 5 ms into its op and ends 5 ms before it: the dispatch overhead is 10 ms per op.
STEP_OPS = (
    ("grpo.prompt_batch", 0.000, 0.004, None, 0, 0),
    ("grpo.rollouts", 0.004, 0.304, "generate[0]", 0.009, 0.299),
    ("grpo.scores", 0.304, 0.306, None, 0, 0),
    ("grpo.old_lp", 0.306, 0.386, "forward:policy", 0.311, 0.381),
    ("grpo.ref_lp", 0.386, 0.466, "forward:grpo.ref", 0.391, 0.461),
    ("grpo.adv", 0.466, 0.468, None, 0, 0),
    ("grpo.update", 0.468, 0.668, "train:policy", 0.473, 0.663),
    ("resync.policy", 0.668, 0.718, "resync:policy", 0.670, 0.716),
)
STEP_S = 0.718

TEST_FLOW = """import stdlib.grpo

model policy = tiny(task = "arith")
dataset arith = jsonl("{ROOT}/data/arith/train.jsonl", prompt = "prompt", answer = "answer")
reward exact = verifier("math")

flow main() {
  grpo(policy, arith, exact, batch = 64, group = 8, max_tokens = 8, kl = 0.01, micro_batch = 128)
}

schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  colocate policy.train, policy.rollout, ref on all
  policy.train = torch(dp = 1)
  policy.rollout = vllm(tp = 1)
  staleness 1
  resync policy via inplace() every 1
}
"""
"""GRPO on the arithmetic task, colocated, with a KL term (so the reference's log-prob pass
stays): the tests' own copy, so that edits to flows/ do not move their expectations."""


def write_synthetic_run(out: Path, flow_file: str, steps: int = 4, slow_step: int | None = None) -> Path:
    """A run directory of ``flow_file`` (:data:`TEST_FLOW`) as ``flowrl run`` writes it (plan.json,
    metrics.jsonl, trace.json) with the timings of :data:`STEP_OPS` every step; ``slow_step``
    takes 3x as long (a noisy step the medians must ignore)."""
    from flowrl.launch import build_plan

    out.mkdir(parents=True, exist_ok=True)
    plan = build_plan(flow_file, steps=steps)
    (out / "plan.json").write_text(plan.to_json())
    events, rows, t = [], [], 10.0
    for k in range(steps):
        scale = 3.0 if k == slow_step else 1.0
        row = {"step": k + 1, "perf/step_s": STEP_S * scale, "perf/gen_tokens": 512 * 3.5}
        for op, s0, s1, inner, i0, i1 in STEP_OPS:
            events.append({"name": op, "ph": "X", "pid": 1, "tid": 1, "ts": (t + s0 * scale) * 1e6,
                           "dur": (s1 - s0) * scale * 1e6, "args": {"step": k + 1}})
            row[f"time/{op}"] = (s1 - s0) * scale
            if inner:
                events.append({"name": inner, "ph": "X", "pid": 1, "tid": 2, "ts": (t + i0 * scale) * 1e6,
                               "dur": (i1 - i0) * scale * 1e6, "args": {"step": k + 1}})
        rows.append(row)
        t += STEP_S * scale
    events.append({"name": "eval", "ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 5e6, "args": {"step": 0}})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "trace.json").write_text(json.dumps({"traceEvents": events}))
    return out
