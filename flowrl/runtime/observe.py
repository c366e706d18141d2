"""What a user watches during a run and what the run leaves behind.

Four artefacts, one class or function each:

* :class:`Timeline` -> ``trace.json``: a Chrome / Perfetto trace (open it at
  https://ui.perfetto.dev or ``chrome://tracing``) with one complete event per phase
  of every step, one lane (a trace "thread") per worker or role.
* :class:`MetricsLog` -> ``metrics.jsonl``: one JSON object per step, keys sorted,
  floats rounded to 6 significant digits; resumable after a crash.
* :class:`Progress` -> the progress line on stderr: redrawn in place on a terminal,
  one plain line per step when piped (CI logs, files); at most 120 columns.
* :func:`plot_run` -> a 2x2 PNG (reward, held-out accuracy, KL, train/rollout
  logprob mismatch); :func:`summarize` -> first/last/best of the key series.

Metric keys follow one convention (the driver emits them): ``reward/mean``,
``reward/min``, ``reward/max``, ``eval/accuracy`` (0..1), ``eval/reward``, ``kl/ref``,
``mismatch/abs_mean``, ``mismatch/abs_max``, ``mismatch/kl``, ``perf/tokens_per_s``,
``perf/step_s``, ``time/<op id>`` (seconds), ``sync/bytes``, ``sync/seconds``,
``staleness/hist/<k>``, ``loss/...``, ``policy/version``.

Steps are numbered from 1 in everything a run writes and shows: step k is the k-th RL
step (``metrics.jsonl``, ``trace.json``, the progress line, ``summary.json``, the plots and
the checkpoints' names all agree), and step 0 is before RL (the held-out evaluation of the
initial model, set-up spans in the trace). The driver's loop index (0-based) is used only
inside the runtime: :class:`Timeline` takes it and writes ``index + 1``.

This module imports only the standard library at import time; matplotlib is
imported inside :func:`plot_run`, so the driver pays for it only when plotting.
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from flowrl.runtime.metric_names import unowned_name
from flowrl.runtime.rundir import tmp_sibling


class ObserveError(ValueError):
    """A trace event, metric or progress update that cannot be recorded as given."""


# --------------------------------------------------------------------------- helpers


def _check_step(step: Any, what: str, lowest: int = 0) -> int:
    # bool is an int subclass; a True step is always a caller bug.
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < lowest:
        raise ObserveError(f"{what}: step={step!r}; hint: steps are ints >= {lowest} (0 = the first step)")
    return int(step)


SETUP_STEP = -1
"""The loop index a :class:`Timeline` event gets when it happens before the first step (set-up,
the baseline evaluation before RL); the trace shows it as step 0."""


def _check_name(value: Any, field: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ObserveError(f"{what}: {field}={value!r}; hint: give a non-empty string")
    return value


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte of ``data`` is written (a short write is not an error)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves either the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
    """A trace-event argument as a JSON value: scalars kept, everything else ``str()``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


# --------------------------------------------------------------------------- Timeline


class Timeline:
    """Chrome/Perfetto trace of every phase of every step.

    Times are wall-clock seconds (``time.time()`` base), so events measured in other
    processes (Ray actors) line up with events measured here. :meth:`span` measures
    durations with ``time.perf_counter`` (monotonic, sub-microsecond) anchored to the
    wall clock once at construction, so a system clock jump cannot yield negative
    durations. In the written trace, ``ts`` and ``dur`` are microseconds counted from
    the earliest event (or the construction time, whichever is earlier).

    Lanes become trace threads (``tid`` 1, 2, ... in order of first use) labelled by
    ``thread_name`` metadata; the whole run is one process (``pid`` 1). Events on one
    lane should nest (as :meth:`span` contexts do) or follow each other: give each
    concurrently running worker its own lane.

    Thread-safe: spans may be recorded from several driver threads at once.
    """

    PID = 1

    def __init__(self, process_name: str = "flowrl"):
        self.process_name = _check_name(process_name, "process_name", "Timeline")
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()
        self._lock = threading.Lock()
        self._lanes: dict[str, int] = {}
        # (name, lane, step, start_s, end_s, args); seconds on the wall clock.
        self._events: list[tuple[str, str, int, float, float, dict[str, Any]]] = []

    def _now(self) -> float:
        """Wall-clock seconds, advanced by the monotonic clock since construction."""
        return self._wall0 + (time.perf_counter() - self._perf0)

    @contextmanager
    def span(self, name: str, lane: str, step: int, **args: Any) -> Iterator[None]:
        """Record the enclosed block as one complete (``"ph": "X"``) event.

        ``name`` is the phase (usually the op id, e.g. ``"generate"``), ``lane`` the
        worker or role that ran it, ``step`` the driver's 0-based loop index (:data:`SETUP_STEP`
        = -1 before the first step; the trace writes ``step + 1``); ``args`` are shown in
        the trace viewer's detail pane. If the block raises, the event is still
        recorded (with ``error=<exception type>``) and the exception propagates.
        """
        # Check before running the block, so a bad name cannot mask the block's own error.
        _check_name(name, "name", "Timeline event")
        _check_name(lane, "lane", f"Timeline event {name!r}")
        _check_step(step, f"Timeline event {name!r}", SETUP_STEP)
        start = self._now()
        try:
            yield
        except BaseException as exc:
            args = {**args, "error": type(exc).__name__}
            raise
        finally:
            self.add(name, lane, step, start, max(self._now(), start), **args)

    def add(self, name: str, lane: str, step: int, start_s: float, end_s: float, **args: Any) -> None:
        """Record an event timed elsewhere; ``start_s``/``end_s`` are ``time.time()`` seconds."""
        what = f"Timeline event {name!r}"
        _check_name(name, "name", "Timeline event")
        _check_name(lane, "lane", what)
        step = _check_step(step, what, SETUP_STEP)
        start_s, end_s = float(start_s), float(end_s)
        if not (math.isfinite(start_s) and math.isfinite(end_s)) or end_s < start_s:
            raise ObserveError(
                f"{what} on lane {lane!r} at step {step}: start_s={start_s!r}, end_s={end_s!r}; "
                "hint: pass time.time() seconds with start_s <= end_s"
            )
        with self._lock:
            self._lanes.setdefault(lane, len(self._lanes) + 1)
            self._events.append((name, lane, step, start_s, end_s, dict(args)))

    def phase_seconds(self, step: int) -> dict[str, float]:
        """Total seconds per event name recorded for ``step``, in order of first record.

        Nested events each count in full under their own name (a ``step`` span that
        encloses ``generate`` reports the whole step; ``generate`` its own share).
        """
        step = _check_step(step, "Timeline.phase_seconds", SETUP_STEP)
        totals: dict[str, float] = {}
        with self._lock:
            for name, _lane, s, start, end, _args in self._events:
                if s == step:
                    totals[name] = totals.get(name, 0.0) + (end - start)
        return totals

    def lane_seconds(self, step: int, prefix: str = "") -> dict[tuple[str, str], float]:
        """Total seconds per ``(lane, event name)`` recorded for ``step``, of the names starting with ``prefix``."""
        step = _check_step(step, "Timeline.lane_seconds", SETUP_STEP)
        totals: dict[tuple[str, str], float] = {}
        with self._lock:
            for name, lane, s, start, end, _args in self._events:
                if s == step and name.startswith(prefix):
                    totals[lane, name] = totals.get((lane, name), 0.0) + (end - start)
        return totals

    def trace_events(self) -> list[dict[str, Any]]:
        """The trace as Chrome trace-event dicts: metadata first, then events by start time."""
        with self._lock:
            events = list(self._events)
            lanes = dict(self._lanes)
        origin = self.origin()
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.PID, "tid": 0, "args": {"name": self.process_name}}
        ]
        for lane, tid in lanes.items():
            out.append({"name": "thread_name", "ph": "M", "pid": self.PID, "tid": tid, "args": {"name": lane}})
            # Keep lanes in first-use order in the viewer instead of alphabetical.
            out.append({"name": "thread_sort_index", "ph": "M", "pid": self.PID, "tid": tid, "args": {"sort_index": tid}})
        # Parents before children at equal start (longer first): the viewers' importers
        # build the nesting from this order.
        events.sort(key=lambda e: (e[3], -(e[4] - e[3])))
        for name, lane, step, start, end, args in events:
            out.append({
                "name": name,
                "cat": "step",
                "ph": "X",
                "pid": self.PID,
                "tid": lanes[lane],
                # 0.1 us: the resolution an epoch-seconds double (~2e-7 s) can honestly carry.
                "ts": round((start - origin) * 1e6, 1),
                "dur": round((end - start) * 1e6, 1),
                # The step as users number it (1 = the first RL step, 0 = set-up / before RL).
                "args": {**{k: _json_safe(v) for k, v in args.items()}, "step": step + 1},
            })
        return out

    def origin(self) -> float:
        """The wall-clock second the written trace counts from (``otherData.origin_s`` in it)."""
        with self._lock:
            return min([self._wall0] + [e[3] for e in self._events])

    def keep_earlier(self, path: str | os.PathLike, through_step: float) -> None:
        """Add the events of an earlier attempt's trace at ``path`` (a run resumed or restarted) whose
        step (as written: 0 = set-up) is ``<= through_step``, at their own wall-clock times (a trace
        without ``origin_s`` is placed to end where this one starts). Later steps are dropped: they run
        again. An unreadable file adds nothing; it is read as JSON only."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            events = [e for e in doc["traceEvents"] if isinstance(e, dict)]
        except (OSError, ValueError, KeyError, TypeError):
            return
        lanes = {e.get("tid"): e.get("args", {}).get("name") for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name" and isinstance(e.get("args"), dict)}
        spans = []
        for e in events:
            try:
                args = dict(e.get("args") or {})
                step = int(args.pop("step"))
                if e.get("ph") != "X" or step > through_step or not isinstance(lanes.get(e.get("tid")), str):
                    continue
                spans.append((str(e["name"]), lanes[e["tid"]], step - 1, float(e["ts"]) / 1e6,
                              float(e["ts"]) / 1e6 + float(e.get("dur", 0.0)) / 1e6, args))
            except (KeyError, TypeError, ValueError):
                continue
        if not spans:
            return
        origin = (doc.get("otherData") or {}).get("origin_s") if isinstance(doc.get("otherData"), dict) else None
        if not isinstance(origin, (int, float)) or not math.isfinite(origin):
            origin = self._wall0 - max(end for *_, end, _args in spans)
        with self._lock:
            for name, lane, step, start, end, args in spans:
                self._lanes.setdefault(lane, len(self._lanes) + 1)
                self._events.append((name, lane, max(step, SETUP_STEP), origin + start, origin + end, args))

    def write(self, path: str | os.PathLike) -> None:
        """Write ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"origin_s": ...}}``
        to ``path`` atomically."""
        from flowrl.runtime.secrets import redact

        doc = {"traceEvents": self.trace_events(), "displayTimeUnit": "ms", "otherData": {"origin_s": self.origin()}}
        atomic_write_text(Path(path), redact(json.dumps(doc, separators=(",", ":"))) + "\n")  # no tokens in traces


# --------------------------------------------------------------------------- MetricsLog

_NONFINITE_OUT = {math.inf: "Infinity", -math.inf: "-Infinity"}
_NONFINITE_IN = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _scalar(key: str, value: Any, step: int) -> int | float:
    """One metric value as a plain int or float (numpy and 0-d torch scalars accepted)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    # numpy 0-d arrays and one-element torch tensors: .item() gives a Python scalar
    # (it raises ValueError / RuntimeError for more than one element).
    item = getattr(value, "item", None)
    if callable(item):
        try:
            inner = item()
        except (ValueError, RuntimeError):
            inner = None
        if isinstance(inner, numbers.Real):
            return _scalar(key, inner, step)
    raise ObserveError(
        f"metric {key!r} at step {step}: value {value!r} of type {type(value).__name__}; "
        "hint: log scalars only (int or float), e.g. tensor.mean().item()"
    )


def _encode(value: int | float) -> int | float | str:
    """Round floats to 6 significant digits; non-finite floats become strings (strict JSON)."""
    if isinstance(value, int):
        return value
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return _NONFINITE_OUT[value]
    # 6 significant digits, not 6 decimals: a KL of 3.2e-7 must stay visible.
    return float(f"{value:.6g}")


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _NONFINITE_IN.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step, ``{"step": s, <key>: <value>, ...}``.

    Keys are sorted; floats keep 6 significant digits; NaN and +/-inf are written as
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (strict JSON, readable by
    ``jq``) and read back as floats by :meth:`rows`. Each :meth:`log` appends one line
    and flushes it, so a crash loses at most the line being written.

    ``resume_after_step=None`` starts a fresh log (an existing file is replaced).
    ``resume_after_step=k`` (resuming from a checkpoint taken after step k) keeps the
    existing lines with ``step <= k`` (step 0, before RL, included), drops the rest (they
    belong to steps that will be run again), rewrites the file atomically, then appends. A torn last line
    (a crash mid-write) is dropped; a malformed line elsewhere raises.
    """

    def __init__(self, path: str | os.PathLike, resume_after_step: int | None = None):
        self.path = Path(path)
        self._rows: list[dict[str, Any]] = []
        if resume_after_step is not None:
            resume_after_step = _check_step(resume_after_step, f"MetricsLog({str(self.path)!r}) resume_after_step")
            self._rows = [r for r in self._read_existing() if r["step"] <= resume_after_step]
        text = "".join(self._line(r) for r in self._rows)
        atomic_write_text(self.path, text)

    def _read_existing(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            lines = self.path.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as e:  # json.dumps writes ASCII: not a file this log wrote
            raise ObserveError(f"{self.path}: not a metrics log ({e.reason} at byte {e.start}); hint: it was "
                               "damaged or replaced: start a new run") from None
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = _check_step(row.get("step") if isinstance(row, dict) else None, "")
            except (json.JSONDecodeError, ObserveError):
                if number == len(lines):
                    break  # torn final line from a crash mid-write: that step is re-run anyway
                raise ObserveError(
                    f"{self.path}:{number}: not a metrics record: {line[:80]!r}; "
                    "hint: each line must be a JSON object with an int 'step'; fix or delete the line"
                ) from None
            row["step"] = step
            rows.append(_decode(row))
        return rows

    @staticmethod
    def _line(row: dict[str, Any]) -> str:
        encoded = {k: _encode(v) if k != "step" else v for k, v in row.items()}
        return json.dumps(encoded, sort_keys=True, allow_nan=False) + "\n"

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        """Append the metrics of step ``step`` (1 = the first RL step, 0 = before RL).
        ``None`` values are skipped (not measured)."""
        step = _check_step(step, f"MetricsLog.log to {str(self.path)!r}")
        if self._rows and step <= self._rows[-1]["step"]:
            raise ObserveError(
                f"MetricsLog.log: step {step} after step {self._rows[-1]['step']}; "
                "hint: log each step once, in increasing order (merge a step's metrics into one call)"
            )
        row: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key or key == "step":
                raise ObserveError(f"MetricsLog.log at step {step}: metric key {key!r}; hint: use names like 'reward/mean'")
            if value is not None:
                row[key] = _scalar(key, value, step)
        line = self._line(row)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            kept = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, line.encode("utf-8"))  # unbuffered: nothing is left to flush after a failure
            except OSError as error:
                # A full disk mid-line: cut the torn line off so the earlier steps' rows stay readable.
                try:
                    os.ftruncate(fd, kept)
                except OSError:
                    pass
                if error.errno == errno.ENOSPC:
                    raise ObserveError(f"disk full writing step {step}'s metrics to {self.path} (ENOSPC); the rows of "
                                       "the earlier steps are kept; hint: free space on that disk, then "
                                       f"`flowrl run --resume {self.path.parent}` continues from the last "
                                       "checkpoint") from error
                raise
        finally:
            os.close(fd)
        # Keep what was written (rounded), so rows() equals a fresh read of the file.
        self._rows.append(_decode(json.loads(line)))

    def rows(self) -> list[dict]:
        """Every step's record so far (kept on resume + logged), oldest first; copies."""
        return [dict(r) for r in self._rows]


# --------------------------------------------------------------------------- Progress


def _fmt_num(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}" if abs(x) < 100 else f"{x:.1f}"


def _fmt_reward(x: float) -> str:
    # Fixed decimals keep the column steady from line to line.
    return f"{x:.3f}" if math.isfinite(x) else str(x)


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else str(x)


def _fmt_si(x: float) -> str:
    """1234 -> '1.2k', 2.5e6 -> '2.5M': throughput at a glance."""
    if not math.isfinite(x):
        return str(x)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


def _fmt_duration(seconds: float) -> str:
    """Seconds as '42s', '1m05s', '2h03m' (the widths a user reads at a glance)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt_phase(seconds: float) -> str:
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds >= 60:
        return _fmt_duration(seconds)
    return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s"


HEADLINE: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("reward/mean", "reward", _fmt_reward),
    ("eval/accuracy", "acc", _fmt_pct),
    ("kl/ref", "kl", _fmt_num),
    ("perf/tokens_per_s", "gen_tok/s", _fmt_si),
)
"""(metric key, label, formatter) shown on the progress line when present, in this order."""

MAX_PHASES = 6
"""At most this many ``time/<op>`` entries per line (the slowest ones, in given order)."""


MAX_WIDTH = 120
"""The progress line never gets wider than this (nor wider than the terminal)."""


class Progress:
    """The run's progress line on ``stream`` (stderr), e.g.::

        step  12/60 [##........] reward 0.410 acc 35.0% kl 0.0123 gen_tok/s 1.2k | generate 0.80s update 0.52s eta 1m05s

    ``update(step, metrics)`` takes the step just finished, numbered from 1 (step 1 is the
    first), of ``total_steps``. Headline values come from :data:`HEADLINE` keys, phase times
    from ``time/<op>`` keys (the slowest first dropped last, as many as fit), each only if
    present; the line is at most :data:`MAX_WIDTH` columns (and the terminal's width).

    On a terminal (``live``, default ``stream.isatty()``) the line is redrawn in place
    (carriage return, erase to the end of the line) and :meth:`message` lines scroll above it;
    elsewhere (a pipe, a file, CI) every update is one plain line.

    The ETA is the mean wall time per step in this process times the steps left; the first
    step in this process is left out of the mean once later ones exist (it carries start-up
    and compilation). ``start_step`` is the number of steps already done (resume).
    ``clock`` (seconds, monotonic) is injectable for tests.
    """

    BAR_WIDTH = 10

    def __init__(
        self,
        total_steps: int,
        stream: TextIO = sys.stderr,
        start_step: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
        live: bool | None = None,
        width: int | None = None,
    ):
        if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral) or total_steps < 1:
            raise ObserveError(f"Progress: total_steps={total_steps!r}; hint: give the number of steps, >= 1")
        start_step = _check_step(start_step, "Progress start_step")
        if start_step > total_steps:
            raise ObserveError(f"Progress: start_step={start_step} > total_steps={total_steps}; hint: resume within the run")
        self.total = int(total_steps)
        self.stream = stream
        self.start_step = start_step
        self.live = _isatty(stream) if live is None else bool(live)
        self.width = min(MAX_WIDTH, width or (_terminal_columns(stream) if self.live else MAX_WIDTH))
        self._clock = clock
        self._t0 = clock()
        # (clock seconds, finished-step count) at each update.
        self._marks: list[tuple[float, int]] = []
        self._done = start_step
        self._shown = ""  # the line drawn in place (live mode), to redraw under messages
        self._line = ""  # the last step's line, which a status note follows
        self._last_status = -math.inf
        self._closed = False
        self._lock = threading.Lock()  # a status may come from the thread that scores a step

    def _print(self, text: str) -> None:
        with self._lock:
            self._print_locked(text)

    def _print_locked(self, text: str) -> None:
        if self.live and self._shown:
            self.stream.write("\r\x1b[K")  # the message takes the progress line's place ...
        self.stream.write(text + "\n")
        if self.live and self._shown:
            self.stream.write(self._shown)  # ... which is drawn again below it
        self.stream.flush()

    def _draw(self, line: str) -> None:
        if self.live:
            with self._lock:
                self._shown = line
                self.stream.write("\r\x1b[K" + line)
                self.stream.flush()
        else:
            self._print(line)

    STATUS_EVERY_S = 10.0
    """Off a terminal, the least time between two status lines."""

    def status(self, text: str) -> None:
        """A note on what the step in progress waits for (e.g. ``waiting on rewards (12/512)``),
        secrets redacted: on a terminal it follows the last step's line, redrawn in place (the
        next update replaces it); elsewhere it is printed as a line, at most every
        :data:`STATUS_EVERY_S` seconds."""
        from flowrl.runtime.secrets import redact

        if self._closed:
            return
        base = self._line or f"step {self._done}/{self.total}"
        line = f"{base} | step {self._done + 1}: {redact(str(text))}"
        line = line if len(line) <= self.width else line[: self.width - 1] + "…"
        if self.live:
            self._draw(line)
        elif self._clock() - self._last_status >= self.STATUS_EVERY_S:
            self._last_status = self._clock()
            self._print(f"step {self._done + 1}/{self.total}: {redact(str(text))}")

    def _seconds_per_step(self) -> float | None:
        """Mean wall seconds per step, from the first update on (else from construction)."""
        marks = self._marks
        if len(marks) >= 2 and marks[-1][1] > marks[0][1]:
            return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])
        if marks and marks[-1][1] > self.start_step:
            return (marks[-1][0] - self._t0) / (marks[-1][1] - self.start_step)
        return None

    def format_line(self, step: int, metrics: dict) -> str:
        """The line :meth:`update` shows for finished step ``step`` (1-based), at most ``self.width`` wide."""
        done = _check_step(step, "Progress.update")
        width = len(str(self.total))
        filled = min(self.BAR_WIDTH, int(self.BAR_WIDTH * done / self.total))
        head = f"step {done:>{width}}/{self.total} [{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}]"
        for key, label, fmt in HEADLINE:
            if isinstance(metrics.get(key), numbers.Real):
                head += f" {label} {fmt(float(metrics[key]))}"
        per_step = self._seconds_per_step()
        if done >= self.total:
            tail = f" done in {_fmt_duration(self._clock() - self._t0)}"
        elif per_step is not None:
            tail = f" eta {_fmt_duration(per_step * (self.total - done))}"
        else:
            tail = ""
        phases = [(k[len("time/"):], float(v)) for k, v in metrics.items()
                  if k.startswith("time/") and isinstance(v, numbers.Real)]
        # As many phases as fit, the slowest first; shown in the order the step ran them.
        kept: list[tuple[str, float]] = []
        for phase in sorted(phases, key=lambda p: -p[1])[:MAX_PHASES]:
            trial = [p for p in phases if p in kept or p == phase]
            text = " | " + " ".join(f"{name} {_fmt_phase(s)}" for name, s in trial)
            if len(head) + len(text) + len(tail) <= self.width:
                kept = trial
        middle = " | " + " ".join(f"{name} {_fmt_phase(s)}" for name, s in kept) if kept else ""
        line = head + middle + tail
        return line if len(line) <= self.width else line[: self.width - 1] + "…"

    def update(self, step: int, metrics: dict) -> None:
        """Show the line for step ``step`` (1-based), which just finished."""
        done = _check_step(step, "Progress.update")
        self._marks.append((self._clock(), done))
        self._done = max(self._done, done)
        self._line = self.format_line(step, metrics)
        self._draw(self._line)

    def message(self, text: str) -> None:
        """Print a free-form line (checkpoint saved, eval started, ...) above the progress line
        (secrets from the environment redacted: :mod:`flowrl.runtime.secrets`)."""
        from flowrl.runtime.secrets import redact

        self._print(redact(str(text)))

    def _end(self, text: str) -> None:
        if self._closed:
            return
        self._closed = True
        if self.live and self._shown:
            self.stream.write("\n")  # keep the last progress line on screen
            self._shown = ""
        self._print(text)

    def close(self) -> None:
        """Print a final line with the steps finished and the elapsed time; idempotent.

        The stream itself is left open (it is usually stderr).
        """
        ran = self._done - self.start_step
        self._end(f"finished {self._done}/{self.total} steps ({ran} in this process) "
                  f"in {_fmt_duration(self._clock() - self._t0)}")

    def stopped(self) -> None:
        """Like :meth:`close`, for a run that ended early (an error, Ctrl-C)."""
        self._end(f"stopped after step {self._done} of {self.total} "
                  f"({self._done - self.start_step} in this process, {_fmt_duration(self._clock() - self._t0)})")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _terminal_columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or MAX_WIDTH
    except (AttributeError, ValueError, OSError):
        return MAX_WIDTH


# --------------------------------------------------------------------------- plot_run and summarize


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the rows that have a finite value for it."""
    steps, values = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(row["step"]))
            values.append(float(v))
    return steps, values


def reward_band(rows: list[dict]) -> tuple[list[int], list[float], list[float]] | None:
    """The band drawn around the mean reward: mean +/- std per step, clipped to [min, max].

    None when there is nothing to show: no ``reward/std``, or rewards that take only two
    values (0/1 verifiers) at every step — their spread is fixed by the mean (variance
    ``(mean - min) * (max - mean)`` with the population std), so a band would only restate the curve (and a
    ``min..max`` band would cover 0..1 on every step, hiding it).
    """
    stats = {}
    for key in ("reward/mean", "reward/std", "reward/min", "reward/max"):
        for step, value in zip(*_series(rows, key)):
            stats.setdefault(step, {})[key] = value
    steps = sorted(s for s, v in stats.items() if len(v) == 4)
    if not steps:
        return None
    # metrics.jsonl keeps 6 significant digits: the identity holds to ~1e-6 of (max - min)^2.
    two_valued = all(abs(v["reward/std"] ** 2 - (v["reward/mean"] - v["reward/min"]) * (v["reward/max"] - v["reward/mean"]))
                     <= 1e-5 * max(1.0, (v["reward/max"] - v["reward/min"]) ** 2)
                     for v in (stats[s] for s in steps))
    if two_valued:
        return None
    low = [max(stats[s]["reward/min"], stats[s]["reward/mean"] - stats[s]["reward/std"]) for s in steps]
    high = [min(stats[s]["reward/max"], stats[s]["reward/mean"] + stats[s]["reward/std"]) for s in steps]
    return steps, low, high


def _draw_reward(ax, rows) -> bool:
    drawn = False
    steps, mean = _series(rows, "reward/mean")
    if steps:
        ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, lw=2, label="mean (train batch)")
        drawn = True
    band = reward_band(rows)
    if band is not None:
        ax.fill_between(band[0], band[1], band[2], alpha=0.2, label="mean ± std")
        drawn = True
    es, ev = _series(rows, "eval/reward")
    if es:
        ax.plot(es, ev, "s--", label="held-out")
        drawn = True
    ax.set_ylabel("reward")
    if drawn:
        ax.legend(loc="best")
    return drawn


def _draw_accuracy(ax, rows) -> bool:
    steps, acc = _series(rows, "eval/accuracy")
    if not steps:
        return False
    ax.plot(steps, [100 * a for a in acc], "o-", lw=2, color="tab:green", label="held-out accuracy")
    if steps[0] == 0:
        ax.annotate(f"before RL: {100 * acc[0]:.1f}%", (steps[0], 100 * acc[0]), textcoords="offset points",
                    xytext=(8, -14))
    ax.set_ylim(0, 100)
    ax.set_ylabel("accuracy (%)")
    ax.legend(loc="best")
    return True


def _draw_kl(ax, rows) -> bool:
    ref_steps, ref = _series(rows, "kl/ref")
    mis_steps, mis = _series(rows, "mismatch/kl")
    axes = [ax]
    if ref_steps:
        ax.plot(ref_steps, ref, marker="." if len(ref_steps) < 60 else None, lw=1.5, color="tab:blue",
                label="KL(policy || reference)")
        ax.set_ylabel("KL to reference (nats/token)", color="tab:blue")
    if mis_steps:
        # The rollout/train KL is typically 1e-6 next to a reference KL of 1e-2: on a
        # shared axis it would be a flat line at zero, so it gets its own (right) axis.
        mis_ax = ax.twinx() if ref_steps else ax
        mis_ax.plot(mis_steps, mis, marker="." if len(mis_steps) < 60 else None, lw=1.5, color="tab:orange",
                    label="KL(rollout || train)")
        mis_ax.set_ylabel("KL rollout vs train (nats/token)", color="tab:orange")
        if mis_ax is not ax:
            axes.append(mis_ax)
    if not (ref_steps or mis_steps):
        return False
    # One legend for both axes, on the topmost one so no line covers it.
    handles = [h for a in axes for h in a.get_legend_handles_labels()[0]]
    axes[-1].legend(handles=handles, loc="best")
    return True


def _draw_mismatch(ax, rows) -> bool:
    drawn, positive = False, True
    for key, label in (("mismatch/abs_mean", "mean |train - rollout|"), ("mismatch/abs_max", "max |train - rollout|")):
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, lw=1.5, label=label)
            positive = positive and min(values) > 0
            drawn = True
    # The differences span orders of magnitude (1e-6 fp32 noise .. 1e-1 real bugs).
    if drawn and positive:
        ax.set_yscale("log")
    ax.set_ylabel("logprob difference (nats)")
    if drawn:
        ax.legend(loc="best")
    return drawn


PANELS: tuple[tuple[str, Callable[[Any, list[dict]], bool]], ...] = (
    ("Reward", _draw_reward),
    ("Held-out accuracy", _draw_accuracy),
    ("KL divergence", _draw_kl),
    ("Train vs rollout logprob mismatch", _draw_mismatch),
)
"""(panel title, draw function) in reading order; a draw function returns whether it plotted anything."""


def plot_run(rows: list[dict], path: str | os.PathLike, title: str | None = None) -> None:
    """Write a 2x2 PNG of a run's metrics (rows as from :meth:`MetricsLog.rows`).

    Panels (:data:`PANELS`): reward (``reward/mean``, a mean +/- std band where it says
    something (:func:`reward_band`), ``eval/reward``), held-out accuracy (``eval/accuracy`` in %, only the steps
    that have it), KL (``kl/ref``, ``mismatch/kl``) and the train-vs-rollout logprob
    mismatch (``mismatch/abs_mean``, ``mismatch/abs_max``). A panel with no data says
    "not measured". ``title`` defaults to the name of the folder holding ``path`` (the
    run directory). The held-out accuracy before RL is the row of step 0 (labelled
    "before RL"). 1500x1000 pixels. Uses matplotlib's Agg
    canvas directly, so the global backend of a host program (e.g. a notebook) is left alone.
    """
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    rows = sorted(rows, key=lambda r: r["step"])
    name = title or path.resolve().parent.name
    trained = [r["step"] for r in rows if r["step"] >= 1]
    span = f"steps {trained[0]}-{trained[-1]}" if trained else "no steps logged"
    with rc_context({"font.size": 12, "axes.titlesize": 14, "legend.fontsize": 10, "figure.titlesize": 16}):
        fig = Figure(figsize=(15, 10), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(2, 2)
        for ax, (panel_title, draw) in zip(axes.flat, PANELS):
            ax.set_title(panel_title)
            if draw(ax, rows):
                ax.set_xlabel("step")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(True, alpha=0.3)
            else:
                ax.set_ylabel("")
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", fontsize=16,
                        color="gray", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
        fig.suptitle(f"flowrl run: {name} ({span})")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")


SUMMARY_KEYS: dict[str, str] = {
    "reward/mean": "max",
    "reward/std": "max",
    "eval/accuracy": "max",
    "eval/reward": "max",
    "kl/ref": "min",
    "mismatch/abs_mean": "min",
    "mismatch/abs_max": "min",
    "mismatch/kl": "min",
    "perf/tokens_per_s": "max",
    "perf/step_s": "min",
}
"""Key series :func:`summarize` reports, with which direction is better. ``loss/*`` keys
are added as they appear (lower is better), and so are the per-owner names of these keys
(``reward/<op id>/mean`` ..., :mod:`flowrl.runtime.metric_names`) when a flow has several producers."""


def _series_stats(rows: list[dict], key: str, better: str) -> dict[str, Any] | None:
    present = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), numbers.Real)]
    if not present:
        return None
    finite = [(s, float(v)) for s, v in present if math.isfinite(v)]
    stats: dict[str, Any] = {
        "first": float(present[0][1]), "first_step": present[0][0],
        "last": float(present[-1][1]), "last_step": present[-1][0],
        "count": len(present),
    }
    if finite:
        pick = max if better == "max" else min
        # Ties go to the earliest step (the first time the best value was reached).
        best_step, best = pick(finite, key=lambda p: (p[1], -p[0]) if better == "max" else (p[1], p[0]))
        stats.update(best=best, best_step=best_step, mean=sum(v for _, v in finite) / len(finite))
    return stats


def startup_report(timeline: Timeline, t0: float, t1: float) -> dict:
    """What a run's start-up (``t0`` to ``t1``, ``time.time()`` seconds: from setting up to the engines
    ready) was made of, from the timeline's ``start:*`` events (:data:`SETUP_STEP`).

    ``{"seconds", "driver": {part: s}, "engines": {lane: {"process_s", "engine_s"}}, "line"}``: the
    driver's parts in order (``check``, ``models``, ``data``, ``rewards``, ``ray``, ``engines``,
    ``placement``, ``syncs``, ``envs``); per engine actor, its process's start (Python, Ray's worker) until
    its ``__init__`` and then building the engine (imports included: vLLM's alone is most of it on CPU);
    ``line`` says it in one line, naming the slowest actor.
    """
    driver: dict[str, float] = {}
    engines: dict[str, dict[str, float]] = {}
    for (lane, name), sec in timeline.lane_seconds(SETUP_STEP, "start:").items():
        part = name[len("start:"):]
        if lane == "driver":
            driver[part] = round(sec, 3)
        else:
            engines.setdefault(lane, {})[f"{part}_s"] = round(sec, 3)
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in driver.items() if v >= 0.05)
    line = f"start-up {t1 - t0:.1f}s: {parts}"
    if engines:
        lane, e = max(engines.items(), key=lambda kv: sum(kv[1].values()))
        line += (f" (slowest engine {lane}: process {e.get('process_s', 0.0):.1f}s, "
                 f"engine {e.get('engine_s', 0.0):.1f}s)")
    return {"seconds": round(t1 - t0, 3), "driver": driver, "engines": engines, "line": line}


def summarize(rows: list[dict]) -> dict:
    """First/last/best of the key series, for the final report.

    Returns ``{"steps": {"count", "first", "last"}`` (RL steps: 1, 2, ...; the row of step 0,
    before RL, counts only in the series), ``"time_total_s": {op: seconds},
    <key>: {"first", "first_step", "last", "last_step", "count", "best", "best_step",
    "mean"}}`` for every key of :data:`SUMMARY_KEYS` (and its per-owner names) and every
    ``loss/*`` key present.
    ``first``/``last`` are the raw values (a NaN loss at the end shows as NaN);
    ``best``/``mean`` use finite values only and are absent if there are none.
    """
    rows = sorted(rows, key=lambda r: r["step"])
    trained = [r["step"] for r in rows if r["step"] >= 1]
    out: dict[str, Any] = {
        "steps": {"count": len(trained), "first": trained[0] if trained else None,
                  "last": trained[-1] if trained else None},
    }
    losses = sorted({k for r in rows for k in r if k.startswith("loss/")})
    owned = sorted({k for r in rows for k in r if k not in SUMMARY_KEYS and unowned_name(k, SUMMARY_KEYS)})
    for key, better in [*SUMMARY_KEYS.items(), *((k, SUMMARY_KEYS[unowned_name(k, SUMMARY_KEYS)]) for k in owned),
                        *((k, "min") for k in losses)]:
        stats = _series_stats(rows, key, better)
        if stats is not None:
            out[key] = stats
    totals: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("time/") and isinstance(value, numbers.Real) and math.isfinite(value):
                totals[key[len("time/"):]] = totals.get(key[len("time/"):], 0.0) + float(value)
    out["time_total_s"] = totals
    return out
