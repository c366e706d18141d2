"""A discrete-event simulator of an RL plan over many steps, with long-tailed response lengths.

The input is a :class:`SimSpec`: the step's phases in dependency order (generate, the
train-engine ops, reward and driver ops, the resync), each on a **lane** (a set of GPUs
that runs one thing at a time: colocated engines share a lane, disaggregated pools have
their own), the staleness and the partial-rollout setting. The output is a
:class:`SimResult`: steady-state step time, throughput, bubble fraction, per-lane
utilisation, the average time of each phase, and a timeline for Gantt charts.

What is modelled
  * **The runtime's modulo schedule** (:mod:`flowrl.runtime.pipeline`): the producer
    phases (generate, and those marked ``stage = "producer"``: sampling, scoring) of a step
    run one after another on a producer thread, the consumer phases (log-probs, update,
    resync...) one after another on the driver's main thread; the producers of steps up to
    k + depth - 1 are queued before step k's consumers run (depth = staleness, one less when
    partial rollouts are recycled).
  * **Generation** on ``replicas`` rollout replicas, each with ``concurrency`` slots
    (continuous batching): requests go round-robin to replicas, start FIFO as slots free,
    and take ``prefill + length x`` the iteration time, which is ``iter_s`` plus ``seq_s``
    per sequence actually running (the batch shrinks as the queue empties); each replica
    also spends ``request_s`` of serial work per request. Lengths are drawn per request from
    a lognormal or Pareto distribution capped at ``max_tokens`` (:class:`LengthDist`), so a
    step waits for its longest responses: the long-tail bubble. A generate call drains: the
    next step's requests start when it has returned.
  * **Staleness** s: generation of step j reads the weights pushed at step j - depth (the
    loop-carried weight edge has distance s), so it starts once that resync is done; the
    resync itself first waits for every queued generation (weights never change under a
    running generation, as in the runtime).
  * **Partial rollout** (over-provision f): f x N requests are in flight (new ones plus
    those recycled from the previous step, which keep their progress but re-prefill
    their prefix); the step stops at the N-th completion; unfinished requests are
    recycled (``recycle``) or dropped.
  * **Resync**: blocks the trainer's lane for ``block_s`` (packing, or the whole transfer
    without overlap) and delivers the weights ``seconds`` after it starts.
  * **Lanes**: a lane with GPUs runs one phase at a time (colocated engines time-share a
    GPU); lanes of 0 GPUs (driver, reward workers) do not serialise.

Utilisation counts a rollout replica busy for ``(prefill + tokens x iteration) / concurrency``
per request: decoding below full batch is counted as the bubble it is.

Deterministic for a given ``seed`` (``random.Random``); pure Python.

>>> spec = SimSpec(phases=(
...     Phase("gen", "generate", "gpu", (), gen=GenPhase(replicas=2, gpus_per_replica=1, concurrency=8,
...           iter_s=0.01, prefill_s=0.0, samples=16, prompt_tokens=8,
...           lengths=LengthDist("lognormal", median=50, sigma=1.0, cap=400))),
...     Phase("update", "work", "gpu", ("gen",), seconds=0.5),
...     Phase("resync", "resync", "gpu", ("update",), seconds=0.1, block_s=0.1, gates=("gen",))),
...     lanes={"gpu": 2})
>>> r = simulate(spec, steps=6, seed=0)
>>> r.step_s > 0.6 and 0 < r.bubble < 1
True
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache


# ---- response lengths ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDist:
    """Response lengths in tokens: lognormal (``median``, log-space ``sigma``) or Pareto
    (``median``, shape ``alpha``), at least 1 and capped at ``cap`` (max_tokens)."""

    kind: str
    median: float
    sigma: float = 1.0
    alpha: float = 1.5
    cap: int = 1024

    def sample(self, rng: random.Random) -> int:
        """One length: inverse-CDF sampling from a table of :data:`TABLE` quantiles (fast, and the
        extreme tail is capped at ``max_tokens`` anyway)."""
        return _table(self)[int(rng.random() * TABLE)]

    def draw(self, rng: random.Random, n: int) -> list[int]:
        """``n`` lengths."""
        t, r = _table(self), rng.random
        return [t[int(r() * TABLE)] for _ in range(n)]

    def quantile(self, q: float) -> float:
        """The q-quantile (0 < q < 1) of the capped distribution, tokens."""
        q = min(max(q, 1e-9), 1 - 1e-12)
        if self.kind == "pareto":
            xm = self.median / 2 ** (1 / self.alpha)
            x = xm / (1 - q) ** (1 / self.alpha)
        else:
            x = math.exp(math.log(max(self.median, 1e-9)) + self.sigma * _norm_ppf(q))
        return float(min(max(x, 1.0), self.cap))

    def mean(self) -> float:
        """Mean of the capped distribution (midpoint rule over 200 quantiles)."""
        return _mean(self)

    def with_mean(self, mean: float) -> "LengthDist":
        """The same shape (sigma or alpha, cap) with the median that gives this ``mean`` in tokens
        (a measured average response length). The median may lie above the cap: a mean near the
        cap means most responses hit it; at or above the cap, every one does (to within 1e-4)."""
        return _with_mean(self, float(mean))

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "median": self.median, "cap": self.cap}
        d.update({"sigma": self.sigma} if self.kind == "lognormal" else {"alpha": self.alpha})
        return {**d, "mean": round(self.mean(), 2)}


TABLE = 16384
"""Quantiles per length table (the largest is the 1 - 1/32768 quantile)."""
SATURATED = 1e4
"""A median this many times the cap puts all but a 1e-4 share of a lognormal (sigma up to 2.4)
or Pareto (alpha from 1) length distribution at the cap."""


@lru_cache(maxsize=256)
def _table(d: LengthDist) -> list[int]:
    return [int(min(max(round(d.quantile((i + 0.5) / TABLE)), 1), d.cap)) for i in range(TABLE)]


@lru_cache(maxsize=256)
def _with_mean(d: LengthDist, mean: float) -> LengthDist:
    """:meth:`LengthDist.with_mean`, once per distribution and mean (each estimate of a plan asks again)."""
    top = float(d.cap) * SATURATED
    if mean >= d.cap:
        at_cap = replace(d, median=float(d.cap))  # enough when nothing spreads the lengths
        return at_cap if at_cap.mean() >= d.cap else replace(d, median=top)
    lo, hi = 1e-3, top
    for _ in range(60):  # the capped mean rises monotonically with the median: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if replace(d, median=mid).mean() < mean else (lo, mid)
    return replace(d, median=round((lo + hi) / 2, 6))


@lru_cache(maxsize=4096)
def _mean(d: LengthDist) -> float:
    n = 200
    return sum(d.quantile((i + 0.5) / n) for i in range(n)) / n


def _norm_ppf(q: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    lo = 0.02425
    if q < lo:
        t = math.sqrt(-2 * math.log(q))
        return (((((c[0] * t + c[1]) * t + c[2]) * t + c[3]) * t + c[4]) * t + c[5]) / \
            ((((d[0] * t + d[1]) * t + d[2]) * t + d[3]) * t + 1)
    if q > 1 - lo:
        return -_norm_ppf(1 - q)
    t = q - 0.5
    r = t * t
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * t / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


# ---- the spec --------------------------------------------------------------------------------------


class PhaseKind(str, Enum):
    """What a phase does in the simulation (its cost comes from its fields)."""

    GENERATE = "generate"
    """Requests decoded by rollout replicas (:class:`GenPhase`)."""
    WORK = "work"
    """Fixed seconds plus seconds per trained token, on its lane."""
    RESYNC = "resync"
    """Weights sent: blocks its lane for ``block_s``, delivered ``seconds`` after it starts."""



@dataclass(frozen=True)
class GenPhase:
    """A generate op: how many replicas, how fast, how many completions the step needs."""

    replicas: int
    gpus_per_replica: int
    concurrency: int
    """Slots (concurrent sequences) per replica."""
    iter_s: float
    """Seconds per decode iteration (one token for every active sequence), its fixed part."""
    prefill_s: float
    """Seconds per prompt token of prefill (a recycled request re-prefills its prefix)."""
    samples: int
    """Completions the step needs."""
    prompt_tokens: int
    lengths: LengthDist
    overhead_s: float = 0.0
    """Fixed seconds per generate call before any token (dispatch to the replicas, result
    transfer back: a Ray round trip with the prompts and completions on CPU clusters)."""
    seq_s: float = 0.0
    """Seconds a decode iteration grows per sequence running in it (KV reads, sampling, output
    processing): an iteration takes ``iter_s + seq_s x`` the batch actually running."""
    request_s: float = 0.0
    """Serial seconds per request on its replica (input processing, detokenisation, building
    the output; ~0 on GPUs, the largest part of a tiny model's generation on CPU)."""
    trained: int = 0
    """Completions the step trains on, when fewer than ``samples`` (dynamic sampling generates
    several draws and keeps some groups); 0: all of them."""


@dataclass(frozen=True)
class Phase:
    """One op of the step template."""

    id: str
    kind: str
    """A :class:`PhaseKind` (``generate`` | ``work`` | ``resync``)."""
    lane: str
    deps: tuple[str, ...] = ()
    seconds: float = 0.0
    """``work``: fixed seconds; ``resync``: seconds until the weights have arrived."""
    per_token_s: float = 0.0
    """``work``: seconds per trained token (prompt + response) of the step's batch."""
    tokens_from: str = ""
    """The generate phase whose completions this phase processes."""
    gen: GenPhase | None = None
    gates: tuple[str, ...] = ()
    """``resync``: generate phases that read the weights it delivers."""
    block_s: float = 0.0
    """``resync``: seconds the sender's lane is busy (packing; the whole transfer without overlap)."""
    label: str = ""
    """What the breakdown calls it (``generate``, ``update``, ``logprobs``...)."""
    every: int = 1
    """``resync``: push every N-th step only."""
    stage: str = ""
    """``producer`` for phases of the producer stage besides generates (sampling, scoring:
    :func:`flowrl.runtime.pipeline.split_stages`); anything else runs on the consumer side."""


@dataclass(frozen=True)
class SimSpec:
    phases: tuple[Phase, ...]
    """In dependency order (deps refer to earlier phases of the same step)."""
    lanes: dict
    """Lane -> GPUs in it. Lanes of 0 GPUs (driver, reward and environment workers on CPUs) run
    their ops as soon as they are ready and do not count towards the bubble."""
    staleness: int = 1
    over_provision: float = 1.0
    recycle: bool = False


@dataclass
class SimResult:
    step_s: float
    """Steady-state seconds per step."""
    samples_per_s: float
    tokens_per_s: float
    """Trained tokens (prompt + response) per second."""
    gen_tokens_per_s: float
    """Generated tokens per second of the steady state (including tokens of aborted requests)."""
    bubble: float
    utilization: dict
    """Lane -> busy fraction of its GPU time."""
    breakdown: dict
    """Phase label -> seconds per step, summed over the phases with that label (generate: from
    release to the last needed completion)."""
    steps: int
    warmup: int
    timeline: list = field(default_factory=list)
    """(lane, label, step, start_s, end_s) of every phase."""
    wasted_tokens: int = 0
    """Generated tokens thrown away (partial rollout without recycling)."""
    step_ends: list = field(default_factory=list)
    by_phase: dict = field(default_factory=dict)
    """Phase id -> average seconds per step."""
    timeline_ids: list = field(default_factory=list)
    """The phase id of each :attr:`timeline` entry (same order)."""

    def trace_events(self) -> list[dict]:
        """Chrome / Perfetto trace events (``ph: X``), one lane per track, microseconds."""
        lanes = sorted({e[0] for e in self.timeline})
        tid = {l: i for i, l in enumerate(lanes)}
        ev = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[l], "args": {"name": l}} for l in lanes]
        for lane, label, step, t0, t1 in self.timeline:
            ev.append({"name": f"{label} #{step}", "ph": "X", "pid": 0, "tid": tid[lane], "ts": t0 * 1e6,
                       "dur": max(t1 - t0, 0) * 1e6, "args": {"step": step}})
        return ev


@dataclass
class _Req:
    remaining: int
    """Tokens still to generate."""
    total: int
    """Full response length."""
    done: int = 0


# ---- a measured workload ----------------------------------------------------------------------------


def with_workload(spec: SimSpec, *, prompt_tokens: float | None = None, mean_response: float | None = None,
                  seconds: dict | None = None) -> SimSpec:
    """``spec`` with what a run measured in place of the compiler's workload assumptions.

    ``prompt_tokens``: mean prompt length (tokens) of every generate; ``mean_response``: mean
    generated tokens per completion (the length distribution keeps its shape and cap, its
    median moves, :meth:`LengthDist.with_mean`); ``seconds``: phase id or label -> measured
    fixed seconds of a ``work`` phase (e.g. ``{"reward": 0.002}``; its per-token cost is
    dropped). Costs per token stay the cost model's: only the sizes change, so the prediction
    still tests the cost model and the simulator, not the measurement.
    """
    out = []
    for ph in spec.phases:
        if ph.kind == PhaseKind.GENERATE and ph.gen is not None:
            g = ph.gen
            if prompt_tokens is not None:
                g = replace(g, prompt_tokens=max(int(round(prompt_tokens)), 1))
            if mean_response is not None:
                g = replace(g, lengths=g.lengths.with_mean(mean_response))
            ph = replace(ph, gen=g)
        elif ph.kind == PhaseKind.WORK and seconds:
            key = ph.id if ph.id in seconds else (ph.label if ph.label in seconds else None)
            if key is not None:
                ph = replace(ph, seconds=float(seconds[key]), per_token_s=0.0)
        out.append(ph)
    return replace(spec, phases=tuple(out))


# ---- the simulation --------------------------------------------------------------------------------


def depth_of(spec: SimSpec) -> int:
    """Producer stages in flight (the runtime's modulo-schedule depth,
    :func:`flowrl.runtime.partial.producer_depth`): ``s``, or ``s - 1`` when recycling partial
    rollouts (recycled groups are one step older than fresh ones)."""
    if spec.recycle and spec.over_provision > 1.0:
        return max(1, spec.staleness - 1)
    return max(1, spec.staleness)


MAX_STEPS = 1000
"""Steps one simulation runs at most (each is a few phases; a Gantt chart draws a few)."""


def simulate(spec: SimSpec, steps: int = 12, seed: int = 0) -> SimResult:
    """Run ``steps`` steps of ``spec``; statistics over the steps after a warm-up of ``depth + 1``.

    The runtime's modulo schedule (:mod:`flowrl.runtime.pipeline`), event for event: producer
    phases run one after another on a producer thread, ``depth`` steps ahead of the consumer
    phases, which run one after another on the driver's main thread. Before step k's consumers
    start, the producers of steps up to k + depth - 1 are queued; a producer's generate reads
    the weights pushed at step ``j - depth``; a resync first waits for every queued producer
    (so a generation never sees weights change under it) and the consumers of the next step
    start once it is done. A lane with GPUs runs one phase at a time (colocated engines take
    turns); lanes of 0 GPUs do not serialise.
    """
    rng = random.Random(seed)
    steps = min(max(steps, 3), MAX_STEPS)
    depth = min(depth_of(spec), steps)  # deeper only queues producers of steps never simulated (bounded lists)
    warm = min(depth + 1, steps // 2)
    prod_ids = producer_ids(spec)
    producers = [p for p in spec.phases if p.id in prod_ids]
    consumers = [p for p in spec.phases if p.id not in prod_ids]
    lane_free = {lane: 0.0 for lane in spec.lanes}
    recycled: dict[str, list[_Req]] = {p.id: [] for p in spec.phases if p.kind == PhaseKind.GENERATE}
    pushes: list[dict[str, float] | None] = []  # per step: gated generate id -> weights available at
    busy = {lane: 0.0 for lane in spec.lanes}  # GPU-seconds within the measured window
    durations: dict[str, list[float]] = {}
    per_phase: dict[str, list[float]] = {}
    timeline: list = []
    ids: list[str] = []
    # producers run up to depth - 1 steps past the last consumer, as in a longer run
    ends: list[dict[str, float]] = [{} for _ in range(steps + depth)]
    tokens: list[dict[str, int]] = [{} for _ in range(steps + depth)]
    step_end: list[float] = []
    window_start = 0.0
    stats = {"trained": 0, "samples": 0, "gen": 0, "wasted": 0}
    threads = {"producer": 0.0, "main": 0.0}

    def record(ph: Phase, k: int, start: float, stop: float, seconds: float, lane_busy: float) -> None:
        if k >= steps:
            return
        if k >= warm:
            busy[ph.lane] += lane_busy
            label = ph.label or (PhaseKind(ph.kind).value if ph.kind in (PhaseKind.GENERATE, PhaseKind.RESYNC) else ph.id)
            durations.setdefault(label, []).append(seconds)
            per_phase.setdefault(ph.id, []).append(seconds)
        timeline.append((ph.lane, ph.label or ph.id, k, start, stop))
        ids.append(ph.id)

    def run(ph: Phase, k: int, thread: str, not_before: float = 0.0) -> None:
        end, toks = ends[k], tokens[k]
        ready = max([threads[thread], not_before] + [end[d] for d in ph.deps if d in end])
        gpus = spec.lanes.get(ph.lane, 0)
        if gpus:
            ready = max(ready, lane_free[ph.lane])
        if ph.kind == PhaseKind.GENERATE:
            g = ph.gen
            release = max(ready, _gate(pushes, k - depth, ph.id))
            t_end, n_tok, used, n_gen, n_waste = _generate(ph, g, recycled, release + g.overhead_s, spec, rng)
            toks[ph.id] = n_tok
            stop = t_end
            if steps > k >= warm:
                stats["trained"] += n_tok
                stats["samples"] += g.trained or g.samples
                stats["gen"] += n_gen
                stats["wasted"] += n_waste
            record(ph, k, release, stop, stop - release, used)
            start = release
        elif ph.kind == PhaseKind.RESYNC:
            if (k + 1) % max(ph.every, 1):
                end[ph.id] = ready  # `every K`: no push this step; readers keep older weights
                pushes[k] = None
                return
            start = ready
            stop = start + ph.seconds
            pushes[k] = {gid: stop for gid in ph.gates}
            record(ph, k, start, stop, ph.seconds, ph.block_s * gpus)
            if gpus:
                lane_free[ph.lane] = start + ph.block_s
        else:
            start = ready
            dur = ph.seconds + ph.per_token_s * toks.get(ph.tokens_from, 0)
            stop = start + dur
            record(ph, k, start, stop, dur, dur * gpus)
        if gpus and ph.kind != PhaseKind.RESYNC:
            lane_free[ph.lane] = stop
        end[ph.id] = stop
        threads[thread] = stop

    produced = 0
    for k in range(steps):
        while produced < k + depth:  # the pipeline fills up to step k + depth - 1
            pushes.append({})
            for ph in producers:
                run(ph, produced, "producer")
            produced += 1
        for ph in consumers:
            # a resync waits for every queued producer stage first (the runtime's drain)
            run(ph, k, "main", not_before=threads["producer"] if ph.kind == PhaseKind.RESYNC else 0.0)
        if k == warm - 1:
            window_start = max(ends[k].values(), default=0.0)
        step_end.append(max(ends[k].values(), default=0.0))
    window = max(step_end[-1] - window_start, 1e-12)
    n = steps - warm
    gpu_total = sum(spec.lanes.values())
    util = {lane: (min(busy[lane] / (gpus * window), 1.0) if gpus else 0.0) for lane, gpus in spec.lanes.items()}
    bubble = 1.0 - (sum(min(busy[l], spec.lanes[l] * window) for l in spec.lanes) / (gpu_total * window)
                    if gpu_total else 0.0)
    return SimResult(step_s=window / n, samples_per_s=stats["samples"] / window,
                     tokens_per_s=stats["trained"] / window, gen_tokens_per_s=stats["gen"] / window,
                     bubble=max(0.0, min(1.0, bubble)), utilization=util,
                     breakdown={k: sum(v) / n for k, v in durations.items()}, steps=steps, warmup=warm,
                     timeline=timeline, wasted_tokens=stats["wasted"], step_ends=step_end,
                     by_phase={k: sum(v) / n for k, v in per_phase.items()}, timeline_ids=ids)


def producer_ids(spec: SimSpec) -> set[str]:
    """Phases of the producer stage: those marked ``stage = "producer"`` (the compiler marks
    sampling, generation and scoring that read only the rollouts, as
    :func:`flowrl.runtime.pipeline.split_stages`); unmarked generates and what they depend on."""
    by_id = {p.id: p for p in spec.phases}
    out = {p.id for p in spec.phases if p.stage == "producer"}
    todo = [p.id for p in spec.phases if p.kind == PhaseKind.GENERATE and not p.stage]
    while todo:
        pid = todo.pop()
        if pid in out or by_id[pid].stage == "consumer":
            continue
        out.add(pid)
        todo.extend(d for d in by_id[pid].deps if d in by_id and not by_id[d].stage)
    return out


def _gate(pushes: list, src: int, gen_id: str) -> float:
    """When the weights a generation of a step reads (those pushed at step ``src``, or by the
    last push before it) are available; 0 for the initial weights."""
    while src >= 0:
        push = pushes[src]
        if push is not None and gen_id in push:
            return push[gen_id]
        src -= 1
    return 0.0


def _iteration_s(g: GenPhase, lengths: list[int]) -> float:
    """Seconds per decode iteration on a replica serving ``lengths``: the fixed part plus
    ``seq_s`` per sequence actually running. Continuous batching keeps the slots full until
    the queue empties, then the batch shrinks to the stragglers: the average batch is the
    tokens over the iterations, ``max(longest, tokens / slots)`` of them."""
    if not g.seq_s or not lengths:
        return g.iter_s
    total = sum(lengths)
    iters = max(max(lengths), total / max(g.concurrency, 1))
    return g.iter_s + g.seq_s * total / iters


SIM_REQUESTS = 8192
"""Requests one simulated generate call draws at most: a larger call is simulated at scale (below)."""
SIM_REPLICAS = 64
"""Rollout replicas one simulated generate call spreads its requests over at most."""


def scaled(g: GenPhase, over_provision: float = 1.0) -> tuple[GenPhase, float, float, float]:
    """``g`` reduced to at most :data:`SIM_REPLICAS` replicas and :data:`SIM_REQUESTS` requests, with
    (work, time, busy) factors: multiply the reduced call's tokens and samples by the first, its
    duration by the second, its busy GPU time by the third. ``(g, 1, 1, 1)`` when ``g`` is small
    enough (then the simulation is exact), so the estimate is bounded in time and memory whatever
    the numbers.

    Replicas are alike: fewer of them with the same load each take as long (work ``x R/R'``).
    A replica's queue of ``L`` requests on ``b`` slots is modelled by ``L/f`` requests on ``b/f``
    slots: the same decode iterations, so the same time; where ``b < f`` (one slot left) the
    throughput-bound queue's duration is scaled by ``f/b``. Per-sequence and per-request costs
    are scaled by ``b/b'`` so a running batch costs what the full one does.

    >>> small = GenPhase(2, 1, 8, 0.01, 0.0, 64, 8, LengthDist("lognormal", 50))
    >>> scaled(small)[0] is small
    True
    >>> big, work, time, busy = scaled(replace(small, samples=10**12, replicas=10**6, concurrency=256))
    >>> (big.replicas, big.samples, big.concurrency) == (SIM_REPLICAS, SIM_REQUESTS, 1) and work > 1e8
    True
    """
    replicas, samples = max(g.replicas, 1), max(g.samples, 1)
    most = max(int(SIM_REQUESTS / max(over_provision, 1.0)), 1)  # partial rollout issues over_provision x
    if replicas <= SIM_REPLICAS and samples <= most:
        return g, 1.0, 1.0, 1.0
    r = min(replicas, SIM_REPLICAS)
    n = max(math.ceil(samples * r / replicas), 1)  # the same load per replica
    f = max(n / most, 1.0)
    n = min(n, most)
    b = max(g.concurrency, 1)
    b2 = max(int(round(b / f)), 1)
    slot = b / b2  # each reduced slot stands for this many
    time = f / slot
    work = samples / n
    trained = max(int(round(g.trained * n / samples)), 1) if g.trained else 0
    return replace(g, replicas=r, samples=n, concurrency=b2, trained=trained, seq_s=g.seq_s * slot,
                   request_s=g.request_s * slot), work, time, work / slot


def _generate(ph: Phase, g: GenPhase, recycled: dict, release: float, spec: SimSpec, rng: random.Random):
    """One generate call (it drains: every request of the step ends before the call returns);
    returns (end time, trained tokens, busy GPU-s, generated, wasted). A call too large to
    simulate request by request is simulated at scale (:func:`scaled`)."""
    small, work, time, busy = scaled(g, spec.over_provision)
    if small is g:
        return _generate_exact(ph, g, recycled, release, spec, rng)
    t_end, toks, used, gen, waste = _generate_exact(ph, small, recycled, release, spec, rng)
    return release + (t_end - release) * time, toks * work, used * busy, gen * work, waste * work


def _generate_exact(ph: Phase, g: GenPhase, recycled: dict, release: float, spec: SimSpec, rng: random.Random):
    partial = spec.over_provision > 1.0
    b = max(g.concurrency, 1)
    n_rep = max(g.replicas, 1)
    pre0, pre_tok = g.prompt_tokens * g.prefill_s, g.prefill_s
    pop, push = heapq.heappop, heapq.heappush
    if not partial:  # the common case, kept lean: lengths straight from the table
        lens = g.lengths.draw(rng, g.samples)
        t_end, tokens, used = release, 0, 0.0
        for r in range(n_rep):
            mine = lens[r::n_rep]
            it = _iteration_s(g, mine)
            start = release + len(mine) * g.request_s  # the replica's serial work per request
            slots = [start] * min(b, len(mine))  # slots no request reaches change nothing
            for length in mine:
                fin = pop(slots) + pre0 + length * it
                push(slots, fin)
                if fin > t_end:
                    t_end = fin
            tokens += sum(mine)
            used += len(mine) * pre0 + sum(mine) * it
        n = len(lens)
        kept = (g.trained or n) / max(n, 1)  # the trained share of what was generated
        return t_end, kept * (n * g.prompt_tokens + tokens), used / b * g.gpus_per_replica, tokens, 0
    issued = math.ceil(g.samples * spec.over_provision)
    reqs = recycled[ph.id]
    recycled[ph.id] = []
    fresh = max(issued - len(reqs), 0)
    reqs = reqs + [_Req(l, l) for l in g.lengths.draw(rng, fresh)]
    # (finish, start, prefill, request, iteration seconds)
    runs: list[tuple[float, float, float, _Req, float]] = []
    for r in range(n_rep):
        mine = reqs[r::n_rep]
        it = _iteration_s(g, [q.remaining for q in mine])
        slots = [release + len(mine) * g.request_s] * min(b, len(mine))
        for req in mine:
            pre = pre0 + req.done * pre_tok  # a recycled request re-prefills its prefix
            start = pop(slots)
            fin = start + pre + req.remaining * it
            push(slots, fin)
            runs.append((fin, start, pre, req, it))
    runs.sort(key=lambda x: x[0])
    need = min(g.samples, len(runs))
    t_end = runs[need - 1][0] if need else release
    toks = gen = waste = 0
    used = 0.0
    carry: list[_Req] = []
    for fin, start, pre, req, it in runs:
        if fin <= t_end and need > 0:
            need -= 1
            toks += g.prompt_tokens + req.total
            gen += req.remaining
            used += pre + req.remaining * it
            continue
        done = int(min(max((t_end - start - pre) / it, 0.0), req.remaining)) if it > 0 else 0
        used += (min(pre, max(t_end - start, 0.0)) + done * it)
        gen += done
        if spec.recycle:
            carry.append(_Req(req.remaining - done, req.total, req.done + done))
        else:
            waste += req.done + done
    recycled[ph.id] = carry
    return t_end, toks, used / b * g.gpus_per_replica, gen, waste


__all__ = ["LengthDist", "GenPhase", "Phase", "PhaseKind", "SimSpec", "SimResult", "simulate", "with_workload"]


