"""Does every standard-library algorithm learn? All of them on the arithmetic task, same budget.

Runs each RL flow of ``stdlib/`` (GRPO, Dr.GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++,
REINFORCE++-baseline, PPO) through the normal runtime (Ray actors, vLLM rollout, torch
trainer, in-place weight sync, synchronous: the default flow's schedule) on the arithmetic
task, one after the other, with the same budget: the same warm-started tiny model
(``tiny(task = "arith")``, cached), the same prompts per step, completions per prompt,
completion length, learning rate, micro-batch, sampling seed and number of steps. Each
algorithm keeps its own defaults otherwise (its KL, clip range, advantage estimator), and
the knobs that define it (Dr.GRPO: no std, no length normalisation; DAPO: dynamic sampling
and the overlong penalty, with an overlong buffer of one token as answers take at most 4 of
the 5 tokens; GSPO and CISPO: two optimiser steps per batch, where their ratios act).

Prints, per algorithm: held-out greedy accuracy (the runtime's own evaluation of the whole
test split, ``summary.json``) before and after, its gain in points, wall seconds of the
run (start-up included), the tokens generated and the prompts drawn (DAPO draws more), and
the mean train reward over the last steps; plus the 1-minute load average before and after
each run (a shared 2-core machine: timings are noisy, accuracies are not). Writes
``bench/results/algorithms.json`` (``--out``).

Usage::

    .venv/bin/python bench/algorithms.py                  # 9 runs; Ray and vLLM start-up is most of each
    .venv/bin/python bench/algorithms.py --steps 30 --only GRPO,DAPO
    .venv/bin/python bench/algorithms.py --markdown       # the table as bench/README.md shows it

A run whose accuracy does not rise by more than two standard errors of the difference of two
held-out accuracies (about 6.7 points at 35% on the 400 held-out prompts: ``Result.noise``) is
reported as such (``learned: no``) and makes the script exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = sum(1 for line in (ROOT / "data" / "arith" / "test.jsonl").read_text().splitlines() if line.strip())
"""Held-out prompts every run is scored on (greedy), before and after."""


@dataclass(frozen=True)
class Algorithm:
    name: str
    module: str
    """The stdlib flow (``stdlib/<module>.flow``), imported as ``algo``."""
    options: str = ""
    """Its own settings, as flow keyword arguments."""
    models: tuple[str, ...] = ("ref",)
    """Models besides the policy that the schedule colocates."""


ALGORITHMS = (
    Algorithm("GRPO", "grpo"),
    Algorithm("Dr.GRPO", "grpo", 'normalize_std = false, agg = "seq-mean-token-sum", kl = 0.0'),
    Algorithm("DAPO", "dapo", "draw_batch = {batch}, overlong_buffer = 1"),
    Algorithm("GSPO", "gspo", "minibatches = 2"),
    # CISPO's weights bounded as DAPO's clip-higher: with the flow's clip_high 4.0 the second
    # minibatch's weights reach 5 and the 60-step run gained +5.5 points, within noise (bench/README.md)
    Algorithm("CISPO", "cispo", "minibatches = 2, clip_high = 0.28"),
    Algorithm("RLOO", "rloo"),
    Algorithm("REINFORCE++", "reinforce_pp"),
    Algorithm("REINFORCE++-baseline", "reinforce_pp_baseline"),
    Algorithm("PPO", "ppo", "critic_lr = {critic_lr}", models=("ref", "critic")),
)


@dataclass
class Budget:
    steps: int = 60
    batch: int = 32
    """Prompts per step (DAPO: groups trained per step, and prompts per draw)."""
    group: int = 8
    max_tokens: int = 5
    lr: float = 5e-4
    critic_lr: float = 1e-3
    micro_batch: int = 128
    seed: int = 0


@dataclass
class Result:
    name: str
    flow: str
    accuracy_before: float | None
    accuracy_after: float | None
    wall_s: float
    gen_tokens: int
    prompts: int
    reward_last: float | None
    load_before: float
    load_after: float
    extra: dict = field(default_factory=dict)

    @property
    def gain(self) -> float | None:
        if self.accuracy_before is None or self.accuracy_after is None:
            return None
        return 100 * (self.accuracy_after - self.accuracy_before)

    @property
    def noise(self) -> float | None:
        """Two standard errors (in points) of the difference of two held-out accuracies at the
        "before" level: a gain within it could be sampling noise of the greedy answers, not learning."""
        if self.accuracy_before is None:
            return None
        p = min(max(self.accuracy_before, 1.0 / HELD_OUT), 1 - 1.0 / HELD_OUT)
        return 100 * 2 * math.sqrt(2 * p * (1 - p) / HELD_OUT)

    @property
    def learned(self) -> bool:
        return self.gain is not None and self.gain > self.noise


def flow_text(algo: Algorithm, budget: Budget) -> str:
    """The benchmark flow of ``algo``: the default flow's task, reward and schedule around its stdlib flow."""
    own = algo.options.format(batch=budget.batch, critic_lr=budget.critic_lr)
    options = ", ".join(x for x in (
        f"batch = {budget.batch}", f"group = {budget.group}", f"max_tokens = {budget.max_tokens}",
        f"lr = {budget.lr}", f"micro_batch = {budget.micro_batch}", f"seed = {budget.seed}", own) if x)
    colocated = ", ".join(["policy.train", "policy.rollout", *algo.models])
    layouts = "".join(f"  {m} = torch(dp = 1)\n" for m in algo.models if m != "ref")
    return f"""import stdlib.{algo.module} as algo

model policy = tiny(task = "arith")
dataset arith = jsonl("{ROOT}/data/arith/train.jsonl", eval = "{ROOT}/data/arith/test.jsonl")
reward exact = verifier("math")

flow main(steps: int = {budget.steps}, eval_every: int = {budget.steps}, seed: int = {budget.seed}) {{
  algo.{algo.module}(policy, arith, exact, {options})
}}

schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  colocate {colocated} on all
  policy.train = torch(dp = 1)
{layouts}  policy.rollout = vllm(tp = 1)
  staleness 1
  resync policy via inplace() every 1
}}
"""


def run_one(algo: Algorithm, budget: Budget, work: Path) -> Result:
    from flowrl.launch import run_file

    path = work / f"{algo.module}_{algo.name.replace('+', 'p').replace('.', '').replace('-', '_')}.flow"
    path.write_text(flow_text(algo, budget))
    load_before = os.getloadavg()[0]
    t0 = time.time()
    result = run_file(str(path), out=str(path.with_suffix("")), overwrite=True)
    wall = time.time() - t0
    rows = [r for r in result.rows if "reward/mean" in r]
    last = rows[-max(1, len(rows) // 6):]
    drawn = [r.get("filter/prompts_drawn") for r in rows]
    prompts = int(sum(x for x in drawn if x is not None)) if any(x is not None for x in drawn) \
        else budget.batch * len(rows)
    extra = {"run_dir": str(path.with_suffix("")),
             "filter_draws_mean": _mean(rows, "filter/draws"), "offpolicy_ratio_max_mean": _mean(rows, "offpolicy/ratio_max"),
             "step_s_median": statistics.median(r["perf/step_s"] for r in rows) if rows else None}
    return Result(algo.name, f"stdlib/{algo.module}.flow", result.accuracy_before, result.accuracy_after, wall,
                  int(sum(r.get("perf/gen_tokens", 0) for r in rows)), prompts,
                  statistics.fmean(r["reward/mean"] for r in last) if last else None,
                  load_before, os.getloadavg()[0], extra)


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(results: list[Result], markdown: bool = False) -> str:
    head = ["algorithm", "flow", "held-out before", "after", "gain (points)", "learned", "wall s",
            "tokens generated", "prompts drawn", "train reward (last)", "load 1m before/after"]
    rows = [[r.name, f"`{r.flow}`" if markdown else r.flow, _pct(r.accuracy_before), _pct(r.accuracy_after),
             "-" if r.gain is None else f"{r.gain:+.1f}", f"{'yes' if r.learned else 'no'} (noise {r.noise:.1f})"
             if r.noise is not None else "no", f"{r.wall_s:.0f}",
             str(r.gen_tokens), str(r.prompts), "-" if r.reward_last is None else f"{r.reward_last:.3f}",
             f"{r.load_before:.1f} / {r.load_after:.1f}"] for r in results]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *rows])


def main(argv: list[str] | None = None) -> int:
    budget = Budget()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key, default in asdict(budget).items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--only", default="", help="comma-separated algorithm names (default: all)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "algorithms.json"))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--work", default="", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    budget = Budget(**{k: getattr(args, k) for k in asdict(budget)})
    chosen = [a for a in ALGORITHMS if not args.only or a.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {a.name for a in ALGORITHMS}
    if unknown:
        parser.error(f"unknown algorithm(s) {sorted(unknown)}; choose from {[a.name for a in ALGORITHMS]}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="flowrl-algorithms-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for algo in chosen:
        print(f"[algorithms] {algo.name} ...", file=sys.stderr, flush=True)
        results.append(run_one(algo, budget, work))
        print(table(results[-1:]), file=sys.stderr, flush=True)
        # written after every run: a run stopped by a time limit keeps the results it has
        out.write_text(json.dumps({"budget": asdict(budget), "cpus": os.cpu_count(),
                                   "when": time.strftime("%Y-%m-%d %H:%M"),
                                   "results": [{**asdict(r), "gain": r.gain, "noise": r.noise, "learned": r.learned} for r in results]},
                                  indent=1))
    print(table(results, markdown=args.markdown))
    return 0 if all(r.learned for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
