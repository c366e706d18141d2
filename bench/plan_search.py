"""`schedule auto` at scale: search time and the chosen plan's simulated throughput vs hand-written schedules.

For clusters of 8, 64, 512 and 1,024 H100s (8 per node) it compiles a GRPO flow on a
Qwen2.5-7B policy (with a frozen reference; 4 prompts x 8 completions per GPU per step,
up to 4,096 response tokens, long-tailed lengths) under ``schedule main auto { staleness <= 2 }``
and reports

* the search time (the ``SearchReport``'s, and the whole compilation's), candidates
  considered / feasible / simulated, the winner;
* the winner's simulated step time and samples/s against the hand-written schedules of
  ``flows/``, scaled to the cluster: ``grpo_megatron_8gpu`` (colocated, Megatron tp 2,
  vLLM tp 1, staleness 2), ``grpo_disaggregated`` (half the GPUs generate, FSDP on the
  other half, staleness 2) and ``arith_grpo`` (colocated, plain torch, vLLM, synchronous),
  each estimated by the same simulator (a baseline that does not fit is reported with its
  diagnostic: on several nodes the scaled baselines put a train engine, whose ranks one Ray
  actor forks, on GPUs of several nodes, E442);

then the async comparison of the issue (``bench/compare_async.py``): a 7B model on 64
H100s with long-tailed lengths, synchronous vs one-step-off vs bounded async (s = 4) vs
partial rollout, next to the published anchors (AReaL, veRL, NeMo-RL, APRIL).

Prints tables and writes ``bench/results/plan_search.json``. Pure Python; no GPU needed.

Usage::

    .venv/bin/python bench/plan_search.py [--sizes 8,64,512,1024] [--out PATH] [--no-async]

Targets: search under 5 s at 1,024 GPUs; the auto plan at least as fast as every
hand-written one that fits.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.compiler.lower import lower  # noqa: E402
from flowrl.compiler.pipeline import compile_text  # noqa: E402
from flowrl.diagnostics import FlowError  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from compare_async import ANCHORS, ASYNC_PROGRAM, compare_async  # noqa: E402

MODEL = "Qwen/Qwen2.5-7B"
PROMPTS_PER_GPU = 4
GROUP = 8
MAX_TOKENS = 4096

FLOW = ASYNC_PROGRAM  # each row adds its own schedule

CLUSTER = 'cluster(nodes = {nodes}, gpus_per_node = {per}, gpu = "H100")'

BASELINES = {
    # flows/grpo_megatron_8gpu.flow, scaled: everything colocated, megatron tp 2, vllm tp 1, one-step-off
    "grpo_megatron_8gpu": """schedule main on {cluster} {{
  colocate policy.train, policy.rollout, ref on all
  policy.train = megatron(tp = 2, pp = 1)
  policy.rollout = vllm(tp = 1, max_model_len = 8192)
  staleness 2
  resync policy via nccl(bucket = 512MB) every 1
}}""",
    # flows/grpo_disaggregated.flow, scaled: half the GPUs generate, FSDP trains on the other half
    "grpo_disaggregated": """schedule main on {cluster} {{
  pool gen = gpus(gpus = {half})
  pool train = gpus(gpus = {half})
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = fsdp()
  policy.rollout = vllm(tp = 1, max_model_len = 8192)
  staleness 2
  resync policy via nccl(bucket = 512MB, overlap = true) every 1
}}""",
    # flows/arith_grpo.flow, scaled: colocated, plain torch training, synchronous, in place
    "arith_grpo": """schedule main on {cluster} {{
  colocate policy.train, policy.rollout, ref on all
  policy.train = torch()
  policy.rollout = vllm(tp = 1, max_model_len = 8192)
  staleness 1
  resync policy via inplace() every 1
}}""",
}


def flow_text(gpus: int) -> str:
    return FLOW.format(model=MODEL, batch=PROMPTS_PER_GPU * gpus, group=GROUP, max_tokens=MAX_TOKENS)


def cluster(gpus: int) -> str:
    return CLUSTER.format(nodes=max(1, gpus // 8), per=min(gpus, 8))


def run_auto(gpus: int) -> dict:
    text = flow_text(gpus) + f"\nschedule main auto on {cluster(gpus)} {{\n  staleness <= 2\n}}\n"
    t0 = time.perf_counter()
    plan = lower(compile_text(text, f"<auto {gpus}>"))
    total = time.perf_counter() - t0
    r = plan.search
    return {"gpus": gpus, "search_s": r.seconds, "compile_s": round(total, 3), "considered": r.considered,
            "feasible": r.feasible, "simulated": r.simulated, "winner": r.winner.summary,
            "step_s": plan.estimate.step_s, "samples_per_s": plan.estimate.samples_per_s,
            "bubble": plan.estimate.bubble, "schedule": r.winner.schedule,
            "rejected": r.rejected}


def run_baseline(name: str, gpus: int) -> dict:
    sched = BASELINES[name].format(cluster=cluster(gpus), half=gpus // 2)
    try:
        plan = lower(compile_text(flow_text(gpus) + "\n" + sched + "\n", f"<{name} {gpus}>"))
    except FlowError as e:
        d = e.diagnostics[0]
        return {"name": name, "gpus": gpus, "fits": False, "error": f"{d.code}: {d.message}"}
    return {"name": name, "gpus": gpus, "fits": True, "step_s": plan.estimate.step_s,
            "samples_per_s": plan.estimate.samples_per_s, "bubble": plan.estimate.bubble}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,64,512,1024")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_search.json"))
    ap.add_argument("--no-async", action="store_true", help="skip the async comparison")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, baselines = [], []
    print(f"schedule auto for GRPO on {MODEL}, {PROMPTS_PER_GPU} prompts x {GROUP} per GPU, "
          f"max_tokens {MAX_TOKENS}, H100s (staleness <= 2)\n")
    print(f"{'GPUs':>5} {'search s':>9} {'compile s':>9} {'considered':>10} {'feasible':>8} {'step s':>8} "
          f"{'samples/s':>10}  winner")
    for n in sizes:
        row = run_auto(n)
        rows.append(row)
        print(f"{n:>5} {row['search_s']:>9.3f} {row['compile_s']:>9.3f} {row['considered']:>10} "
              f"{row['feasible']:>8} {row['step_s']:>8.1f} {row['samples_per_s']:>10.1f}  {row['winner']}")
    print(f"\n{'GPUs':>5} {'schedule':<20} {'step s':>8} {'samples/s':>10} {'auto speedup':>12}")
    for row in rows:
        print(f"{row['gpus']:>5} {'auto':<20} {row['step_s']:>8.1f} {row['samples_per_s']:>10.1f} {'1.00x':>12}")
        for name in BASELINES:
            b = run_baseline(name, row["gpus"])
            if b["fits"]:
                b["auto_speedup"] = round(row["samples_per_s"] / b["samples_per_s"], 3)
                print(f"{'':>5} {name:<20} {b['step_s']:>8.1f} {b['samples_per_s']:>10.1f} "
                      f"{b['auto_speedup']:>11.2f}x")
            else:
                print(f"{'':>5} {name:<20} {'does not fit':>8}  ({b['error'][:90]}...)")
            baselines.append(b)
    anchors = []
    if not args.no_async:
        print("\nasync RL, simulated: Qwen2.5-7B on 64 H100s, 512 prompts x 8, max_tokens 8192, "
              "lognormal lengths (median 2048, sigma 1)")
        print(f"{'mode':<22} {'step s':>8} {'speedup':>8} {'rollout tok/s/GPU':>18} {'gain':>6} {'bubble':>7}  "
              f"schedule")
        anchors = compare_async(model=MODEL, gpus=64, gpu="H100", batch=512, group=8, max_tokens=8192)
        for r in anchors:
            print(f"{r['mode']:<22} {r['step_s']:>8.1f} {r['speedup']:>7.2f}x {r['rollout_tokens_per_s']:>18.0f} "
                  f"{r['rollout_gain']:>5.2f}x {r['bubble']:>7.0%}  {r['schedule']}")
        by = {r["mode"]: r for r in anchors}
        partial_vs_off = by["partial rollout"]["rollout_tokens_per_s"] / by["one-step-off"]["rollout_tokens_per_s"]
        print("\nanchors (published):")
        for k, v in ANCHORS.items():
            print(f"  {k:<8} {v}")
        print(f"ours: one-step-off {by['one-step-off']['speedup']:.2f}x, bounded async (s=4) "
              f"{by['bounded async (s=4)']['speedup']:.2f}x, partial rollout {by['partial rollout']['speedup']:.2f}x "
              f"step throughput over sync; partial rollout's rollout throughput is "
              f"{partial_vs_off:.2f}x one-step-off's at the same staleness")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "plan_search", "python": platform.python_version(),
                               "machine": platform.machine(), "model": MODEL, "auto": rows, "baselines": baselines,
                               "async": anchors, "anchors": ANCHORS}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
