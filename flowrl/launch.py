"""``flowrl run`` and ``flowrl plan`` as functions: compile a file, lower it, run the plan.

This module sits above both the compiler and the runtime (the command line's side): the
runtime only ever sees an :class:`~flowrl.plan.ExecutionPlan`, and imports nothing from
:mod:`flowrl.compiler` or :mod:`flowrl.syntax`.

Errors a user can fix come back as :class:`RunError` with a one-line message (compile
errors stay :class:`~flowrl.diagnostics.FlowError`, rendered with their positions); the
CLI prints them without a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from flowrl.catalog.loggers import LOGGERS, TRACKING_SETTINGS, URI_HINT, UnknownLoggerError, parse_loggers, uri_problem
from flowrl.compiler.lower import RUN_PARAMS, lower
from flowrl.compiler.pipeline import compile_file
from flowrl.diagnostics import report_warnings
from flowrl.plan import ExecutionPlan
from flowrl.runtime import rundir
from flowrl.runtime.checkpoints import CheckpointError, complete_checkpoints, step_of, verify_checkpoint
from flowrl.runtime.errors import EngineFault
from flowrl.runtime.preemption import Preempted


QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1",
             "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
"""Set (unless already set) before a run: engines' own progress bars would drown the run's progress line."""


class RunError(Exception):
    """A failure of ``flowrl run`` the user can act on (bad override, missing engine, ...)."""


REQUIRED = {"torch": "pip install torch==2.13.0 (CPU) or a CUDA build on GPUs",
            "ray": "pip install 'ray[default]'",
            "transformers": "pip install transformers"}
"""Packages ``flowrl run`` needs -> how to install each."""


def parse_sets(items: list[str]) -> dict[str, str]:
    """``["lr=3e-4", "group=4"]`` -> ``{"lr": "3e-4", "group": "4"}``; RunError on a malformed item."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RunError(f"--set {item!r}: expected key=value, e.g. --set group=8")
        out[key.strip()] = value.strip()
    return out


def build_plan(path: str, *, flow: str | None = None, sets: dict[str, str] | None = None,
               steps: int | None = None, save_every: int | None = None,
               run: dict | None = None) -> ExecutionPlan:
    """Compile ``path`` (FlowError on bad input) and lower it with the run settings.

    ``sets`` are ``--set`` overrides (flow parameters, or run settings such as ``steps``);
    ``steps``/``save_every`` the command-line options; ``run`` further run settings already
    typed (``{"log": ("tensorboard",), "log_samples": 10}``), applied last.
    """
    sets = dict(sets or {})
    declared = _declared_params(path, flow) if any(k in RUN_PARAMS for k in sets) else set()
    overrides = {k: v for k, v in sets.items() if k not in RUN_PARAMS or k in declared}
    settings: dict = {k: run_setting(k, v) for k, v in sets.items() if k in RUN_PARAMS}
    compiled = compile_file(path, flow, options={"overrides": overrides})
    return lower_compiled(compiled.graph, settings=settings, steps=steps, save_every=save_every, run=run)


def lower_compiled(graph, *, settings: dict | None = None, steps: int | None = None,
                   save_every: int | None = None, run: dict | None = None) -> ExecutionPlan:
    """Lower a compiled graph (from a file, or from :mod:`flowrl.builder`'s AST) with the run
    settings: ``settings`` typed ``--set`` values, then ``steps``/``save_every``, then ``run``.
    Its warnings are printed to stderr (they compile, and are said)."""
    report_warnings(graph.warnings, graph.sources, sys.stderr)
    settings = dict(settings or {})
    if steps is not None:
        if steps < 1:  # what the CLI refuses, refused for every caller (the builder's too)
            raise RunError(f"--steps {steps}: a run trains at least one step; "
                           "`flowrl eval FILE` measures a model without training")
        settings["steps"] = steps
    if save_every is not None:
        if save_every < 0:
            raise RunError(f"--save-every {save_every}: give a number of steps >= 0 (0: no checkpoint but the last)")
        settings["save_every"] = save_every
    settings.update(run or {})
    return lower(graph, settings)


def run_setting(key: str, value: str):
    """A ``--set`` value of a run setting, typed as the runtime reads it (RunError if it is not)."""
    if key == "log":
        try:
            return parse_loggers(value)
        except UnknownLoggerError as e:
            raise RunError(f"--set log={value}: {e}") from None
    if key in TRACKING_SETTINGS:
        return tracking_setting(key, value, f"--set {key}")
    try:
        number = int(value)
    except ValueError:
        raise RunError(f"--set {key}={value}: {key} must be an integer") from None
    least = 1 if key == "steps" else 0
    if number < least:
        raise RunError(f"--set {key}={value}: {key} must be >= {least}"
                       + ("; `flowrl eval FILE` measures a model without training" if key == "steps" else ""))
    return number


def _declared_params(path: str, flow: str | None) -> set[str]:
    """Names of the entry flow's parameters (empty if the file does not parse: compile says why)."""
    from flowrl.compiler.pipeline import entry_flow, read_source
    from flowrl.diagnostics import FlowError
    from flowrl.syntax.parser import parse

    try:
        fdef = entry_flow(parse(read_source(path), str(path)), flow)
    except FlowError:
        return set()
    return {p.name for p in fdef.params}


def check_installed() -> None:
    """RunError naming the install command of the first package ``flowrl run`` needs and lacks."""
    for mod, fix in REQUIRED.items():
        if importlib.util.find_spec(mod) is None:
            raise RunError(f"`{mod}` is not installed, and `flowrl run` needs it: {fix} "
                           "(or `pip install -e '.[cpu]'`)")


def quiet_environment() -> None:
    """Turn the engines' own progress bars and banners down (only where the user set nothing)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def describe_plan(plan: ExecutionPlan, explain: bool = False) -> str:
    """The human summary of ``flowrl plan`` (see :mod:`flowrl.compiler.explain`)."""
    from flowrl.compiler.explain import describe_plan as describe

    return describe(plan, explain=explain)


def plan_json(plan: ExecutionPlan) -> str:
    """The plan as stable JSON (sorted keys), for tools."""
    return json.dumps(plan.to_dict(), indent=2, sort_keys=True) + "\n"


# ---- run directories ---------------------------------------------------------------------------

RUN_DIR_MARKER = "plan.json"
"""A directory holding this file is a run directory (``flowrl run`` writes it first)."""


@dataclass(frozen=True)
class FinishedRun:
    """What ``flowrl run --resume`` returns for a run that already has all its steps: nothing ran."""

    out: Path
    steps: int
    accuracy_before: float | None
    accuracy_after: float | None
    already_finished: bool = True


def default_out(path: str, now: float | None = None) -> Path:
    """``runs/<file stem>-<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``... if that exists already."""
    base = Path("runs") / f"{Path(path).stem}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    out, k = base, 2
    while out.exists():
        out, k = base.with_name(f"{base.name}-{k}"), k + 1
    return out


def claim_out_dir(out: Path, overwrite: bool) -> bool:
    """Make ``out`` ready for a new run; True if this call created it.

    A new or empty directory is taken; an earlier run directory only with ``overwrite``, and only
    if everything in it is listed as flowrl's (:mod:`flowrl.runtime.rundir`): then what is listed is
    deleted. Anything else (a file, a directory of other files, one with ``.git``, an old run
    without a list) is refused naming what is in the way, ``overwrite`` or not, and nothing is deleted.
    """
    if not out.exists():
        try:
            out.mkdir(parents=True)
        except OSError as e:
            raise RunError(f"--out {out}: cannot create the run directory ({e.strerror or e}); "
                           "choose another --out") from None
        _start_list(out)
        return True
    if not out.is_dir():
        raise RunError(f"--out {out}: a file is there, not a directory; choose another --out")
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunError(f"--out {out}: the directory is not writable by you; choose another --out")
    entries = list(out.iterdir())
    if not entries:
        _start_list(out)
        return False
    if (out / rundir.GIT).exists() or (out / rundir.GIT).is_symlink():
        raise RunError(f"--out {out}: the directory holds {rundir.GIT}; flowrl never writes runs into (or deletes "
                       "anything in) a directory with .git: choose another --out, e.g. runs/NAME")
    if not ((out / RUN_DIR_MARKER).is_file() or rundir.is_listed(out)):
        raise RunError(f"--out {out}: the directory is not empty and holds no run ({RUN_DIR_MARKER}); "
                       "flowrl writes runs into new or empty directories: choose another --out")
    if not overwrite:
        raise RunError(f"--out {out}: a run directory is already there; pass --overwrite to replace it, "
                       f"`--resume {out}` to continue it, or choose another --out")
    try:
        rundir.check_replaceable(out)
    except rundir.RunDirError as e:
        raise RunError(f"--out {out} --overwrite: {e}") from None
    rundir.remove_owned(out)
    _start_list(out)
    return False


def _start_list(out: Path) -> None:
    try:
        rundir.start(out)
    except OSError as e:
        raise RunError(f"--out {out}: cannot write into the run directory ({e.strerror or e}); "
                       "choose another --out") from None


def steps_done(out: Path) -> int:
    """Steps a run directory has finished, from its ``summary.json`` (0 if it has none)."""
    try:
        return int(json.loads((out / "summary.json").read_text()).get("steps_done") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def latest_checkpoint_step(out: Path) -> int | None:
    """The step of the newest complete checkpoint (``checkpoints/step_NNNNNN`` with its manifest), or None."""
    ckpts = complete_checkpoints(out)
    return step_of(ckpts[-1]) if ckpts else None


def prepare_resume(resume: str, *, path: str | None, flow: str | None, sets: dict | None, steps: int | None,
                   out: str | None, save_every: int | None, overwrite: bool, log: str | None,
                   log_samples: int | None, resume_step: int | None = None,
                   tracking: dict | None = None, retention: dict | None = None) -> tuple[ExecutionPlan, FinishedRun | None]:
    """The plan to continue ``resume`` with, or a :class:`FinishedRun` when there is nothing to do.

    Honours ``steps`` (go further, or stop earlier), ``save_every`` and ``retention`` (``keep_last``,
    ``keep_best``, ``export_every``); refuses what would change the run it continues (another ``FILE`` or
    ``--flow``, ``--set``, ``--out``, ``--overwrite``, other
    loggers). Reads only ``plan.json``, ``summary.json`` and the checkpoint names: no engine starts.
    ``resume_step``: continue from that step's checkpoint (one before a damaged newest one).
    """
    d = Path(resume)
    plan_file = d / RUN_DIR_MARKER
    if not plan_file.is_file():
        raise RunError(f"--resume {resume}: no {RUN_DIR_MARKER} there; pass the run directory of an earlier run")
    plan = read_run_plan(plan_file, f"--resume {resume}", "it was damaged or replaced; start a new run")
    keep = "--resume continues the run with the settings it started with"
    if path is not None and Path(path).resolve() != Path(plan.source).resolve():
        raise RunError(f"--resume {resume}: that run is of {plan.source}, not {path}; drop FILE (or give the "
                       "run's own), or start a new run of this file with --out")
    if flow is not None and flow != plan.flow:
        raise RunError(f"--resume {resume}: that run is of flow `{plan.flow}`, not `{flow}`; drop --flow")
    if sets:
        raise RunError(f"{keep}: --set {' --set '.join(f'{k}={v}' for k, v in sets.items())} would change it; "
                       "start a new run (--out NEW_DIR) to change settings")
    if out is not None:
        raise RunError(f"--resume writes into {resume} itself; drop --out {out}")
    if overwrite:
        raise RunError("--resume never deletes a run; drop --overwrite")
    if log is not None and loggers_setting(log) != plan.run.log:
        raise RunError(f"{keep}: its loggers are {','.join(plan.run.log) or 'none'}; drop --log")
    if log_samples is not None and log_samples != plan.run.log_samples:
        raise RunError(f"{keep}: it logs samples every {plan.run.log_samples} step(s); drop --log-samples")
    for key, value in (tracking or {}).items():  # the trackers' run it continues is the one it started
        if value != getattr(plan.run, key):
            raise RunError(f"{keep}: its {key} is {getattr(plan.run, key) or 'not set'!r}; drop --{key.replace('_', '-')}")
    run = plan.run
    if steps is not None:
        run = replace(run, steps=steps)
    if save_every is not None:
        run = replace(run, save_every=save_every)
    if retention:  # what is kept and exported from now on: the training does not change
        run = replace(run, **retention)
    done = steps_done(d)
    if resume_step is not None:
        if resume_step not in {step_of(p) for p in complete_checkpoints(d)}:
            have = ", ".join(str(step_of(p)) for p in complete_checkpoints(d)) or "none"
            raise RunError(f"--resume-step {resume_step}: {resume} has no complete checkpoint of that step; "
                           f"complete checkpoints: {have}")
        done = min(done, resume_step)
    if done >= run.steps:
        summary = _summary(d)
        return plan, FinishedRun(d, done, summary.get("accuracy_before"), summary.get("accuracy_after"))
    ckpt = latest_checkpoint_step(d)
    if ckpt is None:
        raise RunError(f"--resume {resume}: the run stopped after step {done} of {run.steps} and left no "
                       f"checkpoint (it ran without --save-every), so it cannot continue; start it again with "
                       f"`flowrl run {plan.source} --out {resume} --overwrite --save-every N`")
    if run != plan.run:
        plan = replace(plan, run=run)
        _write_atomic(plan_file, plan.to_json())
    return plan, None


def _summary(d: Path) -> dict:
    try:
        return json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` (a file of a run directory) through a temporary file, both listed as flowrl's."""
    tmp = path.with_name(f".{path.name}.tmp")
    rundir.own(path.parent, path, tmp)
    tmp.write_text(text)
    os.replace(tmp, path)


def loggers_setting(text: str) -> tuple[str, ...]:
    """``--log`` text as the run setting (RunError naming the known loggers if one is unknown)."""
    try:
        return parse_loggers(text)
    except UnknownLoggerError as e:
        raise RunError(f"--log {text}: {e}") from None


def tracking_setting(key: str, value: str, said: str):
    """A tracker setting (:data:`~flowrl.catalog.loggers.TRACKING_SETTINGS`) as the run setting: ``log_tags``
    a tuple of tags, the others a string; RunError for a ``log_uri`` with a password (``said`` names the
    option, e.g. ``--log-uri``)."""
    if key == "log_tags":
        return tuple(t.strip() for t in str(value).split(",") if t.strip())
    if key == "log_uri" and uri_problem(value):
        raise RunError(f"{said}: {uri_problem(value)}; {URI_HINT}")  # the message masks the password
    return str(value).strip()


def check_loggers(names: tuple[str, ...]) -> None:
    """RunError naming the install command of a tracker's package that is not installed."""
    for name in names:
        spec = LOGGERS.get(name)
        if spec is None:  # a plan written by hand: the names are checked when compiled
            raise RunError(f"the plan names logger `{name}`; the known loggers are {', '.join(LOGGERS)}")
        if importlib.util.find_spec(spec.package) is None:
            raise RunError(f"--log {name} needs the `{spec.package}` package, which is not installed: {spec.install}")


def after_failed_run(out: Path, created: bool, steps: int, stream) -> None:
    """After a fresh run failed or was interrupted: remove what it wrote if no step finished (only
    what its list names: :func:`flowrl.runtime.rundir.remove_owned`; the directory too if this run
    created it and nothing else is there), else say what is kept."""
    done = steps_done(out)
    if done == 0:
        kept = rundir.remove_owned(out, remove_dir=created)
        extra = (f"; kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} it did not write ({kept[0]}"
                 f"{', ...' if len(kept) > 1 else ''})" if kept else "")
        print(f"flowrl: the run stopped before its first step finished; removed what it wrote in {out}{extra}",
              file=stream)
        return
    ckpt = latest_checkpoint_step(out)
    how = (f"`flowrl run --resume {out}` continues it from step {ckpt}" if ckpt is not None
           else "it has no checkpoint to resume from (--save-every N writes them)")
    print(f"flowrl: the run stopped after step {done} of {steps}; {out} keeps its metrics, summary.json and "
          f"curves.png; {how}", file=stream)


# ---- Ray: the local cluster, or the user's ----------------------------------------------------

def ray_auth_environment(address: str | None) -> None:
    """Token authentication as Ray's own CLI sets it up, before ``ray.init``.

    A local Ray of our own keeps Ray's default (token authentication on) but says so
    explicitly (``RAY_AUTH_MODE=token``), which is what silences Ray's banner about it on
    every run. For a cluster the user names (``--ray``, ``RAY_ADDRESS``), Ray does not look
    for a token by itself; its CLI enables token mode when one is available (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), and so does this. A mode the user set is kept.
    """
    if not os.environ.get("RAY_AUTH_MODE") and (not (address or os.environ.get("RAY_ADDRESS"))
                                                or _ray_token_available()):
        os.environ["RAY_AUTH_MODE"] = "token"
    if "ray" in sys.modules:  # Ray read the mode when it was imported: refresh it, as Ray's own set-up does
        try:
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):
            pass


def _ray_token_available() -> bool:
    try:  # the loader Ray's CLI asks (`maybe_enable_token_auth_if_token_available`)
        from ray._raylet import AuthenticationTokenLoader

        return bool(AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True))
    except (ImportError, AttributeError, TypeError):
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
        return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()


RAY_AUTH_HELP = ("a cluster started with `ray start` uses token authentication: give this machine the cluster's "
                 "token (copy the head node's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN=<token> or "
                 "RAY_AUTH_TOKEN_PATH=<file>); a cluster started with RAY_AUTH_MODE=disabled needs "
                 "RAY_AUTH_MODE=disabled here too")


def ray_connection_error(error: BaseException, address: str | None) -> RunError | None:
    """A one-line RunError for a failure to join the user's Ray cluster, else None."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        return None
    names = {type(e).__name__ for e in _chain(error)}
    if not names & {"ConnectionError", "AuthenticationError"}:
        return None
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return RunError(f"cannot join the Ray cluster at {address} ({type(error).__name__}: {first}); {RAY_AUTH_HELP}")


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


# ---- flowrl run ---------------------------------------------------------------------------------

def run_plan(plan: ExecutionPlan, out: Path, **kwargs):
    """The driver's run loop, imported when a run starts (it imports torch and Ray)."""
    from flowrl.runtime.driver import run_plan as drive

    return drive(plan, out, **kwargs)


RETENTION_SETTINGS = ("keep_last", "keep_best", "export_every")
"""Run settings ``flowrl run`` takes as options (``--keep-last``...), a resumed run too."""


def run_file(path: str | None, *, flow: str | None = None, sets: dict | None = None, steps: int | None = None,
             out: str | None = None, resume: str | None = None, save_every: int | None = None,
             overwrite: bool = False, log: str | None = None, log_samples: int | None = None,
             ray_address: str | None = None, faults=None, stream=None, resume_step: int | None = None,
             restarts: int = 0, tracking: dict | None = None, retention: dict | None = None):
    """``flowrl run``: compile and run a flow into a new run directory, or continue one (``resume``).

    Returns the driver's ``RunResult`` (or a :class:`FinishedRun` when ``resume`` names a run that
    already has its steps). ``resume_step``: continue ``resume`` from that step's checkpoint rather than
    its newest (whose damage ``--resume`` reports). Refuses, before anything starts: an ``out`` that holds something
    (unless it is a run and ``overwrite``), options a resumed run cannot honour, missing packages.
    A fresh run that fails before its first step leaves nothing behind; one that fails later keeps
    its directory (metrics, summary, plots) and says how to resume it. ``restarts``: see :func:`run_built`.
    ``tracking``: tracker settings from the command line (``{"log_name": "baseline", "log_tags": "a,b"}``:
    :data:`~flowrl.catalog.loggers.TRACKING_SETTINGS`), over the flow's. ``retention``: checkpoint retention
    and exports from the command line (``{"keep_last": 3, "keep_best": 1, "export_every": 10}``), over the
    flow's; a resumed run takes them too (they change what is kept from now on, not the training).
    """
    retention = {k: v for k, v in (retention or {}).items() if v is not None}
    bad = {k: v for k, v in retention.items() if k not in RETENTION_SETTINGS or not isinstance(v, int) or v < 0}
    if bad:
        key, value = next(iter(bad.items()))
        raise RunError(f"--{key.replace('_', '-')} {value}: give a number >= 0 (0: off)")
    tracking = {k: tracking_setting(k, v, f"--{k.replace('_', '-')}") for k, v in (tracking or {}).items()
                if v is not None}
    stream = stream or sys.stderr
    if steps is not None and steps < 1:
        raise RunError(f"--steps {steps}: a run trains at least one step; "
                       "`flowrl eval FILE` measures a model without training")
    if log_samples is not None and log_samples < 0:
        raise RunError(f"--log-samples {log_samples}: give a number of steps >= 0 (0: never)")
    if resume_step is not None and not resume:
        raise RunError(f"--resume-step {resume_step} picks a checkpoint of the run --resume RUN_DIR continues; "
                       "add --resume RUN_DIR")
    if resume:
        plan, finished = prepare_resume(resume, path=path, flow=flow, sets=sets, steps=steps, out=out,
                                        save_every=save_every, overwrite=overwrite, log=log, log_samples=log_samples,
                                        resume_step=resume_step, tracking=tracking, retention=retention)
        if finished is not None:
            return finished
        out_dir = Path(resume)
    else:
        if path is None:
            raise RunError("give the .flow file to run (or --resume RUN_DIR)")
        run = {}
        if log is not None:
            run["log"] = loggers_setting(log)
        if log_samples is not None:
            run["log_samples"] = log_samples
        run.update(tracking)
        run.update(retention)
        plan = build_plan(path, flow=flow, sets=sets, steps=steps, save_every=save_every, run=run)
        out_dir = Path(out) if out else default_out(path)
    return run_built(plan, out_dir, resume=bool(resume), overwrite=overwrite, ray_address=ray_address,
                     faults=faults, stream=stream, resume_step=resume_step, restarts=restarts)


def run_built(plan: ExecutionPlan, out_dir: Path, *, resume: bool = False, overwrite: bool = False,
              ray_address: str | None = None, faults=None, stream=None, resume_step: int | None = None,
              restarts: int = 0):
    """Run a plan (of a file, or of a :mod:`flowrl.builder` flow) into ``out_dir``, as ``flowrl run`` does:
    refuses a taken ``out_dir`` and missing packages first; a fresh run that fails before its first
    step leaves nothing behind.

    ``restarts``: when an engine fails under the run (an :class:`~flowrl.runtime.errors.EngineFault`:
    it died, hung, or went with its node), stop every engine and start them again from the run's last
    checkpoint (from the beginning while there is none), up to ``restarts`` times, saying so on
    ``stream``. The runs are deterministic, so the metrics are those of an undisturbed run. ``faults``
    (injected by tests) are injected into the first attempt only.
    """
    if restarts < 0:
        raise RunError(f"--restarts {restarts}: give how many times the engines may be restarted (0: never)")
    stream = stream or sys.stderr
    attempt = 0
    while True:
        try:
            return _run_attempt(plan, out_dir, resume=resume, overwrite=overwrite, ray_address=ray_address,
                                faults=faults if attempt == 0 else None, stream=stream, resume_step=resume_step)
        except EngineFault as fault:
            if attempt == restarts:
                raise
            attempt += 1
            ckpt = latest_checkpoint_step(out_dir)
            resume, overwrite, resume_step = ckpt is not None, True, None
            where = f"from its checkpoint of step {ckpt}" if resume else "from the beginning (no checkpoint yet)"
            print(f"flowrl: restart {attempt} of {restarts}: {fault}; the engines start again {where}", file=stream)


def _run_attempt(plan: ExecutionPlan, out_dir: Path, *, resume: bool, overwrite: bool, ray_address: str | None,
                 faults, stream, resume_step: int | None):
    """One attempt of :func:`run_built`."""
    check_installed()
    check_loggers(plan.run.log)
    umask = no_world_write()
    try:
        created = False if resume else claim_out_dir(out_dir, overwrite)
    except BaseException:
        os.umask(umask)
        raise
    quiet_environment()
    ray_auth_environment(ray_address)
    try:
        kwargs = {"resume_step": resume_step} if resume_step is not None else {}
        return run_plan(plan, out_dir, resume=bool(resume), ray_address=ray_address, faults=faults, stream=stream,
                        **kwargs)
    except BaseException as error:
        if not resume and not (isinstance(error, Preempted) and error.step):  # a preemption says it all itself
            after_failed_run(out_dir, created, plan.run.steps, stream)
        joined = ray_connection_error(error, ray_address)
        if joined is not None:
            raise joined from None
        raise
    finally:
        os.umask(umask)


PRIVATE_UMASK_BITS = 0o022
"""Added to the user's umask while a run lasts: what it creates is never world-writable. Group
write goes too: a local Ray instance (measured with Ray 2.60) does not start under a umask that
lets the group write (its raylet never registers), so a run could not start there anyway."""


def no_world_write() -> int:
    """Add :data:`PRIVATE_UMASK_BITS` to this process's umask for the run (directories and files a
    run creates follow the user's umask, and are never world-writable even under ``umask 0``);
    returns the umask to restore. Ray processes started meanwhile inherit it."""
    previous = os.umask(0o022)
    os.umask(previous | PRIVATE_UMASK_BITS)
    return previous


# ---- flowrl eval --------------------------------------------------------------------------------

def checkpoint_of(run_dir: str, step: int | None) -> Path:
    """``RUN_DIR/checkpoints/step_NNNNNN`` of ``step`` (default: the latest); RunError naming the ones there."""
    d = Path(run_dir)
    if not (d / RUN_DIR_MARKER).is_file():
        raise RunError(f"--from {run_dir}: no {RUN_DIR_MARKER} there; pass the run directory of an earlier run")
    have = [step_of(p) for p in complete_checkpoints(d)]
    if not have:
        raise RunError(f"--from {run_dir}: the run left no checkpoint (it stopped before its last step and ran "
                       "without --save-every)")
    chosen = have[-1] if step is None else step
    if chosen not in have:
        raise RunError(f"--from {run_dir} --step {step}: no checkpoint of that step; there are: "
                       + ", ".join(map(str, have)))
    ckpt = d / "checkpoints" / f"step_{chosen:06d}"
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as e:
        raise RunError(f"--from {run_dir}: {e}") from None
    return ckpt


def read_run_plan(plan_file: Path, option: str, hint: str) -> ExecutionPlan:
    """A run directory's ``plan.json``, read as JSON only (a run directory someone hands you runs nothing
    when read); RunError naming ``option`` with ``hint`` when it cannot be read or is not a plan."""
    try:
        return ExecutionPlan.from_json(plan_file.read_bytes().decode("utf-8"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RunError(f"{option}: its {RUN_DIR_MARKER} cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                       f"{hint}") from None


def run_plan_of(run_dir: str, *, path: str | None, flow: str | None, sets: dict | None) -> ExecutionPlan:
    """The plan ``run_dir`` was trained with (its ``plan.json``: every ``--set`` it ran with), which
    ``flowrl eval --from`` evaluates its checkpoint with; RunError where ``path``, ``flow`` or ``sets``
    would ask for another (a checkpoint fits only the plan that wrote it)."""
    plan = read_run_plan(Path(run_dir) / RUN_DIR_MARKER, f"--from {run_dir}", "pass the run directory of an earlier run")
    if path is not None and not _same_file(path, plan.source):
        raise RunError(f"--from {run_dir}: that run is of {plan.source}, not {path}; evaluate it with the run's "
                       "own flow file")
    if flow is not None and flow != plan.flow:
        raise RunError(f"--from {run_dir}: that run is of flow `{plan.flow}`, not `{flow}`; drop --flow")
    if sets:
        raise RunError(f"--from {run_dir} evaluates the run with the settings it was trained with (its "
                       f"{RUN_DIR_MARKER}); --set {' --set '.join(f'{k}={v}' for k, v in sets.items())} would change "
                       "them: drop --set")
    return plan


def _same_file(path: str, source: str) -> bool:
    """``path`` is the run's flow file: the same path, or a copy with the same bytes (the run moved)."""
    try:
        return Path(path).resolve() == Path(source).resolve() or Path(path).read_bytes() == Path(source).read_bytes()
    except OSError:
        return False


def eval_file(path: str, *, run_dir: str | None = None, step: int | None = None, flow: str | None = None,
              sets: dict | None = None, n: int = 8, ks: tuple[int, ...] = (1,), temperature: float = 1.0,
              seed: int = 0, ray_address: str | None = None, stream=None):
    """``flowrl eval``: the held-out greedy accuracy and pass@k of ``path``'s trained policy, with the
    weights of ``run_dir``'s checkpoint (default: its latest) and the plan that run was made with (its
    ``plan.json``, ``--set`` values included: :func:`run_plan_of`) or, without ``run_dir``, as the flow
    builds them. ``n``, ``ks``, ``temperature`` and ``seed`` are eval's own. No training step runs.
    Returns a :class:`flowrl.runtime.evaluate.EvalResult`."""
    stream = stream or sys.stderr
    if n < 0:
        raise RunError(f"--n {n}: give the completions to sample per prompt, >= 0 (0: greedy only)")
    if temperature <= 0 and n > 0:
        raise RunError(f"--temperature {temperature}: sampling needs a temperature > 0 (greedy is measured anyway)")
    bad = [k for k in ks if not 1 <= k <= max(n, 1)]
    if bad and n > 0:
        raise RunError(f"--k {','.join(map(str, ks))}: each k must be between 1 and --n {n}")
    if run_dir:
        ckpt = checkpoint_of(run_dir, step)
        plan = run_plan_of(run_dir, path=path, flow=flow, sets=sets)
    else:
        plan, ckpt = build_plan(path, flow=flow, sets=sets, steps=1), None
    check_installed()
    quiet_environment()
    ray_auth_environment(ray_address)
    from flowrl.runtime.evaluate import EvalError, evaluate

    try:
        return evaluate(plan, ckpt, n=n, ks=ks, temperature=temperature, seed=seed, ray_address=ray_address,
                        log=lambda message: print(message, file=stream))
    except EvalError as e:
        raise RunError(str(e)) from None
    except BaseException as error:
        joined = ray_connection_error(error, ray_address)
        if joined is not None:
            raise joined from None
        raise
