"""The simulator against real CPU runs of the same flows, in one process run.

For each case (a flow and a schedule), run it for real (`flowrl run`, tiny model, vLLM +
torch engines on Ray, logical GPUs) for a few steps, then simulate the same plan with the
workload the run had (prompt tokens from the dataset and the run's tokenizer, mean response
tokens and the reward op's seconds from metrics.jsonl), and compare seconds per step
(medians over the steps after the first, as the machine is shared and single steps are noisy).

Calibration: `flowrl profile` figures (matmul, memcpy, gloo) are measured here first; what a
matmul cannot show (dispatching an op to an engine over Ray; vLLM's costs per decode iteration,
per running sequence and per request; the achieved fraction of the matmul peak in log-prob and
update passes) is measured on the first three cases only (two batch sizes separate fixed from
per-item costs, long answers per-token from per-request ones; flowrl.compiler.calibrate.calibrate),
and the other cases are predictions from that profile. The a-priori column is the plan as
`flowrl plan` estimates it (the compiler's workload assumptions, no measured sizes).

    .venv/bin/python bench/sim_validation.py [--steps 6] [--cases rloo_s1,ppo_s1,grpo_long,grpo_s1,grpo_s2,grpo_s2_disagg,rpp_s1]
                                             [--fixture tests/cost/fixtures/sim_validation_run.json]
    .venv/bin/python bench/sim_validation.py --a-priori    # no runs: where `flowrl plan`'s estimate goes wrong

Prints a table and writes bench/results/sim_validation.json and a Gantt PNG per case
(simulated above, measured below). Takes ~1 min per case on 2 cores (engine start-up dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

CALIBRATION_CASES = 3
"""The first cases of --cases calibrate the profile: two batch sizes (fixed vs per-item costs) and
one with long answers (per generated token vs per request)."""
DISAGGREGATED_2 = """schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = torch(dp = 1)
  policy.rollout = vllm(tp = 1)
  staleness 2
}
"""
"""One logical GPU each for the rollout engine and the trainer, one-step-off: on 2 CPU cores
each process has a core, as two GPUs would give each engine its own device."""

@dataclass(frozen=True)
class Case:
    flow: str
    staleness: int | None
    """Replaces the flow's `staleness` line (None: as written)."""
    sets: dict
    what: str
    schedule: str | None = None
    """Replaces the flow's `schedule main` block."""
    model: str | None = None
    """Replaces the flow's `model policy = ...` declaration."""


CASES = {
    "grpo_s1": Case("flows/arith_grpo.flow", None, {}, "colocated, staleness 1 (sync)"),
    "grpo_s2": Case("flows/arith_grpo.flow", 2, {}, "colocated, staleness 2 (one-step-off)"),
    "grpo_s2_disagg": Case("flows/arith_grpo.flow", None, {}, "2 pools, staleness 2 (one-step-off)",
                           schedule=DISAGGREGATED_2),
    "rloo_s1": Case("flows/arith_rloo.flow", None, {}, "colocated, staleness 1 (sync)"),
    "ppo_s1": Case("flows/arith_ppo.flow", None, {}, "colocated, staleness 1, critic"),
    "rpp_s1": Case("flows/arith_reinforce_pp.flow", None, {}, "colocated, staleness 1 (sync)"),
    # the tiny model before its supervised warm start emits end-of-sequence about as often as any
    # of its 17 tokens: answers ~3x longer than the trained model's 3.5 tokens
    "grpo_long": Case("flows/arith_grpo.flow", None, {"max_tokens": "16", "batch": "16"},
                      "colocated, staleness 1, untrained model: long answers",
                      model='model policy = tiny(task = "arith", warm_start = 0)'),
}
TARGET_PCT = 25.0


def flow_variant(name: str, case: Case, tmp: Path) -> str:
    """A copy of the case's flow file (data paths made absolute) with its `staleness`, `schedule`
    block or policy model replaced if the case says so: the runs and the predictions read this
    copy, so the fixture can keep the exact text."""
    path = ROOT / case.flow
    text = path.read_text()
    text = re.sub(r'"(\.\./[^"]+)"', lambda m: json.dumps(str((path.parent / m.group(1)).resolve())), text)
    subs = []
    if case.staleness is not None:
        subs.append((r"(?m)^(\s*)staleness \d+\s*$", lambda m: f"{m.group(1)}staleness {case.staleness}",
                     "`staleness` line"))
    if case.schedule is not None:
        subs.append((r"(?ms)^schedule main on .*?^}\n", lambda _m: case.schedule, "`schedule main` block"))
    if case.model is not None:
        subs.append((r"(?m)^model policy = .*$", lambda _m: case.model, "`model policy` declaration"))
    for pattern, repl, what in subs:
        text, n = re.subn(pattern, repl, text)
        if n != 1:
            raise SystemExit(f"{case.flow}: expected one {what} to replace, found {n}")
    out = tmp / f"{name}.flow"
    out.write_text(text)
    return str(out)


def prompt_tokens(plan) -> float:
    """Mean tokenized length of the training prompts, with the run's own tokenizer (as `sample` does)."""
    from flowrl.runtime.materialize import load_tokenizer_for, materialize_models

    paths = materialize_models(plan, lambda *_: None)
    tok = load_tokenizer_for(plan, paths)
    ds = plan.datasets[0]
    rows = [json.loads(line) for line in Path(ds.path).read_text().splitlines()[:2000] if line.strip()]
    lens = [len(tok(r[ds.prompt]).input_ids) for r in rows]
    return statistics.fmean(lens)


def run_case(name: str, flow_file: str, steps: int, tmp: Path, sets: dict) -> tuple[Path, float]:
    from flowrl.launch import run_file

    out = tmp / name
    t0 = time.time()
    run_file(flow_file, sets={"eval_every": "100000", **sets}, steps=steps, out=str(out),
             stream=open(os.devnull, "w"))
    return out, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="real steps per case (the first is warm-up)")
    ap.add_argument("--cases", default="rloo_s1,ppo_s1,grpo_long,grpo_s1,grpo_s2,grpo_s2_disagg,rpp_s1",
                    help=f"comma-separated; the first {CALIBRATION_CASES} calibrate (generate, logprobs and update "
                         f"ops, two batch sizes): {', '.join(CASES)}")
    ap.add_argument("--fixture", help="also write the first validation case as a test fixture here: "
                                      "its flow text, the calibrated profile, its measured workload and times")
    ap.add_argument("--reuse", metavar="DIR", help="no real runs: re-evaluate the run directories and the measured "
                                                   "profile an earlier bench left in DIR (its temp directory)")
    ap.add_argument("--a-priori", action="store_true",
                    help="no real runs: re-estimate the a-priori column of the last results "
                         "(bench/results/sim_validation.json) under the built-in, automatic and calibrated "
                         "profiles, with and without the runs' prompt lengths; writes sim_validation_apriori.json")
    args = ap.parse_args()
    if args.a_priori:
        return a_priori_table()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")

    from flowrl.plan import ExecutionPlan
    from flowrl.compiler import calibrate
    from flowrl.cost import profiles, validate
    from flowrl.gantt import gantt_files

    tmp = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="flowrl-simval-"))
    prof_path = tmp / "profile.json"
    os.environ["FLOWRL_PROFILE"] = str(prof_path)  # this run's profile only; ~/.cache is left alone
    load_start = os.getloadavg()
    if args.reuse:
        base = profiles.load_profile(tmp / "profile_measured.json")
    else:
        base = profiles.measure()
        profiles.save_profile(base, tmp / "profile_measured.json")
    profiles.save_profile(base, prof_path)
    print(f"profile: matmul {base.tflops * 1e3:.1f} GFLOP/s, memcpy {base.hbm_gbs:.2f} GB/s, "
          f"gloo {base.nvlink_gbs:.2f} GB/s; load average {load_start[0]:.2f}", flush=True)

    flows = {name: flow_variant(name, CASES[name], tmp) for name in names}
    measured, runs = {}, {}
    for name in names:
        if args.reuse:
            out, wall = tmp / name, 0.0
        else:
            out, wall = run_case(name, flows[name], args.steps, tmp, CASES[name].sets)
        plan_dict, rows, events = validate.read_run(out)
        m = validate.measure_run(plan_dict, rows, events)
        m["workload"]["prompt_tokens"] = round(prompt_tokens(ExecutionPlan.from_json((out / "plan.json").read_text())), 3)
        m["wall_s"] = round(wall, 1)
        m["sets"] = CASES[name].sets
        m["load_avg_after"] = round(os.getloadavg()[0], 2) if not args.reuse else None
        measured[name], runs[name] = m, out
        print(f"ran {name}: {m['step_s']:.3f} s/step (median of {m['steps_used']}), "
              f"load {m['load_avg_after']}", flush=True)

    calib = names[:CALIBRATION_CASES]
    cal = calibrate.calibrate(base, [(flows[n], measured[n]) for n in calib])
    profiles.save_profile(cal, prof_path)
    print(f"calibrated on {', '.join(calib)}: {cal.source.split('; calibrated from ')[-1]}", flush=True)

    table = []
    for name in names:
        src, sets, what = CASES[name].flow, CASES[name].sets, CASES[name].what
        m = measured[name]
        pred = calibrate.predict(flows[name], sets, m["workload"])
        prior = calibrate.predict(flows[name], sets, None)
        cmp = validate.compare(pred, m)
        png = RESULTS / f"sim_validation_{name}.png"
        gantt_files(flows[name], png, run_dir=runs[name], sets=sets, workload=m["workload"])
        table.append({"case": name, "flow": src, "schedule": what, "role": "calibration" if name in calib
                      else "validation", **cmp, "a_priori_s": round(prior.step_s, 6),
                      "a_priori_error_pct": round(100 * (prior.step_s - m["step_s"]) / m["step_s"], 1),
                      "measured": m, "gantt": str(png.relative_to(ROOT))})

    print()
    print(f"{'case':9} {'flow':26} {'schedule':38} {'measured':>9} {'predicted':>9} {'error':>7} {'a priori':>9} {'error':>7}")
    for r in table:
        print(f"{r['case']:9} {r['flow']:26} {r['schedule']:38} {r['measured_s']:9.3f} {r['predicted_s']:9.3f} "
              f"{r['error_pct']:+6.1f}% {r['a_priori_s']:9.3f} {r['a_priori_error_pct']:+6.1f}%   ({r['role']})")
    load_end = os.getloadavg()
    within = [r for r in table if r["role"] == "validation" and abs(r["error_pct"]) <= TARGET_PCT]
    n_val = sum(r["role"] == "validation" for r in table)
    print(f"\nvalidation cases within {TARGET_PCT:.0f}%: {len(within)}/{n_val}; "
          f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end (2 cores, shared)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": args.steps, "target_pct": TARGET_PCT,
           "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in load_end],
           "profile_measured": base.to_dict(), "profile_calibrated": cal.to_dict(), "cases": table}
    (RESULTS / "sim_validation.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RESULTS / 'sim_validation.json'}")
    if args.fixture:
        case = names[len(calib)] if len(names) > len(calib) else names[-1]
        fx = {"case": case, "flow": CASES[case].flow, "calibrated_on": calib,
              "flow_text": Path(flows[case]).read_text().replace(str(ROOT), "{ROOT}"),
              "sets": CASES[case].sets, "profile": cal.to_dict(),
              "measured": {k: measured[case][k] for k in ("step_s", "step_s_all", "phases", "engine", "dispatch_s",
                                                         "workload", "staleness", "steps_used")},
              "load_avg": measured[case]["load_avg_after"], "date": doc["date"],
              "note": "written by bench/sim_validation.py --fixture from real CPU runs: the profile was "
                      f"calibrated on {', '.join(calib)}, so this case is a prediction"}
        Path(args.fixture).parent.mkdir(parents=True, exist_ok=True)
        Path(args.fixture).write_text(json.dumps(fx, indent=1, sort_keys=True) + "\n")
        print(f"wrote fixture {args.fixture}")


def a_priori_table() -> None:
    """`--a-priori`: where `flowrl plan`'s own estimate goes wrong, against the stored measured runs."""
    from flowrl.catalog.hardware import CPU_FALLBACK, Profile
    from flowrl.compiler import calibrate
    from flowrl.cost import autoprofile, profiles

    last = json.loads((RESULTS / "sim_validation.json").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="flowrl-apriori-"))
    auto_path, _ = autoprofile.auto_profile()
    profs = {"built-in": CPU_FALLBACK, "automatic": profiles.load_profile(auto_path),
             "calibrated": Profile(**last["profile_calibrated"])}
    load = os.getloadavg()
    rows = []
    for c in last["cases"]:
        flow, m = flow_variant(c["case"], CASES[c["case"]], tmp), c["measured_s"]
        row = {"case": c["case"], "measured_s": m}
        for k, prof in profs.items():
            os.environ["FLOWRL_PROFILE"] = str(profiles.save_profile(prof, tmp / "profile.json"))
            for tag, w in (("", None), (" + run's prompts", {"prompt_tokens": c["measured"]["workload"]["prompt_tokens"]})):
                s = calibrate.predict(flow, c["measured"]["sets"], w).step_s
                row[k + tag] = {"s": round(s, 4), "error_pct": round(100 * (s - m) / m, 1)}
        rows.append(row)
    cols = [k for k in rows[0] if k not in ("case", "measured_s")]
    print(f"{'case':15} {'measured':>8} " + " ".join(f"{k:>29}" for k in cols))
    for r in rows:
        print(f"{r['case']:15} {r['measured_s']:8.3f} "
              + " ".join(f"{r[k]['s']:20.3f} {r[k]['error_pct']:+7.0f}%" for k in cols))
    auto = profs["automatic"]
    print(f"automatic profile: {auto.tflops * 1e3:.1f} GFLOP/s, {auto.hbm_gbs:.2f} GB/s ({auto_path}); "
          f"load average {load[0]:.2f}; measured runs of {last['date']}")
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": [round(x, 2) for x in load],
           "runs_of": last["date"], "automatic_profile": auto.to_dict(), "cases": rows}
    (RESULTS / "sim_validation_apriori.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
