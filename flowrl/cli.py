"""The ``flowrl`` command line: check, fmt, ir, graph, plan, profile, run, eval (docs/cli.md is the user guide).

Exit codes: 0 success; 1 diagnostics, a failed ``fmt --check`` or a one-line error
(missing Graphviz, an unwritable output file); 2 usage errors (bad options).

Every subcommand is one :class:`Command` in :data:`COMMANDS` (name -> help, examples,
``add_args(parser)``, ``handler(args) -> exit code``). A new subcommand is a new entry::

    register(Command("plan", "lower a flow to an execution plan", "flowrl plan x.flow",
                     add_plan_args, run_plan))

Handlers import the compiler inside themselves, so ``flowrl --help`` and ``--version``
load nothing but argparse, and no command ever imports torch, Ray or vLLM. Output goes
to ``sys.stdout`` / ``sys.stderr`` as they are at call time (tests use capsys), in plain
text without colour so that outputs can be compared byte for byte.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from flowrl import __version__
from flowrl.diagnostics import FlowError, report_warnings


class CliError(Exception):
    """A one-line error for the user (exit 1), printed as ``flowrl: error: MESSAGE``."""


class UsageError(Exception):
    """Options that do not fit together (exit 2), printed under the command's usage line."""


@dataclass(frozen=True)
class Command:
    """One subcommand: ``flowrl NAME ...``."""

    name: str
    help: str
    """One line, shown in ``flowrl --help`` and at the top of ``flowrl NAME --help``."""
    examples: str
    """Example invocations, one per line, shown at the end of ``flowrl NAME --help``."""
    add_args: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]
    """Runs the command; returns the exit code. May raise FlowError, CliError, UsageError."""


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add (or replace) a subcommand; the order of registration is the order in ``--help``."""
    COMMANDS[command.name] = command
    return command


# ---- helpers shared by the commands -------------------------------------------------------


def _out() -> TextIO:
    """Standard output as it is now (looked up at each call, so capsys sees it)."""
    return sys.stdout


def _err() -> TextIO:
    return sys.stderr


def _print_error(err: FlowError) -> None:
    _err().write(err.render())


def expand_paths(paths: list[str]) -> list[str]:
    """Each argument as given, except a directory, which stands for its ``*.flow`` files
    (recursively, sorted). ``-`` (standard input) passes through."""
    out: list[str] = []
    for p in paths:
        path = Path(p)
        if p != "-" and path.is_dir():
            found = sorted(str(f) for f in path.rglob("*.flow") if f.is_file())
            if not found:
                raise CliError(f"no .flow files under directory {p}")
            out.extend(found)
        else:
            out.append(p)
    return out


def write_output(data: bytes, output: str | None) -> None:
    """Write ``data`` to the file ``output``, or to standard output when it is None or ``-``."""
    if output is None or output == "-":
        stdout = _out()
        stdout.flush()
        buffer = getattr(stdout, "buffer", None)
        if buffer is None:  # a text-only stream (e.g. StringIO): only text can go there
            stdout.write(data.decode("utf-8"))
        else:
            buffer.write(data)
            buffer.flush()
        return
    try:
        Path(output).write_bytes(data)
    except OSError as e:
        raise CliError(f"cannot write {output}: {e.strerror or e}") from None


def write_atomic(path: str, text: str) -> None:
    """Replace a file's contents in one step (a temp file renamed over it), keeping its
    permissions, so an interrupted write never leaves half a file."""
    target = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise CliError(f"cannot write {path}: {e.strerror or e}") from None


# ---- option values: one validator per kind (argparse ``type=``; a bad value is a usage error, exit 2,
# "argument --OPTION: ..." naming the value and what is accepted) -----------------------------------


def count(least: int, why: str = "") -> Callable[[str], int]:
    """An integer option's type: ``least`` or more (``why``: what the bound means, said when it is broken)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give an integer >= {least}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}; give an integer >= {least}"
                                             + (f" ({why})" if why else ""))
        return value

    parse.least = least  # what tests of every integer option read
    return parse


def real(*, above: float | None = None) -> Callable[[str], float]:
    """A number option's type: finite (and ``> above`` where given)."""
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"{text} must be > {above:g}")
        return value

    parse.above = above
    return parse


def counts(least: int) -> Callable[[str], tuple[int, ...]]:
    """A comma-separated list of integers, each ``least`` or more (``--k 1,4,8``)."""
    one = count(least)

    def parse(text: str) -> tuple[int, ...]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas, e.g. 1,4,8")
        try:
            return tuple(one(t) for t in items)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    parse.least = least
    return parse


def _writable_place(path: Path, what: str) -> None:
    """ArgumentTypeError unless ``path`` can be created (or written) by this user: its nearest existing
    ancestor must be a directory this user may write into, and no ancestor a file."""
    probe = Path(os.path.abspath(path))
    for parent in [probe, *probe.parents]:
        if os.path.lexists(parent):
            break
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: {parent} is a file, not a directory; {what} needs a directory "
                                          "there")
    if parent == probe:
        return
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path}: {parent} is not writable by you; choose another place")


def out_dir(text: str) -> str:
    """A run directory to write (``--out``): a directory there or creatable, writable by this user."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty path; give a directory, e.g. runs/a")
    path = Path(text)
    if os.path.lexists(path) and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory; choose another place for the run")
    _writable_place(path, "a run")
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: the directory is not writable by you; choose another place")
    return text


def out_file(text: str) -> str:
    """A file to write (``-o``, ``--gantt``): ``-`` (standard output, where accepted), or a path whose
    directory exists or can be made, writable by this user."""
    if text == "-":
        return text
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty path; give a file name")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text}: the file is not writable by you")
        return text  # written over, as the last chart or drawing was
    _writable_place(path, "the file")
    return text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# ---- flowrl check --------------------------------------------------------------------------


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a .flow file, or a directory (all .flow files under it)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only diagnostics (no `ok:` lines, no summary)")


def run_check(args: argparse.Namespace) -> int:
    """Compile every flow of every file; ``ok: FILE (N flows)`` or the diagnostics."""
    from flowrl.compiler.pipeline import check_file

    files = expand_paths(args.files)
    failed, errors = 0, 0
    for path in files:
        try:
            graphs = check_file(path)
        except FlowError as e:
            _print_error(e)
            failed += 1
            errors += len(e.errors)
            continue
        warned = report_warnings([w for g in graphs.values() for w in g.warnings],
                                 next(iter(graphs.values())).sources if graphs else None, _err())
        if not args.quiet:  # warnings do not fail a check (exit 0)
            print(f"ok: {path} ({_plural(len(graphs), 'flow')}"
                  + (f", {_plural(warned, 'warning')}" if warned else "") + ")", file=_out())
    if failed and not args.quiet:
        print(f"flowrl: {_plural(errors, 'error')} in {failed} of {_plural(len(files), 'file')}", file=_err())
    return 1 if failed else 0


register(Command(
    "check", "compile every flow of each file and report all diagnostics",
    "flowrl check flows/arith_grpo.flow\n"
    "flowrl check flows/ stdlib/   # every .flow file under both directories\n"
    "flowrl check -q flows/*.flow  # diagnostics only",
    _check_args, run_check))


# ---- flowrl fmt ----------------------------------------------------------------------------


def _fmt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a .flow file, a directory (all .flow files under it), or - for standard input")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-w", "--write", action="store_true",
                      help="rewrite files in place (only those that change)")
    mode.add_argument("--check", action="store_true",
                      help="change nothing; list files that are not formatted and exit 1 if any")
    p.add_argument("--diff", action="store_true", help="print a unified diff of the changes")
    p.add_argument("-q", "--quiet", action="store_true", help="with --write: do not list rewritten files")


def run_fmt(args: argparse.Namespace) -> int:
    """Format files canonically: to stdout, in place (--write), as a diff, or as a check."""
    from flowrl.compiler.pipeline import read_source
    from flowrl.syntax.fmt import FormatError, format_source

    files = expand_paths(args.files)
    to_stdout = not (args.write or args.check or args.diff)
    if to_stdout and len(files) > 1:
        raise UsageError("fmt prints one file to standard output; "
                         "use --write, --check or --diff for several files")
    if args.write and "-" in files:
        raise UsageError("cannot --write standard input; give a file")
    failed, changed = 0, []
    for path in files:
        try:
            raw = sys.stdin.read().encode("utf-8") if path == "-" else read_source(path)
            shown = "<stdin>" if path == "-" else path
            new = format_source(raw, shown)
        except FlowError as e:
            _print_error(e)  # the file is left as it was
            failed += 1
            continue
        except FormatError as e:
            print(f"flowrl: error: {e}", file=_err())
            failed += 1
            continue
        old = raw.decode("utf-8")  # it parsed, so it is UTF-8
        if to_stdout:
            _out().write(new)
            continue
        if new == old:
            continue
        changed.append(shown)
        if args.diff:
            _out().writelines(difflib.unified_diff(
                old.splitlines(keepends=True), new.splitlines(keepends=True),
                f"a/{shown}", f"b/{shown}"))
        if args.check:
            print(f"would reformat: {shown}", file=_out())
        if args.write:
            try:
                write_atomic(path, new)
            except CliError as e:  # report it and go on with the other files
                print(f"flowrl: error: {e}", file=_err())
                failed += 1
                continue
            if not args.quiet:
                print(f"reformatted: {shown}", file=_err())
    return 1 if failed or (args.check and changed) else 0


register(Command(
    "fmt", "print .flow files in canonical layout (comments kept)",
    "flowrl fmt flows/arith_grpo.flow          # canonical text to stdout\n"
    "flowrl fmt -w flows/                      # rewrite every file that changes\n"
    "flowrl fmt --check flows/ stdlib/         # CI: exit 1 and list files that would change\n"
    "flowrl fmt --diff flows/arith_grpo.flow   # show what would change\n"
    "cat flows/arith_grpo.flow | flowrl fmt -  # format standard input",
    _fmt_args, run_fmt))


# ---- flowrl ir -----------------------------------------------------------------------------


def _ir_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a .flow file")
    p.add_argument("--flow", metavar="NAME",
                   help="the flow to compile (default: the scheduled flow, else `main`, else the last)")
    p.add_argument("--dump-after", metavar="PASS",
                   help="print the IR after this pass and stop there: `build` (the raw graph) or a pass "
                        "name; a wrong name lists them (default: after all passes)")
    p.add_argument("--lint", action="store_true",
                   help="check the IR invariants after every pass (names the pass that broke one)")


def pass_names() -> tuple[str, ...]:
    """What ``--dump-after`` accepts: ``build`` then the passes in order."""
    from flowrl.compiler.pipeline import PASS_NAMES

    return ("build",) + tuple(PASS_NAMES)


def run_ir(args: argparse.Namespace) -> int:
    """Print the deterministic text form of the IR after a pass."""
    from flowrl.compiler.pipeline import compile_file
    from flowrl.ir.lint import LintError
    from flowrl.ir.printer import print_graph

    names = pass_names()
    if args.dump_after is not None and args.dump_after not in names:
        raise UsageError(f"unknown pass `{args.dump_after}` for --dump-after; choose from: {', '.join(names)}")
    try:
        compiled = compile_file(args.file, flow=args.flow, until=args.dump_after, lint_each=args.lint)
    except LintError as e:  # a compiler bug, not the user's: say so, with the pass that did it
        raise CliError(f"internal compiler error (please report it): {e}") from None
    _out().write(print_graph(compiled.graph))
    return 0


register(Command(
    "ir", "print the compiler's IR of a flow (after all passes, or after one)",
    "flowrl ir flows/arith_grpo.flow\n"
    "flowrl ir flows/arith_grpo.flow --flow main --dump-after resolve_names\n"
    "flowrl ir flows/arith_grpo.flow --dump-after build  # the raw graph, before any pass\n"
    "flowrl ir flows/arith_grpo.flow --lint              # lint the IR after every pass",
    _ir_args, run_ir))


# ---- flowrl graph --------------------------------------------------------------------------

GRAPH_FORMATS = ("dot", "svg", "png", "mermaid")
_SUFFIX_FORMATS = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png", ".mmd": "mermaid",
                   ".mermaid": "mermaid"}


def _graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a .flow file")
    p.add_argument("--flow", metavar="NAME",
                   help="the flow to draw (default: the scheduled flow, else `main`, else the last)")
    p.add_argument("--format", choices=GRAPH_FORMATS,
                   help="dot or mermaid (text), svg or png (need Graphviz `dot`); "
                        "default: from the -o suffix, else dot")
    p.add_argument("-o", "--output", type=out_file, metavar="OUT", help="write here instead of standard output")


def graph_format(fmt: str | None, output: str | None) -> str:
    """The output format: as given, else implied by the output file's suffix, else ``dot``."""
    if fmt is not None:
        return fmt
    if output is not None:
        return _SUFFIX_FORMATS.get(Path(output).suffix.lower(), "dot")
    return "dot"


def run_graph(args: argparse.Namespace) -> int:
    """Draw the compiled graph as DOT, Mermaid, SVG or PNG."""
    from flowrl import views
    from flowrl.compiler.pipeline import compile_file

    fmt = graph_format(args.format, args.output)
    if fmt == "png" and args.output in (None, "-") and _out().isatty():
        raise UsageError("refusing to write PNG bytes to a terminal; use -o FILE.png")
    graph = compile_file(args.file, flow=args.flow).graph
    if fmt == "mermaid":
        data = views.to_mermaid(graph).encode("utf-8")
    elif fmt == "dot":
        data = views.to_dot(graph).encode("utf-8")
    else:
        try:
            data = views.render_dot(views.to_dot(graph), fmt)
        except views.GraphvizError as e:
            raise CliError(str(e)) from None
    write_output(data, args.output)
    return 0


register(Command(
    "graph", "draw a flow's compiled graph (Graphviz DOT, SVG, PNG or Mermaid)",
    "flowrl graph flows/arith_grpo.flow -o grpo.svg       # format from the suffix\n"
    "flowrl graph flows/arith_grpo.flow --format png -o grpo.png\n"
    "flowrl graph flows/arith_grpo.flow --format mermaid  # paste into Markdown\n"
    "flowrl graph flows/arith_grpo.flow | dot -Tpdf -o grpo.pdf",
    _graph_args, run_graph))


# ---- flowrl plan / flowrl run ------------------------------------------------------------


def _flow_args(p: argparse.ArgumentParser, file_required: bool = True) -> None:
    p.add_argument("file", metavar="FILE", help="the .flow file", **({} if file_required else {"nargs": "?"}))
    p.add_argument("--flow", help="the flow to run (default: the scheduled flow, else `main`, else the last)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a parameter of the entry flow (or a run setting: steps, seed, eval_every, "
                        "save_every, log, log_samples)")
    p.add_argument("--steps", type=count(1, "a run trains at least one step; `flowrl eval FILE` measures a model "
                                        "without training"), help="number of RL steps")


def _plan_args(p: argparse.ArgumentParser) -> None:
    _flow_args(p)
    p.add_argument("--json", action="store_true", help="print the ExecutionPlan as JSON (for tools)")
    p.add_argument("--explain", action="store_true",
                   help="also show what `schedule auto` searched: the winner, the runners-up, what it rejected")
    g = p.add_argument_group("Gantt chart of the simulated steps (docs/schedules.md)")
    g.add_argument("--gantt", type=out_file, metavar="OUT.png",
                   help="draw the simulated steps, one row per engine, to this PNG")
    g.add_argument("--measured", metavar="RUN_DIR",
                   help="with --gantt: draw a run of this flow (its trace.json) under the simulation, on the same "
                        "rows, and simulate with the run's measured workload")
    g.add_argument("--gantt-trace", type=out_file, metavar="OUT.json",
                   help="with --gantt: also write the simulated steps as a Chrome/Perfetto trace")
    g.add_argument("--gantt-steps", type=count(1), default=3, metavar="N", help="steps to draw (default 3)")


def run_plan_cmd(args: argparse.Namespace) -> int:
    from flowrl.cost import autoprofile, profiles
    from flowrl.launch import RunError, build_plan, describe_plan, parse_sets, plan_json

    if args.json and args.explain:
        raise UsageError("--json already holds the search report (`search`); drop --explain")
    if (args.measured or args.gantt_trace) and not args.gantt:
        raise UsageError("--measured and --gantt-trace go with --gantt OUT.png")
    try:
        autoprofile.use_auto_profile(cached_only=True)  # this machine's figures, if measured before
        sets = parse_sets(args.set)
        plan = build_plan(args.file, flow=args.flow, sets=sets, steps=args.steps)
        if autoprofile.measures(plan.cluster.get("gpu", "")) and autoprofile.use_auto_profile() is not None:
            plan = build_plan(args.file, flow=args.flow, sets=sets, steps=args.steps)  # measured just now
    except profiles.ProfileError as e:
        raise CliError(str(e)) from None
    except RunError as e:
        raise CliError(str(e)) from None
    _out().write(plan_json(plan) if args.json else describe_plan(plan, explain=args.explain))
    if args.gantt:
        _write_gantt(args, sets)
    return 0


def _write_gantt(args: argparse.Namespace, sets: dict) -> None:
    """``flowrl plan --gantt``: the simulated steps (and a measured run) as a PNG (and a trace)."""
    from flowrl import gantt
    from flowrl.cost.validate import ValidateError

    try:
        info = gantt.gantt_files(args.file, args.gantt, sets=sets, flow=args.flow, run_dir=args.measured,
                                 trace=args.gantt_trace, steps=args.gantt_steps)
    except (gantt.GanttError, ValidateError) as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write the Gantt chart: {e.strerror or e}") from None
    err = _err()
    line = f"gantt: {info['png']} (simulated {info['predicted_s']:.3g} s/step"
    if info["measured_s"] is not None:
        gap = 100 * (info["predicted_s"] - info["measured_s"]) / info["measured_s"]
        line += f", measured {info['measured_s']:.3g} s/step, {gap:+.0f}%"
    print(line + ")" + (f"; trace {info['trace']}" if info["trace"] else ""), file=err)


register(Command(
    "plan", "lower a flow to its execution plan: engines on GPUs, layouts, weight sync, estimated step time",
    "flowrl plan flows/arith_grpo.flow\n"
    "flowrl plan flows/grpo_auto.flow --explain                                # why `schedule auto` chose it\n"
    "flowrl plan flows/arith_grpo.flow --json > plan.json\n"
    "flowrl plan flows/arith_grpo.flow --gantt sim.png --gantt-trace sim.json  # simulated steps\n"
    "flowrl plan flows/arith_grpo.flow --gantt cmp.png --measured runs/a       # simulated over measured",
    _plan_args, run_plan_cmd))


# ---- flowrl profile ------------------------------------------------------------------------------


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", type=out_file, metavar="FILE",
                   help="where to write the profile (default: $FLOWRL_PROFILE, else ~/.cache/flowrl/profile.json)")
    p.add_argument("--size", type=count(1), default=1024, metavar="N", help="matmul size N (N x N @ N x N, fp32)")
    p.add_argument("--copy-mb", type=count(1), default=256, metavar="MB", help="memcpy size in MB")
    p.add_argument("--allreduce-mb", type=count(1), default=64, metavar="MB", help="gloo allreduce size in MB")
    p.add_argument("--repeat", type=count(1), default=3, metavar="K", help="best of K runs of each measurement")
    p.add_argument("--no-allreduce", action="store_true", help="skip the 2-process gloo allreduce")
    p.add_argument("--calibrate", metavar="RUN_DIR", nargs="+",
                   help="instead of measuring: set what a matmul cannot show (engine dispatch, decode and "
                        "micro-batch overheads, achieved efficiency of log-prob and update passes) from finished "
                        "runs on this machine (two of different batch sizes separate fixed from per-item costs)")


def run_calibrate(args: argparse.Namespace) -> int:
    """``flowrl profile --calibrate RUN_DIR``: fixed costs from a run, merged into the profile."""
    from flowrl.compiler.calibrate import calibrate
    from flowrl.cost import profiles, validate

    target = Path(args.output) if args.output else profiles.profile_path()
    if not target.is_file():
        raise CliError(f"no profile at {target} to calibrate; run `flowrl profile` first")
    base = profiles.load_profile(target)
    runs = []
    for run_dir in args.calibrate:
        plan, rows, events = validate.read_run(run_dir)
        source = plan.get("source", "")
        if not source or not Path(source).is_file():
            raise CliError(f"{run_dir}: the run's flow file {source!r} is not there; calibrate where the run was made")
        runs.append((source, validate.measure_run(plan, rows, events)))
    prof = calibrate(base, runs)
    path = profiles.save_profile(prof, target)
    print(f"{prof.source.split('; calibrated from ')[-1]}; wrote {path}", file=_out())
    return 0


def run_profile(args: argparse.Namespace) -> int:
    """Measure this machine (matmul, memcpy, gloo allreduce) for the `cpu` cost profile."""
    from flowrl.cost import profiles

    if args.calibrate:
        try:
            return run_calibrate(args)
        except (profiles.ProfileError, ValueError) as e:
            raise CliError(str(e)) from None

    if not profiles.can_measure():
        from flowrl.launch import REQUIRED

        raise CliError(f"`flowrl profile` measures with {profiles.MEASURES_WITH}, which is not installed: "
                       f"{REQUIRED[profiles.MEASURES_WITH]}")
    prof = profiles.measure(args.size, args.copy_mb, args.allreduce_mb, args.repeat,
                            with_allreduce=not args.no_allreduce)
    try:
        path = profiles.save_profile(prof, args.output)
    except OSError as e:
        raise CliError(f"cannot write the profile: {e.strerror or e}") from None
    out = _out()
    print(f"matmul {prof.tflops * 1e3:.1f} GFLOP/s, memcpy {prof.hbm_gbs:.2f} GB/s, "
          f"gloo allreduce {prof.nvlink_gbs:.2f} GB/s, memory {prof.memory_total_gb:.1f} GB; the train engine "
          f"reaches {prof.mfu_forward:.0%} of the matmul in a log-prob pass, {prof.mfu_train:.0%} in an update "
          f"(+{prof.micro_overhead_s * 1e3:.1f} ms a micro-batch)", file=out)
    print(f"wrote {path} (used by `flowrl plan` for gpu = \"cpu\")", file=out)
    return 0


register(Command(
    "profile", "measure this machine (matmul, memcpy, gloo allreduce) for the cost model's `cpu` profile",
    "flowrl profile\n"
    "flowrl profile -o profile.json --size 512 --no-allreduce\n"
    "flowrl profile --calibrate runs/a  # from runs (`flowrl run ... --out runs/a`)",
    _profile_args, run_profile))


def _run_args(p: argparse.ArgumentParser) -> None:
    from flowrl.catalog.loggers import LOGGERS, TRACKING_SETTINGS

    _flow_args(p, file_required=False)
    p.add_argument("--out", type=out_dir, metavar="DIR",
                   help="run directory, new or empty (default: runs/<file>-<time>); an earlier run's needs --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the earlier run in --out DIR")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a run from its latest checkpoint, with its own settings (FILE may be left out; "
                        "--steps, --save-every, --keep-last, --keep-best and --export-every may change)")
    p.add_argument("--resume-step", type=count(1, "checkpoints hold the state after a step, numbered from 1"),
                   metavar="N",
                   help="with --resume: continue from step N's checkpoint rather than the newest (e.g. when "
                        "--resume reports the newest damaged)")
    p.add_argument("--save-every", type=count(0, "0: no checkpoint but the last"), metavar="N",
                   help="checkpoint every N steps")
    p.add_argument("--keep-last", type=count(0, "0: keep every checkpoint"), metavar="K",
                   help="checkpoint retention: keep the newest K checkpoints, deleting older ones as they are "
                        "superseded (TRL's save_total_limit; default: the flow's `keep_last`, else 0: all)")
    p.add_argument("--keep-best", type=count(0, "0: none"), nargs="?", const=1, metavar="N",
                   help="also keep the N (default 1) checkpoints with the best held-out accuracy (eval/accuracy; "
                        "TRL's load_best_model_at_end)")
    p.add_argument("--export-every", type=count(0, "0: never"), metavar="N",
                   help="every N steps and after the last, export the policy as a Hugging Face directory to "
                        "RUN_DIR/exports/step_N (what `flowrl export` writes)")
    p.add_argument("--restarts", type=count(0, "0: never restart"), default=0, metavar="N",
                   help="when an engine dies, hangs or loses its node, restart the engines from the last "
                        "checkpoint, up to N times (default 0: stop and say how to resume)")
    p.add_argument("--log", metavar="NAMES",
                   help=f"experiment trackers, comma-separated: {', '.join(LOGGERS)} (default: the flow's `log` "
                        "setting, else none); W&B goes online with credentials (WANDB_API_KEY, `wandb login`), else "
                        "offline; MLflow to --log-uri or MLFLOW_TRACKING_URI, else RUN_DIR/mlruns")
    for key, meaning in TRACKING_SETTINGS.items():  # the flow's settings of the same names, overridden
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar="TAGS" if key == "log_tags" else
                       "URI" if key == "log_uri" else "NAME", help=meaning)
    p.add_argument("--log-samples", type=count(0, "0: never"), metavar="N",
                   help="every N steps, a table of sample completions (prompt, completion, reward, step) to "
                        "samples.jsonl and each tracker")
    p.add_argument("--ray", metavar="ADDRESS", help="join an existing Ray cluster (default: $RAY_ADDRESS or a local one)")


def _run_failure(e: BaseException) -> CliError | None:
    """The one-line error of a failure the user can fix, else None (a bug: keep the traceback)."""
    from flowrl.launch import RunError
    from flowrl.runtime.errors import user_error

    if isinstance(e, RunError):
        return CliError(str(e))
    message = user_error(e)
    return CliError(message) if message is not None else None


def run_run(args: argparse.Namespace) -> int:
    if args.file is None and not args.resume:
        raise UsageError("give the .flow file to run (or --resume RUN_DIR)")
    from flowrl.catalog.loggers import TRACKING_SETTINGS
    from flowrl.launch import RETENTION_SETTINGS, parse_sets, run_file
    from flowrl.runtime.preemption import Preempted

    try:
        result = run_file(args.file, flow=args.flow, sets=parse_sets(args.set), steps=args.steps, out=args.out,
                          resume=args.resume, save_every=args.save_every, overwrite=args.overwrite, log=args.log,
                          log_samples=args.log_samples, ray_address=args.ray, resume_step=args.resume_step,
                          restarts=args.restarts, tracking={k: getattr(args, k) for k in TRACKING_SETTINGS},
                          retention={k: getattr(args, k) for k in RETENTION_SETTINGS})
    except FlowError:
        raise
    except Preempted as preempted:  # a stop signal (SIGTERM, SIGINT): stopped cleanly at a step boundary
        print(f"flowrl: {preempted}", file=_err())
        return 0
    except Exception as e:  # bad options, engine/data/reward failures the user can fix: one line
        failure = _run_failure(e)
        if failure is None:
            raise
        raise failure from None
    out = _out()
    if getattr(result, "already_finished", False):
        print(f"run directory {result.out} already finished its {result.steps} steps; nothing to do "
              f"(--steps N with N > {result.steps} trains further)", file=out)
    else:
        print(f"run directory: {result.out} (metrics.jsonl, curves.png, trace.json, summary.json)", file=out)
    if result.accuracy_before is not None and result.accuracy_after is not None:
        print(f"held-out accuracy: {100 * result.accuracy_before:.1f}% -> {100 * result.accuracy_after:.1f}%",
              file=out)
    return 0


register(Command(
    "run", "run a flow: start Ray and the engines, train, write the run directory",
    "flowrl run flows/arith_grpo.flow\n"
    "flowrl run flows/arith_grpo.flow --steps 10 --set lr=3e-4\n"
    "flowrl run flows/arith_grpo.flow --save-every 10 --out runs/a\n"
    "flowrl run --resume runs/a --steps 20                        # continue from the latest checkpoint\n"
    "flowrl run flows/arith_grpo.flow --save-every 10 --restarts 2  # a dead engine: restart from the checkpoint\n"
    "flowrl run flows/arith_grpo.flow --save-every 5 --keep-last 2 --keep-best  # retention: the 2 newest + the best\n"
    "flowrl run flows/arith_grpo.flow --export-every 10              # RUN_DIR/exports/step_N: Hugging Face dirs\n"
    "flowrl run flows/arith_grpo.flow --log tensorboard,wandb,mlflow --log-samples 10\n"
    "flowrl run flows/arith_grpo.flow --log mlflow --log-uri http://127.0.0.1:5000 --log-name baseline --log-tags grpo,arith\n"
    "RAY_ADDRESS=127.0.0.1:6379 flowrl run flows/arith_grpo.flow  # a cluster started by `ray start`",
    _run_args, run_run))


def _eval_args(p: argparse.ArgumentParser) -> None:
    _flow_args(p)
    p.add_argument("--from", dest="run_dir", metavar="RUN_DIR",
                   help="evaluate this run's checkpoint (default: the flow's model as the flow builds it)")
    p.add_argument("--step", type=count(1, "checkpoints hold the state after a step, numbered from 1"), metavar="N",
                   help="with --from: the checkpoint of step N (default: the latest)")
    p.add_argument("--n", type=count(0, "0: greedy only"), default=8, metavar="N",
                   help="completions sampled per prompt for pass@k (default 8; 0: greedy only)")
    p.add_argument("--k", type=counts(1), default=(1,), metavar="K,...",
                   help="pass@k for these k <= n (default 1; e.g. 1,4,8)")
    p.add_argument("--temperature", type=real(), default=1.0, metavar="T", help="sampling temperature (default 1.0)")
    p.add_argument("--seed", type=count(0), default=0, help="sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--ray", metavar="ADDRESS", help="join an existing Ray cluster (default: $RAY_ADDRESS or a local one)")


def run_eval(args: argparse.Namespace) -> int:
    """Held-out greedy accuracy and pass@k of a checkpoint (or the initial model); no training."""
    import json

    from flowrl.launch import eval_file, parse_sets

    ks = args.k
    if args.steps is not None:
        raise UsageError("`flowrl eval` trains nothing: drop --steps")
    try:
        result = eval_file(args.file, run_dir=args.run_dir, step=args.step, flow=args.flow, sets=parse_sets(args.set),
                           n=args.n, ks=ks or (1,), temperature=args.temperature, seed=args.seed,
                           ray_address=args.ray)
    except FlowError:
        raise
    except Exception as e:
        failure = _run_failure(e)
        if failure is None:
            raise
        raise failure from None
    data = result.to_dict()
    if args.run_dir:
        from flowrl.runtime.rundir import own

        target = Path(args.run_dir) / "eval" / f"{Path(result.checkpoint).name}.json"
        try:
            own(Path(args.run_dir), target)  # listed in the run's own list before it is written
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError as e:
            raise CliError(f"cannot write {target}: {e.strerror or e}") from None
    out = _out()
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True), file=out)
        return 0
    what = f"checkpoint {result.checkpoint}" if result.checkpoint else "the initial model"
    print(f"held-out evaluation of {what} on {result.dataset} ({result.prompts} prompts)", file=out)
    accuracy = "" if result.greedy_accuracy is None else f"accuracy {100 * result.greedy_accuracy:.1f}%, "
    print(f"  greedy: {accuracy}mean reward {result.greedy_reward:.3f}", file=out)
    if result.n:
        passes = "".join(f"pass@{k} {100 * v:.1f}%, " for k, v in result.pass_at.items())
        print(f"  sampled: n={result.n} per prompt at temperature {result.temperature:g}: {passes}"
              f"mean reward {result.sampled_reward:.3f}", file=out)
    if args.run_dir:
        print(f"wrote {target}", file=out)
    return 0


register(Command(
    "eval", "held-out evaluation without training: greedy accuracy and pass@k of a checkpoint",
    "flowrl eval flows/arith_grpo.flow --from runs/a --n 8 --k 1,8  # a run's latest checkpoint\n"
    "flowrl eval flows/arith_grpo.flow --n 0                        # the flow's model before RL, greedy only",
    _eval_args, run_eval))


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a `flowrl run` (its --out)")
    p.add_argument("--to", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    p.add_argument("--step", type=count(1, "checkpoints hold the state after a step, numbered from 1"), metavar="N",
                   help="the checkpoint of step N (default: the latest)")
    p.add_argument("--model", metavar="ID", help="the policy to export when the run trains several")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA policy: the adapters merged into the base weights (default: a PEFT adapter directory)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file (default 5GB, as transformers); above it, shards and an index")


def run_export(args: argparse.Namespace) -> int:
    """A run's checkpoint as a Hugging Face directory (flowrl.runtime.export)."""
    from flowrl.runtime.errors import RuntimeFlowError
    from flowrl.runtime.export import export_run, parse_size

    try:
        done = export_run(args.run_dir, args.to, step=args.step, model=args.model, merge_lora=args.merge_lora,
                          max_shard_bytes=parse_size(args.max_shard_size), log=lambda m: print(m, file=_err()))
    except RuntimeFlowError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write {args.to}: {e.strerror or e}") from None
    what = "a PEFT adapter directory" if done.kind == "adapter" else "a model directory"
    print(f"exported `{done.model}` after step {done.step} to {done.path} ({what}: {', '.join(done.files)})",
          file=_out())
    return 0


register(Command(
    "export", "write a run's checkpoint as a Hugging Face model directory (transformers, vLLM, SGLang, PEFT)",
    "flowrl export runs/a --to exported/a                        # the latest checkpoint\n"
    "flowrl export runs/a --step 2 --to exported/a2              # the checkpoint of step 2\n"
    "flowrl export runs/a --to exported/a-shards --max-shard-size 200KB  # safetensors shards + index\n"
    "(a LoRA run exports a PEFT adapter directory; --merge-lora: the adapters merged into the base)",
    _export_args, run_export))


# ---- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command."""
    # The first example of each command, without its trailing comment.
    examples = "\n".join(f"  {c.examples.splitlines()[0].split('  #')[0].rstrip()}" for c in COMMANDS.values())
    parser = argparse.ArgumentParser(
        prog="flowrl", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="flowrl: a dataflow language and compiler for RL post-training of LLMs.",
        epilog=f"examples:\n{examples}\n\n"
               "exit codes: 0 ok, 1 diagnostics or failed check, 2 usage error.\n"
               "`flowrl COMMAND --help` shows each command's options and examples.")
    parser.add_argument("--version", action="version", version=f"flowrl {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="show the Python traceback of an internal error (for bug reports)")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in COMMANDS.values():
        sub = subs.add_parser(cmd.name, help=cmd.help, description=cmd.help, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="examples:\n" + "\n".join(f"  {l}" for l in cmd.examples.splitlines()))
        cmd.add_args(sub)
        sub.set_defaults(_command=cmd, _parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``flowrl`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    command: Command | None = getattr(args, "_command", None)
    if command is None:
        parser.print_help(_err())
        return 2
    try:
        return command.handler(args)
    except FlowError as e:
        _print_error(e)
        return 1
    except CliError as e:
        print(f"flowrl: error: {e}", file=_err())
        return 1
    except UsageError as e:
        args._parser.print_usage(_err())
        print(f"{args._parser.prog}: error: {e}", file=_err())
        return 2
    except KeyboardInterrupt:
        print("flowrl: interrupted", file=_err())
        return 130
    except BrokenPipeError:  # `flowrl ir x.flow | head`: the reader left; not an error of ours
        _silence_stdout()
        return 1
    except Exception as e:  # a compiler bug: one line, unless the user asked for the traceback
        if args.traceback:
            raise
        print(f"flowrl: internal error: {type(e).__name__}: {e} "
              "(rerun with --traceback and please report it)", file=_err())
        return 1


def _silence_stdout() -> None:
    # Python flushes stdout at exit; with the pipe closed that flush would raise again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
