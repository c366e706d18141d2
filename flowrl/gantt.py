"""Gantt charts of steps: simulated (flowrl.cost.sim) and measured (a run's trace.json), side by side.

Both come down to :class:`Bar` records (row, label, step, start, end) on the **same rows**:
one row per engine, named ``<lane> · <engine>`` where the lane is the set of GPUs the engine
runs on (colocated engines share a lane, so their rows sit together and a reader sees that
they take turns; disaggregated pools have lanes of their own), plus ``driver`` and
``reward`` rows for work on the driver's CPUs. The row of an op comes from the compiled
plan (:func:`rows_for`), so a simulated ``update`` and the measured one land on one row.

* :func:`bars_from_sim` - the simulator's timeline (a :class:`~flowrl.cost.sim.SimResult`);
* :func:`bars_from_trace` - the op spans of a run's ``trace.json`` (driver-side spans, which
  include the dispatch to the engine; engine-internal spans are left out);
* :func:`plot_gantt` - one PNG, one panel per source stacked with a shared time axis, bars
  coloured by what they do (generate, logprobs, update, resync, reward...), each row's busy
  fraction in its label and the idle part (the bubble) left blank;
* :func:`chrome_trace` - the same bars as a Chrome / Perfetto trace (ui.perfetto.dev).

Times are seconds from the start of the first step shown. Pure Python, matplotlib only
inside :func:`plot_gantt` (Agg canvas: no display needed, the host's backend untouched).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flowrl.catalog.ops import OpKind
from flowrl.cost.sim import SimResult

COLOURS = {OpKind.GENERATE.value: "#4c9be8", OpKind.LOGPROBS.value: "#f5a35c", OpKind.VALUES.value: "#e58bd0",
           OpKind.UPDATE.value: "#d9534f", OpKind.RESYNC.value: "#6c3fb5", "reward": "#5cb85c", "env": "#8fd18f",
           "driver": "#b0b0b0", "sleep/wake": "#777777"}
"""Bar colour per label: an engine op's kind (the estimate labels its phases by op kind), where
CPU work runs (reward workers, environments, the driver), or the swap of engines taking turns on
GPUs; anything else is grey."""
SEP = " · "
DEFAULT_STEPS = 3
MAX_STEPS = 20
"""The most steps a chart draws: the simulation and the figure stay small whatever is asked."""


class GanttError(ValueError):
    """Nothing to draw (no steps in the window, an empty trace); the message says what to pass."""


@dataclass(frozen=True)
class Bar:
    """One op of one step on one row; ``start``/``end`` in seconds."""

    row: str
    label: str
    step: int
    start: float
    end: float
    name: str = ""
    """The op (phase) id."""


@dataclass(frozen=True)
class Rows:
    """Op id -> row and label, and the rows in display order (GPU lanes first, then CPU work)."""

    row_of: dict
    label_of: dict
    order: tuple
    gpu_rows: tuple = ()
    """Rows of engines on GPUs (the others are the driver's CPUs)."""


def rows_for(spec, costs) -> Rows:
    """Rows of a plan from :func:`flowrl.compiler.schedule.estimate.build_sim`'s ``(spec, costs)``.

    ``costs`` rows are ``(phase id, kind, where, seconds, tokens)``; ``where`` is the engine
    (``policy.train``) or ``driver`` / ``reward`` / ``env``. Ops of a ``repeat`` loop
    (``op@turn``) share their op's row.
    """
    where = {c[0]: c[2] for c in costs}
    row_of, label_of, gpu_rows, cpu_rows = {}, {}, [], []
    for ph in spec.phases:
        engine = where.get(ph.id) or where.get(ph.id.split(".switch")[0], ph.lane)
        gpu = bool(spec.lanes.get(ph.lane))
        pool = ph.lane.split(":", 1)[0]  # cpu profiles give each engine a lane ``pool:engine``
        row = f"{pool}{SEP}{engine}" if gpu and engine != ph.lane else ph.lane
        base = ph.id.split("@")[0]
        row_of.setdefault(ph.id, row)
        row_of.setdefault(base, row)
        label_of.setdefault(ph.id, ph.label or ph.id)
        label_of.setdefault(base, ph.label or ph.id)
        target = gpu_rows if gpu else cpu_rows
        if row not in target:
            target.append(row)
    return Rows(row_of, label_of, tuple(gpu_rows + cpu_rows), tuple(gpu_rows))


def with_run_ops(rows: Rows, plan: dict) -> Rows:
    """``rows`` plus the ops of a run's ``plan.json`` that the plan compiled now lacks (a run made
    before a compiler change, e.g. an op elided since): each on its engine's row, else ``driver``."""
    row_of, label_of = dict(rows.row_of), dict(rows.label_of)
    for op in plan.get("ops", []):
        if op.get("id") in row_of:
            continue
        engine = f"{op.get('model')}.{op.get('engine')}"
        row = next((r for r in rows.gpu_rows if r.endswith(SEP + engine)), "driver")
        row_of[op["id"]] = row
        label_of[op["id"]] = op.get("kind", op["id"])
    return Rows(row_of, label_of, rows.order, rows.gpu_rows)


def _window(bars: list[Bar], first: int, count: int) -> list[Bar]:
    """The bars of steps first..first+count-1, re-timed from the first one's earliest start."""
    kept = [b for b in bars if first <= b.step < first + count]
    if not kept:
        have = sorted({b.step for b in bars})
        raise GanttError(f"no bars for steps {first}..{first + count - 1}; the source has steps "
                         f"{have[0]}..{have[-1]}" if have else "the source has no steps; hint: run at least one step")
    t0 = min(b.start for b in kept)
    return [Bar(b.row, b.label, b.step, b.start - t0, b.end - t0, b.name) for b in kept]


def _pin_cpu_bars(bars: list[Bar], gpu_rows: set) -> list[Bar]:
    """Draw driver-side ops that the simulator starts early (they wait for nothing: sampling the
    next prompts) right before their step's first GPU op; off the critical path, their exact
    start does not change the step time, and at time 0 they would hide where steps begin."""
    first_gpu: dict[int, float] = {}
    for b in bars:
        if b.row in gpu_rows:
            first_gpu[b.step] = min(first_gpu.get(b.step, b.start), b.start)
    out = []
    for b in bars:
        anchor = first_gpu.get(b.step)
        if b.row not in gpu_rows and anchor is not None and b.end <= anchor:
            b = Bar(b.row, b.label, b.step, anchor - (b.end - b.start), anchor, b.name)
        out.append(b)
    return out


def bars_from_sim(result: SimResult, rows: Rows, *, first: int | None = None,
                  count: int = DEFAULT_STEPS) -> list[Bar]:
    """The simulated timeline as bars, steps ``first``.. (default: the first after warm-up)."""
    ids = result.timeline_ids or [e[1] for e in result.timeline]
    bars = [Bar(rows.row_of.get(pid, lane), rows.label_of.get(pid, label), step, t0, t1, pid)
            for (lane, label, step, t0, t1), pid in zip(result.timeline, ids)]
    bars = _pin_cpu_bars(bars, set(rows.gpu_rows))
    return _window(bars, result.warmup if first is None else first, count)


def bars_from_trace(events: list[dict], rows: Rows, *, first: int = 2, count: int = DEFAULT_STEPS) -> list[Bar]:
    """A run's op spans (trace events named after plan ops) as bars, steps ``first``.. (a run numbers
    its steps from 1; the default leaves out the first, which pays for warm-up)

    Spans of names that are not ops of the plan (engine-internal spans, ``eval``) are left
    out. ``ts``/``dur`` are microseconds in a Chrome trace.
    """
    bars = []
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name not in rows.row_of:
            continue
        step = int(e.get("args", {}).get("step", -1))
        start = float(e["ts"]) / 1e6
        bars.append(Bar(rows.row_of[name], rows.label_of.get(name, name), step, start,
                        start + float(e.get("dur", 0.0)) / 1e6, name))
    return _window(bars, first, count)


def busy_fraction(bars: list[Bar], row: str) -> float:
    """Fraction of the window (first start .. last end of all bars) a row is busy (overlaps merged)."""
    if not bars:
        return 0.0
    span = max(b.end for b in bars) - min(b.start for b in bars)
    ivs = sorted((b.start, b.end) for b in bars if b.row == row)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in ivs:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / span if span > 0 else 0.0


def plot_gantt(panels: list[tuple[str, list[Bar]]], path: str | Path, *, order: tuple = (),
               title: str = "") -> Path:
    """Write a PNG with one Gantt panel per ``(title, bars)``, stacked, sharing rows and time axis.

    Rows follow ``order`` (then any others, sorted); a step boundary is a dotted line with the
    step number; a row label ends with its busy fraction in the window. Returns the path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not panels or not any(bars for _, bars in panels):
        raise GanttError("nothing to draw: no bars in any panel")
    names = list(order) + sorted({b.row for _, bars in panels for b in bars} - set(order))
    used = {b.row for _, bars in panels for b in bars}
    names = [r for r in names if r in used]
    y = {r: i for i, r in enumerate(reversed(names))}
    height = 1.2 + 0.45 * len(names)
    fig = Figure(figsize=(13, height * len(panels) + 0.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    labels_seen: dict[str, str] = {}
    for ax, (panel_title, bars) in zip(axes, panels):
        for b in bars:
            colour = COLOURS.get(b.label, "#cccccc")
            labels_seen.setdefault(b.label, colour)
            ax.barh(y[b.row], max(b.end - b.start, 1e-6), left=b.start, height=0.6, color=colour,
                    edgecolor="black", linewidth=0.4, alpha=0.85)
        for step in sorted({b.step for b in bars}):
            t = min(b.start for b in bars if b.step == step)
            ax.axvline(t, color="#555555", linestyle=":", linewidth=0.8)
            ax.text(t, len(names) - 0.45, f" step {step}", fontsize=8, va="bottom", color="#555555")
        ax.set_yticks([y[r] for r in names])
        ax.set_yticklabels([f"{r}  ({100 * busy_fraction(bars, r):.0f}% busy)" for r in names], fontsize=9)
        ax.set_ylim(-0.6, len(names) - 0.1)
        ax.set_title(panel_title, fontsize=11, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds from the start of the first step shown")
    handles = [Patch(color=c, label=lbl) for lbl, c in labels_seen.items()]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=9)
    if title:
        fig.suptitle(title, fontsize=12)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def chrome_trace(bars: list[Bar], process: str = "simulated") -> dict:
    """``{"traceEvents": [...]}``: one trace thread per row (in first-seen order), microseconds."""
    tids: dict[str, int] = {}
    for b in sorted(bars, key=lambda b: b.start):
        tids.setdefault(b.row, len(tids) + 1)
    events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": process}}]
    for row, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": row}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    for b in sorted(bars, key=lambda b: (b.start, -(b.end - b.start))):
        events.append({"name": b.name or b.label, "cat": b.label, "ph": "X", "pid": 1, "tid": tids[b.row],
                       "ts": round(b.start * 1e6, 1), "dur": round((b.end - b.start) * 1e6, 1),
                       "args": {"step": b.step, "label": b.label}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(bars: list[Bar], path: str | Path, process: str = "simulated") -> Path:
    """Write :func:`chrome_trace` as JSON; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(bars, process), separators=(",", ":")) + "\n")
    return out


__all__ = ["Bar", "Rows", "GanttError", "rows_for", "with_run_ops", "bars_from_sim", "bars_from_trace", "busy_fraction", "gantt_files",
           "plot_gantt", "chrome_trace", "write_chrome_trace", "COLOURS"]


# ---- one call: a flow (and optionally a run of it) to a PNG and a trace -----------------------------


def gantt_files(flow_file: str, png: str | Path, *, sets: dict | None = None, flow: str | None = None,
                run_dir: str | Path | None = None, trace: str | Path | None = None, steps: int = DEFAULT_STEPS,
                seed: int = 0, workload: dict | None = None) -> dict:
    """Simulate ``flow_file``'s plan and draw it (and, with ``run_dir``, the measured steps under it).

    With a run, the simulation gets the run's measured workload (mean response tokens, the reward
    op's seconds: :func:`flowrl.cost.validate.measure_run`), so the two panels differ only by
    what the cost model and the simulator get wrong; ``workload`` adds to (or replaces) what the
    run's metrics give, e.g. ``{"prompt_tokens": 7.0}`` measured with the tokenizer (the
    metrics do not count prompt tokens). ``trace``: also write the simulated bars
    as a Chrome trace. Returns ``{"png", "trace", "predicted_s", "measured_s"}`` (seconds per step).
    """
    from flowrl.compiler.calibrate import compile_spec
    from flowrl.cost import validate
    from flowrl.cost.sim import simulate, with_workload

    if not 1 <= steps <= MAX_STEPS:
        raise GanttError(f"--gantt-steps {steps}: draw 1 to {MAX_STEPS} steps (a chart of more is unreadable); "
                         f"hint: the default is {DEFAULT_STEPS}")
    _, spec, costs = compile_spec(flow_file, sets, flow)
    rows = rows_for(spec, costs)
    measured = None
    if run_dir is not None:
        plan, metric_rows, events = validate.read_run(run_dir)
        try:
            measured = validate.measure_run(plan, metric_rows, events)
            w = {**measured["workload"], **(workload or {})}
            spec = with_workload(spec, prompt_tokens=w.get("prompt_tokens"), mean_response=w.get("mean_response"),
                                 seconds=w.get("seconds"))
        except validate.ValidateError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # never quote the files' values
            raise GanttError(f"{run_dir}: its metrics or trace are not what `flowrl run` writes ({type(e).__name__}); "
                             "hint: pass the --out directory of a finished `flowrl run` of this flow") from None
    result = simulate(spec, steps=max(steps + spec.staleness + 2, 6), seed=seed)
    sim_bars = bars_from_sim(result, rows, count=steps)
    panels = [(f"simulated: {result.step_s:.3g} s/step, bubble {100 * result.bubble:.0f}%", sim_bars)]
    if measured is not None:
        real = bars_from_trace(events, with_run_ops(rows, plan), first=validate.WARMUP_STEPS + 1, count=steps)
        panels.append((f"measured ({Path(run_dir).name}): {measured['step_s']:.3g} s/step (median)", real))
    name = Path(flow_file).name
    plot_gantt(panels, png, order=rows.order, title=f"{name}: staleness {spec.staleness}")
    if trace is not None:
        write_chrome_trace(sim_bars, trace, process=f"simulated {name}")
    return {"png": str(png), "trace": str(trace) if trace else None, "predicted_s": result.step_s,
            "measured_s": measured["step_s"] if measured else None}
