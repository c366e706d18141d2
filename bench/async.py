"""Synchronous vs one-step-off vs bounded-async RL, run for real on CPU and simulated at scale.

Part 1 runs the same GRPO flow (the shipped arithmetic task and tiny model) on this
machine with ``staleness 1``, ``2`` and ``4`` and with partial rollout
(``partial_rollout(over_provision = 1.5, recycle = true)`` at ``staleness 3``: recycling
spends one version of the bound, so the generator still runs one step ahead) in one
process run, side by side: steps/s, generated tokens/s, final reward, held-out accuracy
and the staleness histogram.

Part 2 is the same comparison simulated by flowrl's cost model for a 7B model on 64 H100s
with long-tailed response lengths (``bench/compare_async.py``), next to the
published anchors (AReaL 2.77x full async, veRL 2.35-2.67x, NeMo-RL 111 s -> 64 s
one-step-off, APRIL +22.5% rollout throughput).

    .venv/bin/python bench/async.py            # ~6 minutes on 2 cores
    .venv/bin/python bench/async.py --quick    # ~3 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOW = """
import stdlib.grpo
model policy = tiny(task = "arith")
dataset arith = jsonl("{root}/data/arith/train.jsonl", eval = "{root}/data/arith/test.jsonl")
reward exact = verifier("math")
flow main(steps: int = {steps}, eval_every: int = {steps}) {{
  grpo(policy, arith, exact, batch = {batch}, group = 8, max_tokens = 8, lr = 5e-4, kl = 0.0)
}}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  staleness {staleness}
  {partial}
}}
"""

PARTIAL = "partial_rollout(over_provision = 1.5, recycle = true)"

MODES = ((1, ""), (2, ""), (4, ""), (3, PARTIAL))
"""(staleness, extra schedule line) of the real runs, in table order."""


def run_real(staleness: int, steps: int, batch: int, tmp: Path, partial: str = "") -> dict:
    from flowrl.launch import run_file

    path = tmp / f"async_s{staleness}{'_partial' if partial else ''}.flow"
    path.write_text(FLOW.format(root=ROOT, steps=steps, batch=batch, staleness=staleness, partial=partial))
    t0 = time.time()
    result = run_file(str(path), out=str(tmp / path.stem))
    wall = time.time() - t0
    rows = result.rows[1:]  # the first step includes warm-up
    step_s = sum(r["perf/step_s"] for r in rows) / max(len(rows), 1)
    tokens = sum(r.get("perf/gen_tokens", 0) for r in rows)
    lags = {}
    for r in result.rows:
        for k, v in r.items():
            if k.startswith("staleness/hist/"):
                lags[int(k.rsplit("/", 1)[1])] = lags.get(int(k.rsplit("/", 1)[1]), 0) + v
    mode = {1: "sync", 2: "one-step-off"}.get(staleness, f"bounded async (s={staleness})")
    partial_metrics = {k: sum(r.get(k, 0) for r in result.rows) for k in
                       ("partial/over_provisioned", "partial/recycled", "partial/dropped", "partial/resumed")}
    return {"mode": f"partial rollout (s={staleness}, x1.5)" if partial else mode,
            **({"partial": partial_metrics} if partial else {}),
            "staleness": staleness, "step_s": step_s, "steps_per_s": 1 / step_s if step_s else 0.0,
            "tokens_per_s": tokens / max(sum(r["perf/step_s"] for r in rows), 1e-9),
            "final_reward": sum(r["reward/mean"] for r in result.rows[-3:]) / 3,
            "accuracy_before": result.accuracy_before, "accuracy_after": result.accuracy_after,
            "staleness_hist": dict(sorted(lags.items())), "wall_s": wall}


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """A text table; ``cols`` are (title, key, format spec)."""
    cells = [[title for title, _, _ in cols]]
    for r in rows:
        cells.append(["-" if r.get(key) is None else format(r[key], spec) if spec else str(r[key])
                      for _, key, spec in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="fewer steps (12)")
    ap.add_argument("--no-real", action="store_true",
                    help="only the simulated comparison (the real runs already in --out are kept)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "async.json"))
    args = ap.parse_args()
    steps = 12 if args.quick else args.steps
    report: dict = {"real": [], "simulated": []}
    if args.no_real and Path(args.out).is_file():
        report["real"] = json.loads(Path(args.out).read_text()).get("real", [])
    if not args.no_real:
        with tempfile.TemporaryDirectory() as d:
            for s, partial in MODES:
                report["real"].append(run_real(s, steps, args.batch, Path(d), partial))
        base = report["real"][0]["step_s"]
        for r in report["real"]:
            r["speedup"] = base / r["step_s"] if r["step_s"] else None
        print(f"\nReal runs on this machine ({steps} steps, {args.batch} prompts x 8, tiny arith model):")
        print(table(report["real"], [("mode", "mode", ""), ("s/step", "step_s", ".3f"),
                                     ("speedup", "speedup", ".2f"), ("tok/s", "tokens_per_s", ".0f"),
                                     ("reward", "final_reward", ".3f"), ("acc after", "accuracy_after", ".3f"),
                                     ("lags", "staleness_hist", ""), ("partial (groups)", "partial", "")]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_async import compare_async

    report["simulated"] = compare_async()
    print("\nSimulated: 7B model, 64 x H100, long-tailed response lengths:")
    print(table(report["simulated"], [("mode", "mode", ""), ("s/step", "step_s", ".1f"),
                                      ("speedup", "speedup", ".2f"), ("rollout gain", "rollout_gain", ".2f"),
                                      ("bubble", "bubble", ".2f"), ("anchor", "anchor", "")]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
