"""A discrete-event simulator of an RL plan over many steps, with long-tailed response lengths.

The input is a :class:`SimSpec`: the step's phases in dependency order (generate, the
train-engine ops, reward and driver ops, the resync), each on a **lane** (a set of GPUs
that runs one thing at a time: colocated engines share a lane, disaggregated pools have
their own), the staleness and the partial-rollout setting. The output is a
:class:`SimResult`: steady-state step time, throughput, bubble fraction, per-lane
utilisation, the average time of each phase, and a timeline for Gantt charts.

What is modelled
  * **Generation** on ``replicas`` rollout replicas, each with ``concurrency`` slots
    (continuous batching): requests go round-robin to replicas, start FIFO as slots free,
    and take ``prefill_s + length x iter_s``. Lengths are drawn per request from a
    lognormal or Pareto distribution capped at ``max_tokens`` (:class:`LengthDist`), so a
    step waits for its longest responses: the long-tail bubble.
  * **Staleness** s: generation of step k may start once the resync of step k - s is done
    (the loop-carried weight edge has distance s). On a lane of its own (disaggregated),
    each replica's slots persist across steps, so fast replicas start the next step's
    requests while stragglers finish (streaming, AReaL-style); on a shared lane
    (colocated, time-sharing) the engine drains every step.
  * **Partial rollout** (over-provision f): f x N requests are in flight (new ones plus
    those recycled from the previous step, which keep their progress but re-prefill
    their prefix); the step stops at the N-th completion; unfinished requests are
    recycled (``recycle``) or dropped.
  * **Resync**: blocks the trainer's lane for ``block_s`` (packing, or the whole transfer
    without overlap) and delivers the weights ``seconds`` after it starts.

Utilisation counts a rollout replica busy for ``(prefill + tokens x iter_s) / concurrency``
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
        (a measured average response length); the cap when ``mean`` is at or above it."""
        if mean >= self.cap:
            return replace(self, median=float(self.cap))
        lo, hi = 1e-3, float(self.cap)
        for _ in range(60):  # the capped mean rises monotonically with the median: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if replace(self, median=mid).mean() < mean else (lo, mid)
        return replace(self, median=round((lo + hi) / 2, 6))

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "median": self.median, "cap": self.cap}
        d.update({"sigma": self.sigma} if self.kind == "lognormal" else {"alpha": self.alpha})
        return d


TABLE = 16384
"""Quantiles per length table (the largest is the 1 - 1/32768 quantile)."""


@lru_cache(maxsize=256)
def _table(d: LengthDist) -> list[int]:
    return [int(min(max(round(d.quantile((i + 0.5) / TABLE)), 1), d.cap)) for i in range(TABLE)]


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


@dataclass(frozen=True)
class GenPhase:
    """A generate op: how many replicas, how fast, how many completions the step needs."""

    replicas: int
    gpus_per_replica: int
    concurrency: int
    """Slots (concurrent sequences) per replica."""
    iter_s: float
    """Seconds per decode iteration (one token for every active sequence)."""
    prefill_s: float
    """Seconds per prompt token of prefill (a recycled request re-prefills its prefix)."""
    samples: int
    """Completions the step needs."""
    prompt_tokens: int
    lengths: LengthDist
    overhead_s: float = 0.0
    """Fixed seconds per generate call before any token (dispatch to the replicas, result
    transfer back: a Ray round trip with the prompts and completions on CPU clusters)."""


@dataclass(frozen=True)
class Phase:
    """One op of the step template."""

    id: str
    kind: str
    """``generate`` | ``work`` | ``resync``."""
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


class _Replica:
    """Slots of one rollout replica: a heap of times at which each slot is free."""

    def __init__(self, slots: int):
        self.slots = [0.0] * max(slots, 1)

    def reset(self, t: float) -> None:
        self.slots = [t] * len(self.slots)


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
        if ph.kind == "generate" and ph.gen is not None:
            g = ph.gen
            if prompt_tokens is not None:
                g = replace(g, prompt_tokens=max(int(round(prompt_tokens)), 1))
            if mean_response is not None:
                g = replace(g, lengths=g.lengths.with_mean(mean_response))
            ph = replace(ph, gen=g)
        elif ph.kind == "work" and seconds:
            key = ph.id if ph.id in seconds else (ph.label if ph.label in seconds else None)
            if key is not None:
                ph = replace(ph, seconds=float(seconds[key]), per_token_s=0.0)
        out.append(ph)
    return replace(spec, phases=tuple(out))


# ---- the simulation --------------------------------------------------------------------------------


def simulate(spec: SimSpec, steps: int = 12, seed: int = 0) -> SimResult:
    """Run ``steps`` steps of ``spec``; statistics over the steps after a warm-up of ``staleness + 1``."""
    rng = random.Random(seed)
    steps = max(steps, 3)
    warm = min(spec.staleness + 1, steps // 2)
    gen_lanes = {p.lane for p in spec.phases if p.kind == "generate"}
    shared = {p.lane for p in spec.phases if p.kind != "generate"}
    exclusive = gen_lanes - shared
    lane_free = {lane: 0.0 for lane in spec.lanes}
    replicas = {p.id: [_Replica(p.gen.concurrency) for _ in range(p.gen.replicas)]
                for p in spec.phases if p.kind == "generate"}
    recycled: dict[str, list[_Req]] = {p.id: [] for p in spec.phases if p.kind == "generate"}
    resync_end: list[dict[str, float]] = []  # per step: gated generate id -> weights available at
    busy = {lane: 0.0 for lane in spec.lanes}  # GPU-seconds within the measured window
    durations: dict[str, list[float]] = {}
    per_phase: dict[str, list[float]] = {}
    timeline: list = []
    ids: list[str] = []
    step_end: list[float] = []
    window_start = 0.0
    trained_tokens = samples_done = gen_tokens = wasted = 0
    for k in range(steps):
        measuring = k >= warm
        if k == warm:
            window_start = step_end[-1] if step_end else 0.0
        end: dict[str, float] = {}
        tokens: dict[str, int] = {}
        gates_k: dict[str, float] = {}
        for ph in spec.phases:
            ready = max((end[d] for d in ph.deps if d in end), default=0.0)
            if ph.kind == "generate":
                g = ph.gen
                gate = _gate(resync_end, k - spec.staleness, ph.id)
                release = max(ready, gate)
                if ph.lane not in exclusive:
                    release = max(release, lane_free[ph.lane])
                    for r in replicas[ph.id]:
                        r.reset(release + g.overhead_s)
                # the call's fixed cost (dispatch, results back) delays the first token, not the slots
                t_end, toks, used, n_gen, n_waste = _generate(ph, g, replicas[ph.id], recycled,
                                                              release + g.overhead_s, spec, rng)
                tokens[ph.id] = toks
                if ph.lane not in exclusive:
                    lane_free[ph.lane] = t_end
                end[ph.id] = t_end
                if measuring:
                    busy[ph.lane] += used
                    trained_tokens += toks
                    samples_done += g.samples
                    gen_tokens += n_gen
                    wasted += n_waste
                    durations.setdefault(ph.label or "generate", []).append(t_end - release)
                    per_phase.setdefault(ph.id, []).append(t_end - release)
                timeline.append((ph.lane, ph.label or ph.id, k, release, t_end))
                ids.append(ph.id)
            elif ph.kind == "resync":
                if (k + 1) % max(ph.every, 1):
                    end[ph.id] = ready  # `every K`: no push this step; readers keep older weights
                    continue
                start = max(ready, lane_free[ph.lane])
                lane_free[ph.lane] = start + ph.block_s
                done = start + ph.seconds
                end[ph.id] = done
                for gid in ph.gates:
                    gates_k[gid] = max(gates_k.get(gid, 0.0), done)
                if measuring:
                    busy[ph.lane] += ph.block_s * spec.lanes.get(ph.lane, 0)
                    durations.setdefault(ph.label or "resync", []).append(ph.seconds)
                    per_phase.setdefault(ph.id, []).append(ph.seconds)
                timeline.append((ph.lane, ph.label or ph.id, k, start, done))
                ids.append(ph.id)
            else:
                dur = ph.seconds + ph.per_token_s * tokens.get(ph.tokens_from, 0)
                # CPU lanes (driver, reward workers) do not hold a step's ops back behind the previous
                # step's: the driver samples step k+1's prompts while step k trains.
                start = max(ready, lane_free[ph.lane]) if spec.lanes.get(ph.lane) else ready
                lane_free[ph.lane] = start + dur
                end[ph.id] = start + dur
                if measuring:
                    busy[ph.lane] += dur * spec.lanes.get(ph.lane, 0)
                    durations.setdefault(ph.label or ph.id, []).append(dur)
                    per_phase.setdefault(ph.id, []).append(dur)
                timeline.append((ph.lane, ph.label or ph.id, k, start, start + dur))
                ids.append(ph.id)
        resync_end.append(gates_k)
        step_end.append(max(end.values(), default=0.0))
    window = max(step_end[-1] - window_start, 1e-12)
    n = steps - warm
    gpu_total = sum(spec.lanes.values())
    util = {lane: (min(busy[lane] / (gpus * window), 1.0) if gpus else 0.0) for lane, gpus in spec.lanes.items()}
    bubble = 1.0 - (sum(min(busy[l], spec.lanes[l] * window) for l in spec.lanes) / (gpu_total * window)
                    if gpu_total else 0.0)
    step_s = window / n
    return SimResult(step_s=step_s, samples_per_s=samples_done / window, tokens_per_s=trained_tokens / window,
                     gen_tokens_per_s=gen_tokens / window, bubble=max(0.0, min(1.0, bubble)), utilization=util,
                     breakdown={k: sum(v) / n for k, v in durations.items()}, steps=steps, warmup=warm,
                     timeline=timeline, wasted_tokens=wasted, step_ends=step_end,
                     by_phase={k: sum(v) / n for k, v in per_phase.items()}, timeline_ids=ids)


def _gate(resync_end: list, src: int, gen_id: str) -> float:
    """When the weights generation of a step reads (those of step ``src``, or of the last push
    before it) are available; 0 for the initial weights."""
    while src >= 0:
        if gen_id in resync_end[src]:
            return resync_end[src][gen_id]
        src -= 1
    return 0.0


def _generate(ph: Phase, g: GenPhase, reps: list[_Replica], recycled: dict, release: float, spec: SimSpec,
              rng: random.Random):
    """One step of a generate phase; returns (end time, trained tokens, busy GPU-s, generated, wasted)."""
    partial = spec.over_provision > 1.0
    issued = math.ceil(g.samples * spec.over_provision) if partial else g.samples
    b = max(g.concurrency, 1)
    n_rep = len(reps)
    pre0, pre_tok, it = g.prompt_tokens * g.prefill_s, g.prefill_s, g.iter_s
    pop, push = heapq.heappop, heapq.heappush
    if not partial:  # the common case, kept lean: lengths straight from the table
        t_end, tokens, rep_i = release, 0, 0
        heaps = [r.slots for r in reps]
        lens = g.lengths.draw(rng, g.samples)
        for length in lens:
            slots = heaps[rep_i]
            rep_i = rep_i + 1 if rep_i + 1 < n_rep else 0
            free = pop(slots)
            fin = (release if release > free else free) + pre0 + length * it
            push(slots, fin)
            if fin > t_end:
                t_end = fin
            tokens += length
        n = len(lens)
        used = (n * pre0 + tokens * it) / b * g.gpus_per_replica
        return t_end, n * g.prompt_tokens + tokens, used, tokens, 0
    reqs = recycled[ph.id]
    recycled[ph.id] = []
    fresh = max(issued - len(reqs), 0)
    reqs = reqs + [_Req(l, l) for l in g.lengths.draw(rng, fresh)]
    # (finish, start, prefill, request, replica index)
    runs: list[tuple[float, float, float, _Req, int]] = []
    for i, req in enumerate(reqs):
        slots = reps[i % n_rep].slots
        pre = pre0 + req.done * pre_tok
        free = pop(slots)
        start = release if release > free else free
        fin = start + pre + req.remaining * it
        push(slots, fin)
        runs.append((fin, start, pre, req, i % n_rep))
    runs.sort(key=lambda r: r[0])
    need = min(g.samples, len(runs))
    t_end = runs[need - 1][0] if need else release
    toks = gen = waste = 0
    used = 0.0
    carry: list[_Req] = []
    for fin, start, pre, req, rep_i in runs:
        if fin <= t_end and need > 0:
            need -= 1
            toks += g.prompt_tokens + req.total
            gen += req.remaining
            used += pre + req.remaining * g.iter_s
            continue
        done = int(min(max((t_end - start - pre) / g.iter_s, 0.0), req.remaining)) if g.iter_s > 0 else 0
        used += (min(pre, max(t_end - start, 0.0)) + done * g.iter_s)
        gen += done
        if spec.recycle:
            carry.append(_Req(req.remaining - done, req.total, req.done + done))
        else:
            waste += req.done + done
    for rep in reps:  # aborted slots are free at the stop
        rep.slots = sorted(min(s, t_end) for s in rep.slots)
    recycled[ph.id] = carry
    return t_end, toks, used / b * g.gpus_per_replica, gen, waste


__all__ = ["LengthDist", "GenPhase", "Phase", "SimSpec", "SimResult", "simulate", "with_workload", "compare_async"]


# ---- the async anchors -------------------------------------------------------------------------------

ANCHORS = {
    "AReaL": "2.77x step throughput from fully asynchronous RL over synchronous (AReaL, 2025)",
    "veRL": "2.35-2.67x from asynchronous / one-step-off pipelines over synchronous (veRL recipes)",
    "NeMo-RL": "111 s -> 64 s per step with one-step-off (1.73x) (NeMo-RL)",
    "APRIL": "+22.5% rollout throughput from partial rollouts (APRIL)",
}


def compare_async(model: str = "Qwen/Qwen2.5-7B", gpus: int = 64, gpu: str = "H100", *, gpus_per_node: int = 8,
                  batch: int = 512, group: int = 8, max_tokens: int = 8192, median: float | None = None,
                  sigma: float = 1.0, over_provision: float = 1.5, steps: int = 10, seed: int = 0) -> list[dict]:
    """The async comparison of the issue, simulated: sync vs one-step-off vs bounded async (s=4)
    vs partial rollout, for ``model`` on ``gpus`` GPUs with long-tailed response lengths.

    Each mode gets its best schedule from ``schedule auto``'s search restricted to that mode
    (sync: staleness 1; one-step-off: 2; bounded: 4; partial: staleness 2 +
    ``partial_rollout(over_provision)``). Returns one dict per mode: ``mode``, ``step_s``,
    ``speedup`` (vs sync), ``rollout_tokens_per_s`` and ``rollout_gain`` (generated tokens per
    second of generation time, APRIL's metric, vs sync), ``bubble``, ``schedule`` (a one-line
    summary), and the published ``anchor`` it compares with. Imports the compiler (the flow is
    compiled for real); no torch.
    """
    from flowrl.compiler.auto import async_modes

    return async_modes(model=model, gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node, batch=batch, group=group,
                       max_tokens=max_tokens, median=median, sigma=sigma, over_provision=over_provision,
                       steps=steps, seed=seed, anchors=ANCHORS)
