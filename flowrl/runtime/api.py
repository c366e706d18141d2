"""``flowrl run`` and ``flowrl plan`` as functions: compile, lower, run.

Errors a user can fix come back as :class:`RunError` with a one-line message (and the
rendered diagnostics for compile errors); the CLI prints them without a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from flowrl.compiler.lower import RUN_PARAMS, lower
from flowrl.compiler.pipeline import compile_file
from flowrl.plan import ExecutionPlan


QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1",
             "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


class RunError(Exception):
    """A failure of ``flowrl run`` the user can act on (bad override, missing engine, ...)."""


REQUIRED = {"torch": "pip install torch==2.13.0 (CPU) or a CUDA build on GPUs",
            "ray": "pip install 'ray[default]'",
            "transformers": "pip install transformers"}


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RunError(f"--set {item!r}: expected key=value, e.g. --set group=8")
        out[key.strip()] = value.strip()
    return out


def build_plan(path: str, *, flow: str | None = None, sets: dict[str, str] | None = None,
               steps: int | None = None, save_every: int | None = None) -> ExecutionPlan:
    """Compile ``path`` (FlowError on bad input) and lower it with the run settings."""
    sets = dict(sets or {})
    compiled = compile_file(path, flow, options={"overrides": {k: v for k, v in sets.items()
                                                              if k not in RUN_PARAMS or _declares(path, flow, k)}})
    run = {k: _int(k, v) for k, v in sets.items() if k in RUN_PARAMS}
    if steps is not None:
        run["steps"] = steps
    if save_every is not None:
        run["save_every"] = save_every
    return lower(compiled.graph, run)


def _declares(path, flow, name) -> bool:
    from flowrl.compiler.pipeline import entry_flow, read_source
    from flowrl.syntax.parser import parse

    fdef = entry_flow(parse(read_source(path), str(path)), flow)
    return any(p.name == name for p in fdef.params)


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise RunError(f"--set {key}={value}: {key} must be an integer") from None


def check_installed() -> None:
    for mod, fix in REQUIRED.items():
        if importlib.util.find_spec(mod) is None:
            raise RunError(f"`{mod}` is not installed, and `flowrl run` needs it: {fix} "
                           "(or `pip install -e '.[cpu]'`)")


def run_file(path: str, *, flow: str | None = None, sets: dict | None = None, steps: int | None = None,
             out: str | None = None, resume: str | None = None, save_every: int | None = None,
             ray_address: str | None = None, faults=None, stream=None):
    import sys

    from flowrl.runtime.driver import run_plan

    check_installed()
    for key, value in QUIET_ENV.items():  # engines' own progress bars would drown the run's progress line
        os.environ.setdefault(key, value)
    if resume:
        out_dir = Path(resume)
        plan_file = out_dir / "plan.json"
        if not plan_file.is_file():
            raise RunError(f"--resume {resume}: no plan.json there; pass the run directory of an earlier run")
        plan = ExecutionPlan.from_json(plan_file.read_text())
        if steps is not None:  # a resumed run may go further than planned
            from dataclasses import replace

            plan = replace(plan, run=replace(plan.run, steps=steps))
            plan_file.write_text(plan.to_json())
    else:
        plan = build_plan(path, flow=flow, sets=sets, steps=steps, save_every=save_every)
        out_dir = Path(out) if out else Path("runs") / f"{Path(path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return run_plan(plan, out_dir, resume=bool(resume), ray_address=ray_address, faults=faults,
                    stream=stream or sys.stderr)


def describe_plan(plan: ExecutionPlan, explain: bool = False) -> str:
    """The human summary of ``flowrl plan`` (see :mod:`flowrl.compiler.explain`)."""
    from flowrl.compiler.explain import describe_plan as describe

    return describe(plan, explain=explain)


def plan_json(plan: ExecutionPlan) -> str:
    return json.dumps(plan.to_dict(), indent=2, sort_keys=True) + "\n"
