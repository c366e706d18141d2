"""Does RL lift a tiny model on Reasoning Gym tasks? ``flows/rg_*.flow``, held-out accuracy before and after.

Runs each shipped Reasoning Gym flow (a ``reasoning_gym(...)`` dataset generated offline, the
task's own scorer as the reward, the standard-library GRPO, Ray actors, vLLM rollout, torch
trainer) through ``flowrl run``, once per task and seed, with the same budget (``--steps``, the
flow's batch and group). The numbers are the runtime's own held-out evaluation (``eval/accuracy``
of ``metrics.jsonl``: greedy answers to the flow's held-out split, a reward of 1 from the task's
``score_answer`` counting as right), before the first step and after the last.

By default every run seed starts from its own warm start (``tiny(task = ...)`` adds the run's seed
to its own; built on first use, then cached, its time in the wall seconds). ``--warm-start S``
starts every seed's RL from the warm start of seed ``S`` instead (a copy of the flow with
``tiny(..., seed = S - seed)``): the seeds then differ in RL only (sampling, data order), and
one warm start per task is built, which is what a loaded machine can afford.

Prints per task and seed: held-out accuracy before and after, the gain in points and the noise
level (two standard errors of the difference of two held-out accuracies at the "before" level),
steps, wall seconds and the 1-minute load average before and after. Writes
``bench/results/reasoning_gym.json`` (``--out``) after every run.

Usage::

    .venv/bin/python bench/reasoning_gym.py                               # every rg flow, seed 0
    .venv/bin/python bench/reasoning_gym.py --tasks basic_arithmetic --seeds 0,1,2 --steps 60 --warm-start 0
    .venv/bin/python bench/reasoning_gym.py --markdown                    # the table as bench/README.md shows it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder is sys.path[0], and this file's name would shadow the reasoning_gym
# package the runs import.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
FLOWS = {p.stem.removeprefix("rg_"): p for p in sorted((ROOT / "flows").glob("rg_*.flow"))}
"""Task -> its shipped flow."""


@dataclass
class Result:
    task: str
    seed: int
    warm_start_seed: int
    steps: int
    held_out: int
    accuracy_before: float
    accuracy_after: float
    wall_s: float
    load_before: float
    load_after: float
    run_dir: str

    @property
    def gain(self) -> float:
        return 100 * (self.accuracy_after - self.accuracy_before)

    @property
    def noise(self) -> float:
        """Two standard errors (points) of the difference of two held-out accuracies at the "before" level."""
        n = max(self.held_out, 1)
        p = min(max(self.accuracy_before, 1.0 / n), 1 - 1.0 / n)
        return 100 * 2 * math.sqrt(2 * p * (1 - p) / n)


def held_out_size(flow: Path) -> int:
    found = re.search(r"eval_size\s*=\s*(\d+)", flow.read_text())
    return int(found.group(1)) if found else 0


def flow_for(task: str, seed: int, warm_start: int | None, work: Path) -> Path:
    """The shipped flow, or (``warm_start``) a copy whose model starts from that seed's warm start."""
    flow = FLOWS[task]
    if warm_start is None:
        return flow
    text = flow.read_text()
    model = f'tiny(task = "rg_{task}")'
    if model not in text:
        raise SystemExit(f"bench/reasoning_gym.py: {flow} declares no `{model}`")
    copy = work / f"rg_{task}_ws{warm_start}_seed{seed}.flow"
    copy.write_text(text.replace(model, f'tiny(task = "rg_{task}", seed = {warm_start - seed})'))
    return copy


def run_one(task: str, seed: int, steps: int | None, warm_start: int | None, work: Path) -> Result:
    from flowrl.launch import run_file

    out = work / f"rg_{task}_seed{seed}"
    load_before = os.getloadavg()[0]
    t0 = time.time()
    run_file(str(flow_for(task, seed, warm_start, work)), sets={"seed": seed}, steps=steps, out=str(out),
             overwrite=True)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2:
        raise SystemExit(f"bench/reasoning_gym.py: the run in {out} has {len(evals)} held-out evaluation(s), "
                         "not 2: the flow's eval_every must be set")
    first, last = evals[0], evals[-1]
    return Result(task, seed, seed if warm_start is None else warm_start, last["step"],
                  held_out_size(FLOWS[task]), first["eval/accuracy"], last["eval/accuracy"], wall, load_before,
                  os.getloadavg()[0], str(out))


def table(results: list[Result], markdown: bool = False) -> str:
    head = ["task", "seed", "warm start", "steps", "held-out before", "after", "gain (points)", "noise", "wall s",
            "load 1m before/after"]
    rows = [[r.task, str(r.seed), f"seed {r.warm_start_seed}", str(r.steps), f"{100 * r.accuracy_before:.1f}%",
             f"{100 * r.accuracy_after:.1f}%", f"{r.gain:+.1f}", f"{r.noise:.1f}", f"{r.wall_s:.0f}",
             f"{r.load_before:.1f} / {r.load_after:.1f}"] for r in results]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default=",".join(FLOWS), help=f"comma-separated tasks (of {', '.join(FLOWS)})")
    parser.add_argument("--seeds", default="0", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=None, help="RL steps of every run (default: the flows')")
    parser.add_argument("--warm-start", type=int, default=None,
                        help="start every seed from this seed's warm start (default: each seed its own)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "reasoning_gym.json"))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--work", default="", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in FLOWS]
    if unknown:
        parser.error(f"--tasks: no flows/rg_{unknown[0]}.flow; tasks: {', '.join(FLOWS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. 0,1,2")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="flowrl-rg-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for task in tasks:
        for seed in seeds:
            print(f"[reasoning_gym] {task} seed {seed} ...", file=sys.stderr, flush=True)
            results.append(run_one(task, seed, args.steps, args.warm_start, work))
            print(table(results[-1:]), file=sys.stderr, flush=True)
            out.write_text(json.dumps({"flows": {t: str(FLOWS[t].relative_to(ROOT)) for t in tasks},
                                       "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M"),
                                       "steps": args.steps, "warm_start": args.warm_start,
                                       "results": [{**asdict(r), "gain": r.gain, "noise": r.noise}
                                                   for r in results]}, indent=1))
    print(table(results, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
