"""The calculator task as an ``openai``-client agent vs the native ``python_env`` path.

Runs, per seed and with the same budget (model, warm start, data, steps, batch, group, reward),
``flows/agent_calc.flow`` (the agent program ``flowrl/envs/calculator_agent.py`` through the
rollout endpoint) and ``flows/agentic_calc.flow`` (the ``env_step`` loop over
``flowrl.envs.calculator:Calculator``) through ``flowrl run``. Both runs' held-out numbers are the
runtime's own: whole greedy episodes on the test prompts (``eval/*`` of ``metrics.jsonl``) before
the first step and after the last; the agent's are played by the program through the endpoint.

Throughput: episodes per second of the rollout, per step: the step's episodes (batch x group)
over the seconds of the ops that made them (``time/<op>`` of the agent's ``agent_rollout``; of the
native path's ``generate`` and ``env_step`` ops), the median over the steps after the first.

Prints one row per (seed, path) and writes ``bench/results/agents.json`` (``--out``) after every
run, with the 1-minute load average before and after each run (timings on a shared machine move
with the load: compare rows made under the same load).

Usage::

    .venv/bin/python bench/agents.py                         # seed 0, the flows' own settings
    .venv/bin/python bench/agents.py --seeds 0,1,2
    .venv/bin/python bench/agents.py --steps 10 --batch 8 --markdown
    .venv/bin/python bench/agents.py --steps 4 --batch 8 --set eval_every=0   # episodes/s only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {"agent (openai client, endpoint)": ROOT / "flows" / "agent_calc.flow",
         "native (python_env, env_step)": ROOT / "flows" / "agentic_calc.flow"}
ROLLOUT_KINDS = ("generate", "env_step")
"""Plan op kinds whose time makes a step's episodes (``agent_rollout`` is of kind generate)."""


@dataclass
class Result:
    path: str
    seed: int
    steps: int
    accuracy_before: float | None
    """None: a throughput-only run (``--set eval_every=0``)."""
    accuracy_after: float | None
    episodes_per_s: float
    """Median over steps 2.. of episodes / rollout seconds."""
    episodes_per_step: int
    wall_s: float
    load_before: float
    load_after: float
    run_dir: str

    @property
    def gain(self) -> float | None:
        if self.accuracy_before is None or self.accuracy_after is None:
            return None
        return 100 * (self.accuracy_after - self.accuracy_before)


def run_one(path: str, flow: Path, seed: int, steps: int | None, sets: dict, work: Path) -> Result:
    from flowrl.launch import run_file

    out = work / f"{flow.stem}_seed{seed}"
    load_before = os.getloadavg()[0]
    t0 = time.time()
    run_file(str(flow), sets={"seed": seed, **sets}, steps=steps, out=str(out), overwrite=True)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    plan = json.loads((out / "plan.json").read_text())
    rollout = [op["id"] for op in plan["ops"] if op["kind"] in ROLLOUT_KINDS]
    settings = {**plan.get("params", {}), **sets}  # the entry flow's parameters as the run used them
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2 and sets.get("eval_every") != 0:
        raise SystemExit(f"bench/agents.py: the run in {out} has {len(evals)} held-out evaluation(s), not 2: "
                         "give --steps a multiple of eval_every (or --set eval_every=0: throughput only)")
    trained = [r for r in rows if r.get("step", 0) > 0 and any(f"time/{o}" in r for o in rollout)]
    per_step = int(settings.get("batch") or 32) * int(settings.get("group") or 8)
    rates = [per_step / max(sum(r.get(f"time/{o}", 0.0) for o in rollout), 1e-9) for r in trained[1:] or trained]
    steps_run = max((r.get("step", 0) for r in rows), default=0)
    before, after = (evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]) if len(evals) >= 2 else (None, None)
    return Result(path, seed, steps_run, before, after,
                  statistics.median(rates) if rates else 0.0, per_step, wall, load_before, os.getloadavg()[0],
                  str(out))


def table(results: list[Result], markdown: bool = False) -> str:
    head = ["path", "seed", "steps", "held-out before", "after", "gain (points)", "episodes/s (rollout)",
            "episodes/step", "wall s", "load 1m before/after"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = [[r.path, str(r.seed), str(r.steps), pct(r.accuracy_before), pct(r.accuracy_after),
             "-" if r.gain is None else f"{r.gain:+.1f}", f"{r.episodes_per_s:.1f}", str(r.episodes_per_step),
             f"{r.wall_s:.0f}",
             f"{r.load_before:.1f} / {r.load_after:.1f}"] for r in results]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [head, *rows])


def _sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the flows' 40)")
    parser.add_argument("--batch", type=int, default=None, help="prompts per step (default: the flows' 32)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another parameter of both flows (e.g. eval_every=10)")
    parser.add_argument("--only", choices=("agent", "native"), default=None, help="run one path only")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "agents.json"))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--work", default="", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. 0,1,2")
    sets = _sets(args.set)
    if args.batch is not None:
        sets["batch"] = args.batch
    if args.steps is not None and "eval_every" not in sets:
        sets["eval_every"] = args.steps  # held-out before the first step and after the last
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="flowrl-agents-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for seed in seeds:
        for path, flow in FLOWS.items():
            if args.only and not path.startswith(args.only):
                continue
            print(f"[agents] seed {seed}: {path} ...", file=sys.stderr, flush=True)
            results.append(run_one(path, flow, seed, args.steps, sets, work))
            print(table(results[-1:]), file=sys.stderr, flush=True)
            out.write_text(json.dumps({"flows": {p: str(f.relative_to(ROOT)) for p, f in FLOWS.items()},
                                       "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M"),
                                       "sets": sets, "results": [{**asdict(r), "gain": r.gain} for r in results]},
                                      indent=1))
    print(table(results, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
