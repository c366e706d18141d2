"""The driver: check a plan, start what it names, then run steps.

One process drives everything (a single controller, as in HybridFlow). :class:`Runtime`
composes a run's typed pieces: its data (:class:`~flowrl.runtime.data.RunData`), its reward
scorers (:mod:`flowrl.runtime.rewards`), its engines (:class:`~flowrl.runtime.fleet.Fleet`,
one record per model), the partial-rollout buffers and the event log. Handlers get them as a
:class:`~flowrl.runtime.step.Services` record, never the runtime itself; each op is dispatched
to the handler its catalogue record names (:func:`~flowrl.runtime.handlers.handler_of`). The
driver reads only the :class:`~flowrl.plan.ExecutionPlan`.

A run directory holds ``plan.json``, ``metrics.jsonl``, ``trace.json``, ``curves.png``,
``summary.json``, ``events.log``, ``placement.json`` and ``checkpoints/step_NNNNNN/``
(``--save-every``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from flowrl.catalog.ops import OpKind
from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.checkpoints import resumable_checkpoint
from flowrl.runtime.export import exports_at
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.fleet import Faults, Fleet
from flowrl.runtime.observe import SETUP_STEP, startup_report
from flowrl.runtime.partial import partial_buffers, producer_depth
from flowrl.runtime.pipeline import StepPipeline
from flowrl.runtime.preemption import Preempted, SigtermGuard
from flowrl.runtime.rundir import own, tmp_sibling
from flowrl.runtime.statefile import StateFileError, read_state, refuse_unsafe_files, write_state
from flowrl.runtime.step import Services, StepContext

INFLIGHT = "inflight.json"
"""A checkpoint's in-flight producer steps (staleness > 1): ``[(step, values, metrics)]``, a state file
(:mod:`flowrl.runtime.statefile`: JSON, and ``inflight.safetensors`` for its tensors)."""
PARTIAL = "partial.json"
"""A checkpoint's partial-rollout buffers: ``{generate op id: state}``, a state file."""


def check_state(ckpt: Path) -> None:
    """Refuse a checkpoint whose driver state files (:data:`INFLIGHT`, :data:`PARTIAL`, ``driver.json``)
    are not what this flowrl writes, or that holds an older flowrl's pickles (never loaded)."""
    refuse_unsafe_files(ckpt)
    driver_state(ckpt)
    read_state(ckpt / PARTIAL)
    read_state(ckpt / INFLIGHT)


def driver_state(ckpt: Path) -> dict:
    """A checkpoint's ``driver.json`` (step, versions, samplers); not JSON of that shape: a clear error."""
    try:
        state = json.loads((ckpt / "driver.json").read_bytes().decode("utf-8"))
        int(state["step"]), state["samplers"], dict(state["train_version"]), dict(state["rollout_version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StateFileError(f"{ckpt / 'driver.json'} is not a checkpoint state this flowrl wrote "
                             f"({type(e).__name__}: {str(e)[:200]}); hint: it was damaged or replaced: resume "
                             f"from another checkpoint (`--resume-step`), or start a new run") from None
    return state


RUN_FILES = ("plan.json", "events.log", "metrics.jsonl", "trace.json", "summary.json", "curves.png")
"""The files the driver writes at the top of a run directory, listed as flowrl's before any is written."""
ATOMIC_FILES = ("metrics.jsonl", "trace.json")
"""Of those, the ones replaced through a temporary file (:func:`~flowrl.runtime.observe.atomic_write_text`)."""


def check_executable(plan: ExecutionPlan, *, external: bool = False) -> None:
    """Refuse what this machine cannot run, before any model is prepared or engine started.

    Every op has a handler, every resource a builder (by its catalogue record), every engine a
    record of its role whose layout can run and whose package is installed, every resync a
    transport this machine's platform has (the compiler checked it against the schedule's
    platform; a plan for GPUs sends over NCCL, which a CPU machine lacks: the catalogue's
    ``TRANSPORTS``). ``external``: the run joins a Ray cluster, whose own processes say whether
    they have NCCL.
    """
    from flowrl.engines.base import EngineError
    from flowrl.engines.registry import ROLLOUT_ENGINES, engine_record, missing_package, runs_on
    from flowrl.runtime.data import reader_of
    from flowrl.runtime.env_pool import env_builder_of
    from flowrl.runtime.handlers import handler_of
    from flowrl.runtime.materialize import source_of
    from flowrl.runtime.rewards import builder_of
    from flowrl.runtime.sync.from_plan import sync_problem

    for op in plan.ops:
        handler_of(op)
    for d in plan.datasets:
        reader_of(d)
    for r in plan.rewards:
        builder_of(r)
    for env in plan.envs:
        env_builder_of(env)
    installed = [k for k, s in ROLLOUT_ENGINES.items() if missing_package(s) is None]
    for m in plan.models:
        source_of(m)
        for role, e in (("train", m.train_engine), ("rollout", m.rollout_engine)):
            if e is None:
                continue
            try:
                engine_record(e.kind, role)
                spec = runs_on(e.kind, e.world_size)
            except EngineError as error:
                raise RuntimeFlowError(f"{e.origin or m.origin}: {error}") from None
            problem = missing_package(spec)
            if problem:
                hint = f", or schedule `{m.id}.{role} = {installed[0]}()`" if role == "rollout" and installed else ""
                raise RuntimeFlowError(f"{e.origin or m.origin}: {problem}{hint}")
    for r in plan.resyncs:
        # On another cluster the sender's own process knows whether it has NCCL (and says so).
        problem = sync_problem(r, nccl_elsewhere=external)
        if problem:
            raise RuntimeFlowError(f"{r.origin}: {problem}")


class EventFile:
    """``events.log``: one JSON object per event (every reward error with its traceback and what the
    function printed, what reward functions printed), plus a warning on the progress line. Secrets
    from the environment are redacted from both (:mod:`flowrl.runtime.secrets`)."""

    def __init__(self, path: Path, log):
        from flowrl.runtime.secrets import redact

        self.file = _Redacted(open(path, "a"), redact)
        self.log = log
        self._printing: set[tuple[str, str]] = set()

    def _samples(self, kind: str, op: OpPlan, step: int, records: list[dict], warning: str | None) -> None:
        """One ``{kind: record}`` line of ``op`` at ``step`` in events.log per record, then one warning."""
        for record in records:
            self.file.write(json.dumps({"step": step, "op": op.id, kind: record}) + "\n")
        self.file.flush()
        if warning:
            self.log(f"warning: step {step}: {warning} (details in events.log)")

    def reward_output(self, op: OpPlan, step: int, output: list) -> None:
        """What a reward function printed while scoring each sample (never shown on the terminal);
        the first time for ``op``, a note saying where it went."""
        self._printed("reward_output", "reward", op, step, output)

    def env_output(self, op: OpPlan, step: int, output: list) -> None:
        """What an environment printed during each episode's call, as :meth:`reward_output`."""
        self._printed("env_output", "environment", op, step, output)

    def _printed(self, kind: str, what: str, op: OpPlan, step: int, output: list) -> None:
        self._samples(kind, op, step, [{"index": i, "output": text} for i, text in output], None)
        if (kind, op.id) not in self._printing:
            self._printing.add((kind, op.id))
            self.log(f"note: the {what} of `{op.id}` ({op.origin}) prints; its output is in events.log "
                     "(secrets redacted), not here")

    def reward_errors(self, op: OpPlan, step: int, errors: list) -> None:
        self._samples("reward_error", op, step, [asdict(e) for e in errors],
                      f"{len(errors)} reward error(s) in `{op.id}` ({op.origin}), e.g. sample {errors[0].index}: "
                      f"{errors[0].message}; they scored the error reward")

    def reward_recovered(self, op: OpPlan, step: int, recovered: list) -> None:
        self._samples("reward_recovered", op, step, [asdict(e) for e in recovered],
                      f"a reward worker of `{op.id}` ({op.origin}) died while scoring {len(recovered)} sample(s), "
                      f"e.g. sample {recovered[0].index}: {recovered[0].message}; nothing lost")

    def env_errors(self, op: OpPlan, step: int, errors: list) -> None:
        self._samples("env_error", op, step, [{"index": row, "message": message} for row, message in errors],
                      f"{len(errors)} episode(s) of `{op.id}` ({op.origin}) ended by an environment error, e.g. "
                      f"sample {errors[0][0]}: {errors[0][1]}")

    def env_recovered(self, op: OpPlan, step: int, recovered: list) -> None:
        self._samples("env_recovered", op, step, [{"index": row, "message": message} for row, message in recovered],
                      f"an environment worker of `{op.id}` ({op.origin}) died under {len(recovered)} episode(s), "
                      f"e.g. sample {recovered[0][0]}: {recovered[0][1]}; nothing lost")

    def bad_rows(self, dataset, messages: list[str]) -> None:
        """Rows a dataset left out (``bad_rows = "skip"``): each one's file:row and reason, and one warning."""
        for message in messages:
            self.file.write(json.dumps({"step": 0, "dataset": dataset.id, "bad_row": message}) + "\n")
        self.file.flush()
        self.log(f"warning: dataset `{dataset.id}` ({dataset.origin}) skipped {len(messages)} bad row(s) "
                 f"(bad_rows = \"skip\"), e.g. {messages[0]} (all of them in events.log; counted in data/rows_skipped)")

    def close(self) -> None:
        self.file.close()


class _Redacted:
    """A text file whose writes go through ``redact`` first."""

    def __init__(self, file, redact):
        self._file, self._redact = file, redact

    def write(self, text: str) -> int:
        return self._file.write(self._redact(text))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Runtime:
    """The pieces of one run, composed (see the module docstring); ``run_plan`` drives it."""

    def __init__(self, plan: ExecutionPlan, out: Path, *, ray_address: str | None = None,
                 faults: Faults | None = None, log=None):
        self.plan = plan
        self.out = out
        self.ray_address = ray_address
        self.faults = faults or Faults()
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.timeline = None
        """The run's :class:`~flowrl.runtime.observe.Timeline` (set by ``run_plan`` before :meth:`setup`)."""
        self.events = EventFile(out / "events.log", lambda msg: self.log(msg))
        self.partial = partial_buffers(plan)
        """``generate`` op id -> its partial-rollout buffer (empty without ``partial_rollout``)."""
        self.data = None
        self.rewards: dict = {}
        self.envs: dict = {}
        """Environment resource id -> its pool of workers (:mod:`flowrl.runtime.env_pool`)."""
        self.fleet: Fleet | None = None
        self.services: Services | None = None

    def check_executable(self) -> None:
        """:func:`check_executable` of this run's plan (on this machine, or the cluster it joins); on a
        local Ray instance, also whether the engines fit in this machine's memory
        (:func:`~flowrl.runtime.placement.check_host_memory`), before any model is prepared."""
        import os

        from flowrl.runtime.placement import available_memory_gb, check_host_memory

        external = bool(self.ray_address or os.environ.get("RAY_ADDRESS"))
        check_executable(self.plan, external=external)
        if not external:
            check_host_memory(self.plan, available_memory_gb())

    def setup(self) -> None:
        """Check the plan, prepare the models, read the data, build the rewards, start the engines."""
        from flowrl.runtime.data import RunData
        from flowrl.runtime.env_pool import env_builder_of
        from flowrl.runtime.env_prompts import with_tools
        from flowrl.runtime.materialize import load_tokenizer_for, materialize_models
        from flowrl.runtime.rewards import build_rewards

        from flowrl.catalog.models import checkpoint_context

        span = partial(self.timeline.span, lane="driver", step=SETUP_STEP)  # start-up's parts, in trace.json
        with span("start:check"):
            self.check_executable()
        with span("start:models"):
            paths = materialize_models(self.plan, self.log)
        with span("start:data"):
            contexts = {m.id: checkpoint_context(paths[m.id]) for m in self.plan.models
                        if m.rollout_engine is not None and m.id in paths}
            # An environment's tools (an MCP server's) are rendered into the chat prompts by the template.
            tokenizer = with_tools(self.plan, load_tokenizer_for(self.plan, paths))
            self.data = RunData(self.plan, tokenizer, self.plan.run.seed, contexts)
        for d in self.plan.datasets:
            if self.data.skipped[d.id]:
                self.events.bad_rows(d, self.data.skipped[d.id])
        with span("start:rewards"):
            self.rewards = build_rewards(self.plan)
        self.fleet = Fleet(self.plan, self.out, timeline=self.timeline, log=lambda msg: self.log(msg),
                           ray_address=self.ray_address, faults=self.faults)
        self.fleet.start(paths)
        with span("start:envs"):
            for reward in self.rewards.values():  # rewards served by a model's engine (reward_model, llm_judge)
                if hasattr(reward, "bind"):
                    reward.bind(self.fleet, self.data, paths)
            self.envs = {e.id: env_builder_of(e)(e, self.plan) for e in self.plan.envs}  # Ray actors: after the fleet
        self.services = Services(self.plan, self.plan.run.seed, self.data, self.fleet, self.rewards, self.partial,
                                 self.events, self.timeline, self.envs)

    def context(self, step: int) -> StepContext:
        """A fresh context for ``step``."""
        return StepContext(step, self.services)

    def greedy_eval(self, step: int) -> dict:
        """Held-out accuracy of the trained policy (:func:`flowrl.runtime.heldout.greedy_eval`)."""
        from flowrl.runtime.heldout import greedy_eval

        return greedy_eval(self.services, step)

    def train_versions(self) -> dict[str, int]:
        return self.fleet.versions()["train_version"]

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, step: int, inflight: list | None = None) -> Path:
        """Write the state after ``step`` atomically (:func:`~flowrl.runtime.checkpoints.write_checkpoint`:
        a temporary directory, fsync, a manifest of checksums, rename); a full disk is a clear error."""
        from flowrl.runtime.checkpoints import checkpoint_dir, write_checkpoint

        def write(tmp: Path) -> None:
            self.fleet.save(tmp, step)
            state = {"step": step, **self.fleet.versions(), "samplers": self.data.state_dict()}
            (tmp / "driver.json").write_text(json.dumps(state, indent=1, sort_keys=True))
            # Rollouts already generated for later steps (staleness > 1): part of the run's state.
            # JSON + safetensors, never a pickle: a checkpoint someone hands you must not run code on --resume.
            write_state(tmp / INFLIGHT, [(c.step, c.values, c.metrics) for c in inflight or ()])
            # Partial rollout's carried groups (tokens so far, versions): the next steps continue them.
            write_state(tmp / PARTIAL, {op_id: b.state_dict() for op_id, b in self.partial.items()})
            if self.faults.in_checkpoint is not None:
                self.faults.in_checkpoint(step, tmp)

        final = checkpoint_dir(self.out, step)
        own(self.out, final, *(final.with_name(final.name + end) for end in (".tmp", ".old")))  # before it is written
        return write_checkpoint(final, write)

    def restore(self, ckpt: Path) -> tuple[int, list]:
        """Load a checkpoint; returns (next step, producer contexts that were in flight)."""
        refuse_unsafe_files(ckpt)  # an older flowrl's pickles: refused, never loaded
        state = driver_state(ckpt)
        # read (and so checked) before any engine loads its state
        partial, inflight = read_state(ckpt / PARTIAL), read_state(ckpt / INFLIGHT)
        self.data.load_state_dict(state["samplers"])
        self.fleet.restore(ckpt, state, int(state["step"]))
        try:
            for op_id, saved in partial.items():
                self.partial[op_id].load_state_dict(saved)
            contexts = [StepContext(int(step), self.services, dict(values), dict(metrics))
                        for step, values, metrics in inflight]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateFileError(f"checkpoint {ckpt}: {PARTIAL} or {INFLIGHT} does not match this run's plan "
                                 f"({type(e).__name__}: {e}); hint: resume with the run's own plan.json, or "
                                 f"start a new run") from None
        return int(state["step"]), contexts

    def shutdown(self) -> None:
        for r in self.rewards.values():
            r.close()
        for env in self.envs.values():
            env.close()
        self.events.close()
        if self.fleet is not None:
            self.fleet.shutdown()


# ---- the run loop ------------------------------------------------------------------------------


@dataclass
class RunResult:
    out: Path
    steps: int
    accuracy_before: float | None
    accuracy_after: float | None
    rows: list


def run_plan(plan: ExecutionPlan, out: Path, *, resume: bool = False, ray_address: str | None = None,
             faults: Faults | None = None, stream=sys.stderr, resume_step: int | None = None) -> RunResult:
    """Run ``plan`` into the run directory ``out`` (``resume``: from its latest checkpoint, or from
    step ``resume_step``'s; either is checked against its manifest before any engine starts).

    Steps are numbered from 1 in everything the run writes (metrics, trace, progress, summary,
    plots, checkpoints: ``step_000010`` holds the weights after step 10); step 0 is before RL
    (the held-out evaluation of the initial model). However the loop ends (an error, Ctrl-C),
    the steps that finished keep their metrics, summary, curves and trace.
    """
    from flowrl.runtime.observe import MetricsLog, Progress, Timeline
    from flowrl.runtime.tracking import Trackers, step_samples

    out.mkdir(parents=True, exist_ok=True)
    own(out, *RUN_FILES, *(tmp_sibling(out / name) for name in ATOMIC_FILES))  # before any is written
    earlier_trace = math.inf if resume else None  # the trace's steps kept from before: all, until restored
    if not resume:
        (out / "plan.json").write_text(plan.to_json())
    progress = Progress(plan.run.steps, stream=stream)
    rt = Runtime(plan, out, ray_address=ray_address, faults=faults, log=progress.message)
    rt.timeline = Timeline(plan.flow)
    start, before, pipe, log, trackers, finished, startup = 0, None, None, None, None, False, None
    # preemption: the first SIGTERM or SIGINT stops the run at a step boundary (also while it cleans up)
    with SigtermGuard(note=lambda message: rt.log(message)) as guard:
        try:
            trackers = Trackers.for_plan(plan, out, resume=resume)
            ckpt = resumable_checkpoint(out, resume_step, note=progress.message) if resume else None
            if ckpt is not None:
                check_state(ckpt)  # before any engine starts: a replaced state file fails in a moment, unread pickles
            t_setup = time.time()
            rt.setup()
            guard.reclaim()  # ray.init (in setup) installs a SIGTERM handler of its own that exits at once
            startup = startup_report(rt.timeline, t_setup, time.time())
            progress.message(startup["line"])
            inflight = []
            if ckpt is not None:
                start, inflight = rt.restore(ckpt)
                earlier_trace = start
                trackers.resume_after(start)
                progress.message(f"resumed from {ckpt} after step {start}")
            log = MetricsLog(out / "metrics.jsonl", resume_after_step=start if resume else None)
            before = next((r.get("eval/accuracy") for r in log.rows() if r["step"] == 0), None)
            if start == 0 and plan.run.eval_every:  # `eval_every = 0`: no held-out evaluation at all
                with rt.timeline.span("eval", "driver", SETUP_STEP):
                    ev = rt.greedy_eval(0)
                if ev:
                    log.log(0, ev)
                    trackers.log(0, ev)
                before = ev.get("eval/accuracy")
                if before is not None:
                    progress.message(f"held-out accuracy before RL: {100 * before:.1f}%")
            progress = Progress(plan.run.steps, stream=stream, start_step=start)
            rt.log = progress.message
            for reward in rt.rewards.values():  # a reward scored by worker processes says how far it got
                if hasattr(reward, "on_wait"):
                    reward.on_wait = lambda done, total: progress.status(f"waiting on rewards ({done}/{total})")
            pipe = StepPipeline(plan, rt.context, depth=producer_depth(plan))
            pipe.start(start, inflight)
            last_saved = None
            for step in range(start, plan.run.steps):  # `step` indexes the loop; users see step + 1
                number = step + 1
                guard.reclaim()  # a library the step started (a reward's, an engine client's) may have taken one
                if guard.requested:  # a signal before this process finished a step: the checkpoint it began from stays
                    raise Preempted(out, step, plan.run.steps, checkpoint=False, signal=guard.signal_name)
                ctx = _run_step(rt, pipe, step, plan.run.steps)
                if rt.data.rows_skipped:
                    ctx.metrics["data/rows_skipped"] = rt.data.rows_skipped
                if plan.run.eval_every and (number % plan.run.eval_every == 0 or number == plan.run.steps):
                    with rt.timeline.span("eval", "driver", step):
                        ctx.metrics.update(rt.greedy_eval(step))
                log.log(number, ctx.metrics)
                trackers.log(number, ctx.metrics,
                             step_samples(plan, ctx.values, number) if trackers.wants_samples(number) else None)
                progress.update(number, ctx.metrics)
                if faults is not None and faults.sigterm_after_step == step:
                    os.kill(os.getpid(), signal.SIGTERM)
                saved = bool(plan.run.save_every and number % plan.run.save_every == 0)
                exported = exports_at(plan, number)  # from the checkpoint, which it writes
                if saved or exported or (guard.requested and number < plan.run.steps):
                    _after_save(plan, out, rt.save(number, pipe.completed_inflight()), exported, log.rows(),
                                start if resume else None, progress.message)
                    last_saved = number
                if guard.requested and number < plan.run.steps:
                    raise Preempted(out, number, plan.run.steps, checkpoint=True, signal=guard.signal_name)
                if faults is not None and faults.stop_after_step == step:
                    raise SystemExit(f"fault injection: stopped after step {step}")
            if start < plan.run.steps and last_saved != plan.run.steps:
                _after_save(plan, out, rt.save(plan.run.steps, pipe.completed_inflight()), False,  # the final weights:
                            log.rows(), start if resume else None, progress.message)  # `eval --from`, `--resume`
            finished = True
        finally:
            rows = log.rows() if log is not None else []
            # what finished is kept, with its summary and plots: written while the engines shut down
            results = _in_background(_write_results, plan, out, rows, before, startup) \
                if any(r["step"] >= 1 for r in rows) else None
            try:
                if pipe is not None:
                    pipe.close()
                if earlier_trace is not None:  # resumed (or restarted): the steps before stay in trace.json
                    rt.timeline.keep_earlier(out / "trace.json", earlier_trace)
                rt.timeline.write(out / "trace.json")
                if trackers is not None:
                    trackers.close()
            finally:
                try:
                    rt.shutdown()
                finally:
                    error = results.exception() if results is not None else None
            if error is not None:  # after a failure, the failure is the news, not the plot
                if finished:
                    raise error
                progress.message(f"warning: could not write summary.json/curves.png: {type(error).__name__}: {error}")
            if finished:
                progress.close()
            else:
                progress.stopped()
    steps = [r for r in rows if r["step"] >= 1]  # row 0 (before RL) is `before`
    after = next((r["eval/accuracy"] for r in reversed(steps) if "eval/accuracy" in r), None)
    return RunResult(out, plan.run.steps, before, after, steps)


def _after_save(plan: ExecutionPlan, out: Path, ckpt: Path, export: bool, rows: list, resumed_from: int | None,
                note) -> None:
    """After checkpoint ``ckpt``: its export when due (``export_every``), then retention (``keep_last``,
    ``keep_best`` by ``eval/accuracy``), which never deletes the checkpoint a resumed run started from."""
    from flowrl.runtime.checkpoints import prune_checkpoints
    from flowrl.runtime.export import export_in_run

    if export:
        export_in_run(plan, out, ckpt, note)
    scores = {r["step"]: r["eval/accuracy"] for r in rows if isinstance(r.get("eval/accuracy"), (int, float))}
    protect = frozenset() if resumed_from is None else frozenset({resumed_from})
    for gone in prune_checkpoints(out, keep_last=plan.run.keep_last, keep_best=plan.run.keep_best, scores=scores,
                                  protect=protect, note=note):
        note(f"retention: deleted {gone} (keep_last={plan.run.keep_last}, keep_best={plan.run.keep_best})")


def _in_background(fn, *args) -> Future:
    """``fn(*args)`` started at once on a thread of its own; the future's ``exception()`` waits for it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flowrl-{fn.__name__}")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the submitted call still runs; the thread ends with it


def _write_results(plan: ExecutionPlan, out: Path, rows: list, before, startup: dict | None = None) -> None:
    """``summary.json`` (with this process's ``startup``: :func:`~flowrl.runtime.observe.startup_report`) and
    ``curves.png`` of the steps in ``rows`` (1-based; row 0 = before RL)."""
    from flowrl.runtime.observe import plot_run, summarize

    done = max(r["step"] for r in rows)
    after = next((r["eval/accuracy"] for r in reversed(rows) if r["step"] >= 1 and "eval/accuracy" in r), None)
    extra = {**summarize(rows), **({"startup": {k: v for k, v in startup.items() if k != "line"}} if startup else {})}
    _write_summary(out, before, after, done, extra)
    plot_run(rows, out / "curves.png", title=f"{plan.flow} ({Path(plan.source).name})")


def _run_step(rt: Runtime, pipe: StepPipeline, step: int, last_step: int) -> StepContext:
    t0 = time.time()
    ctx = pipe.step(step, last_step)
    elapsed = time.time() - t0
    ctx.metrics["perf/step_s"] = elapsed
    generates = {op.id for op in rt.plan.ops if op.kind == OpKind.GENERATE}
    gen_s = sum(v for k, v in ctx.metrics.items() if k.startswith("time/") and k[5:] in generates)
    if "perf/gen_tokens" in ctx.metrics:
        ctx.metrics["perf/tokens_per_s"] = ctx.metrics["perf/gen_tokens"] / max(elapsed, 1e-9)
        ctx.metrics["perf/gen_tokens_per_s"] = ctx.metrics["perf/gen_tokens"] / max(gen_s, 1e-9)
    ctx.metrics["policy/version"] = max(rt.train_versions().values(), default=0)
    return ctx


def _write_summary(out: Path, before, after, steps: int, extra: dict | None = None) -> None:
    data = {"accuracy_before": before, "accuracy_after": after, "steps_done": steps, **(extra or {})}
    (out / "summary.json").write_text(json.dumps(data, indent=1, sort_keys=True))


def latest_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint written to the end (with its manifest), unverified; None if there is none."""
    from flowrl.runtime.checkpoints import complete_checkpoints

    ckpts = complete_checkpoints(out)
    return ckpts[-1] if ckpts else None
