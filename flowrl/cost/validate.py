"""Check the simulator against real runs: read a run directory, calibrate the ``cpu`` profile, compare.

A run directory (``flowrl run``) holds ``plan.json``, ``metrics.jsonl`` (per-step seconds:
``perf/step_s``, ``time/<op id>``) and ``trace.json`` (Chrome trace: one span per op on the
driver, and inside it the engine's own span, e.g. ``forward:policy`` on lane
``policy.train``). From these:

* :func:`measure_run` summarises the steady state: per-step and per-op seconds (medians over
  the steps after a warm-up, because a shared 2-core machine makes single steps noisy), the
  **dispatch overhead** (driver span of an engine op minus the engine's own span: the Ray
  round trip with the batch and results), the engine-side generate seconds, and the
  workload the run actually had (mean response tokens; the reward op's seconds).
* :func:`flowrl.compiler.calibrate.calibrate` sets what the ``cpu`` profile cannot get from a matmul or a memcpy, each
  from the engine spans that show it: the dispatch overhead; a decode iteration's cost outside
  the model (fixed + per active sequence); a training micro-batch's fixed cost; the achieved
  fraction of the matmul peak in log-prob and update passes. Runs of two batch sizes
  separate the fixed from the proportional parts. No factor is fitted to a step time, and a
  calibration from some flows is then checked on others (bench/sim_validation.py).
* :func:`compare` gives the error of a prediction (:func:`flowrl.compiler.calibrate.predict`
  compiles a flow under the current profile, puts the measured workload in and simulates it).

Pure Python, below the compiler: what needs a compiled flow (predicting a run, calibrating
the ``cpu`` profile from runs) is :mod:`flowrl.compiler.calibrate`.

>>> m = measure_run({"staleness": 1, "ops": [{"id": "g", "kind": "generate"}]},
...                 [{"step": s, "perf/step_s": 1.0 + s / 10, "time/g": 0.5} for s in range(1, 5)], [])
>>> m["step_s"], m["phases"]["g"], m["steps_used"]
(1.3, 0.5, 3)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from flowrl.catalog.ops import OpKind
from flowrl.cost.sim import Phase, PhaseKind, simulate, with_workload
from flowrl.userfiles import read_bounded


ENGINE_SPAN_PREFIXES = ("forward:", "train:", "generate[", "resync:")
"""Names of the spans engines record inside a driver op (see flowrl/runtime/driver.py)."""
DISPATCHED_KINDS = (OpKind.GENERATE, OpKind.LOGPROBS, OpKind.VALUES, OpKind.UPDATE)
"""Op kinds whose driver span wraps exactly one engine call (the dispatch overhead is their gap)."""
WARMUP_STEPS = 1
"""Steps left out of the steady state: the first step pays for lazy initialisation in the engines."""


RUN_FILE_BYTES = 512 << 20
"""The largest run file (plan, metrics, trace) read back: a run directory may come from anyone."""


class ValidateError(ValueError):
    """A run directory or fixture that cannot be read as a measured run."""


def read_run(run_dir: str | Path) -> tuple[dict, list[dict], list[dict]]:
    """``(plan, metrics rows, trace events)`` of a run directory written by ``flowrl run``."""
    d = Path(run_dir)
    try:  # regular files of a bounded size only: a run directory may come from anyone
        plan = json.loads(read_bounded(d / "plan.json", RUN_FILE_BYTES))
        rows = [json.loads(line) for line in read_bounded(d / "metrics.jsonl", RUN_FILE_BYTES).splitlines()
                if line.strip()]
        trace = json.loads(read_bounded(d / "trace.json", RUN_FILE_BYTES)) if (d / "trace.json").exists() else {}
    except OSError as e:
        raise ValidateError(f"cannot read run directory {d}: {e.filename or d}: {e.strerror}; hint: pass the "
                            "--out directory of a finished `flowrl run` (plan.json, metrics.jsonl, trace.json)") from None
    except ValueError as e:  # JSON's and UTF-8's messages give positions, never the text
        raise ValidateError(f"cannot read run directory {d}: {e}; hint: pass the --out directory of a "
                            "finished `flowrl run` (plan.json, metrics.jsonl, trace.json)") from None
    if not (isinstance(plan, dict) and isinstance(trace, dict) and all(isinstance(r, dict) for r in rows)
            and isinstance(trace.get("traceEvents", []), list)):
        raise ValidateError(f"run directory {d}: plan.json, metrics.jsonl or trace.json is not what `flowrl run` "
                            "writes; hint: pass the --out directory of a finished `flowrl run`")
    return plan, rows, list(trace.get("traceEvents", []))


def _median(xs) -> float:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else 0.0


def measure_run(plan: dict, rows: list[dict], events: list[dict], skip: int = WARMUP_STEPS) -> dict:
    """The steady state of a run, in seconds (medians over steps ``skip``.. of the run).

    Returns ``{"staleness", "steps_used", "step_s", "step_s_all" (every used step), "phases"
    (op id -> s), "engine" (op id -> the engine's own span, s), "dispatch_s", "workload":
    {"mean_response" (generated tokens per completion), "seconds" (score op id -> s)}}``.
    """
    # Steps are numbered from 1 (flowrl.runtime.observe): the first `skip` of them are left out.
    used = [r for r in sorted(rows, key=lambda r: r["step"]) if r["step"] > skip and "perf/step_s" in r]
    if not used:
        raise ValidateError(f"no steps after the first {skip} in metrics.jsonl; hint: run at least {skip + 2} steps")
    ops = plan.get("ops", [])
    phases = {op["id"]: _median(r[f"time/{op['id']}"] for r in used if f"time/{op['id']}" in r) for op in ops}
    samples = [_samples(plan, op) for op in ops if op.get("kind") == OpKind.GENERATE]
    gen_tokens = [r["perf/gen_tokens"] for r in used if "perf/gen_tokens" in r]
    workload = {"seconds": {op["id"]: phases[op["id"]] for op in ops if op.get("kind") == OpKind.SCORE}}
    if gen_tokens and samples and samples[0]:
        workload["mean_response"] = _median(gen_tokens) / sum(samples)
    prompts = [r["perf/prompt_tokens"] for r in used if "perf/prompt_tokens" in r]
    if prompts and samples and samples[0]:  # recorded by runtimes that count prompt tokens per step
        workload["prompt_tokens"] = _median(prompts) / sum(samples)
    engine, gaps = _engine_spans(ops, events, skip)
    return {"staleness": int(plan.get("staleness", 1)), "steps_used": len(used),
            "step_s": _median(r["perf/step_s"] for r in used),
            "step_s_all": [round(float(r["perf/step_s"]), 6) for r in used],
            "phases": phases, "engine": engine, "dispatch_s": _median(gaps), "workload": workload}


def _samples(plan: dict, op: dict) -> int:
    """Completions a generate op produces per step: prompts (its sample op's size) x n."""
    src = next((o for o in plan.get("ops", []) if o["id"] == op.get("inputs", {}).get("prompts")), None)
    size = int((src or {}).get("options", {}).get("size", 0) or 0)
    return size * int(op.get("options", {}).get("n", 1) or 1)


def _engine_spans(ops: list[dict], events: list[dict], skip: int) -> tuple[dict, list[float]]:
    """(op id -> median engine seconds, [driver span - engine span] of every dispatched op)."""
    kinds = {op["id"]: op.get("kind") for op in ops}
    spans = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("step", 0) > skip]
    inner = [e for e in spans if e["name"].startswith(ENGINE_SPAN_PREFIXES)]
    per_op: dict[str, list[float]] = {}
    gaps: list[float] = []
    for e in spans:
        if kinds.get(e["name"]) not in DISPATCHED_KINDS:
            continue
        t0, t1, step = e["ts"], e["ts"] + e["dur"], e["args"]["step"]
        within = [i for i in inner if i["args"].get("step") == step and t0 <= i["ts"] and i["ts"] + i["dur"] <= t1 + 1]
        if not within:
            continue
        busy = max(i["dur"] for i in within) / 1e6  # dp replicas run side by side: the slowest one counts
        per_op.setdefault(e["name"], []).append(busy)
        gaps.append(max(e["dur"] / 1e6 - busy, 0.0))
    return {k: _median(v) for k, v in per_op.items()}, gaps


# ---- comparison ------------------------------------------------------------------------------------


def compare(predicted, measured: dict) -> dict:
    """Predicted vs measured seconds per step and per op; ``error_pct`` = (pred - meas) / meas x 100."""
    def err(p, m):
        return round(100.0 * (p - m) / m, 1) if m > 0 else None

    ops = {op: {"measured_s": round(m, 6), "predicted_s": round(predicted.by_phase.get(op, 0.0), 6),
                "error_pct": err(predicted.by_phase.get(op, 0.0), m)}
           for op, m in measured["phases"].items() if op in predicted.by_phase}
    return {"measured_s": round(measured["step_s"], 6), "predicted_s": round(predicted.step_s, 6),
            "error_pct": err(predicted.step_s, measured["step_s"]), "bubble": round(predicted.bubble, 4), "ops": ops}


# ---- calibration ----------------------------------------------------------------------------------


def generate_iterations(spec, workload: dict | None = None, steps: int = 12, seed: int = 0) -> dict:
    """Generate phase id -> ``(a, s, n, b)``: its simulated duration is ``a x iter_s + s x seq_s +
    n x request_s + b x prefill_s`` under ``workload`` (decode iterations on the critical path;
    sequences running summed over them; requests served before the last completion; prompt
    tokens prefilled on the critical path).

    All four come from the simulator itself (slots, waves of continuous batching, the long
    tail), so a measured generate time turns into per-iteration, per-sequence and per-request
    seconds without guessing waves.
    """
    w = workload or {}
    base = with_workload(spec, prompt_tokens=w.get("prompt_tokens"), mean_response=w.get("mean_response"))
    out = {}
    for ph in base.phases:
        if ph.kind != PhaseKind.GENERATE:
            continue

        def alone(iter_s=0.0, seq_s=0.0, request_s=0.0, prefill_s=0.0) -> float:
            g = replace(ph.gen, iter_s=iter_s, seq_s=seq_s, request_s=request_s, prefill_s=prefill_s, overhead_s=0.0)
            gen = replace(ph, deps=(), gen=g)
            drain = Phase("calibrate.drain", PhaseKind.WORK, ph.lane, (ph.id,))
            one = replace(base, phases=(gen, drain), staleness=1, over_provision=1.0)
            return simulate(one, steps=steps, seed=seed).by_phase[ph.id]

        # linear in each for fixed lengths (same seed: the same draws)
        out[ph.id] = (alone(iter_s=1.0), alone(seq_s=1.0), alone(request_s=1.0), alone(prefill_s=1.0))
    return out


DECODE_PREFERENCE = ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (0,), (2,))
"""Which of (per iteration, per sequence, per request) :func:`_nnls3` tries first when several
fit the runs equally well (the runs cannot tell them apart)."""


def nnls3(rows: list[tuple[tuple[float, float, float], float]]) -> tuple[float, float, float]:
    """Non-negative least squares ``y = x . c`` in three unknowns: every subset of them solved
    by its normal equations; the best-fitting full-rank subset with non-negative values wins
    (ties go by :data:`DECODE_PREFERENCE`).

    >>> nnls3([((1.0, 0.0, 0.0), 2.0), ((0.0, 1.0, 0.0), 3.0), ((0.0, 0.0, 1.0), 1.0)])
    (2.0, 3.0, 1.0)
    """
    best, best_r = (0.0, 0.0, 0.0), sum(y * y for _, y in rows)
    scale = max(best_r, 1e-30)
    for subset in DECODE_PREFERENCE:
        sol = _solve([[x[i] for i in subset] for x, _ in rows], [y for _, y in rows])
        if sol is None or any(v < 0 for v in sol):
            continue
        c = [0.0, 0.0, 0.0]
        for i, v in zip(subset, sol):
            c[i] = v
        r = sum((y - sum(ci * xi for ci, xi in zip(c, x))) ** 2 for x, y in rows)
        if r < best_r - 1e-9 * scale:
            best, best_r = tuple(c), r
    return best


def _solve(xs: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares by the normal equations (Gauss-Jordan); None when rank-deficient."""
    k = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) for j in range(k)] + [sum(x[i] * y for x, y in zip(xs, ys))]
         for i in range(k)]
    norm = max(max(abs(v) for v in row[:k]) for row in a) or 1.0
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-9 * norm:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


def line(points: list[tuple[float, float]], through_origin_if_degenerate: bool = True):
    """Least-squares ``y = c + m x`` with both >= 0; ``(c, m)``. With one distinct ``x`` the
    intercept cannot be told from the slope: ``(0, median(y / x))``, or ``(None, None)``."""
    xs = [x for x, _ in points]
    if len(set(round(x, 12) for x in xs)) < 2:
        if not through_origin_if_degenerate:
            return None, None
        return 0.0, _median(y / x for x, y in points if x > 0)
    n = len(points)
    mx, my = sum(xs) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    m = sum((x - mx) * (y - my) for x, y in points) / sxx
    c = my - m * mx
    if c < 0:  # a negative fixed cost is noise: refit through the origin
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    if m < 0:
        return my, 0.0
    return c, m


__all__ = ["ValidateError", "read_run", "measure_run", "compare", "generate_iterations", "nnls3", "line",
           "WARMUP_STEPS"]
