"""Docs that run: every `flowrl ...` command of README.md, docs/*.md, the `--help` examples and
the "Run:" lines of each flows/*.flow header comment runs against the shipped files.

Commands come from fenced code blocks (and inline code spans that name a file), or from a flow
file's leading `#` comment lines, with their trailing `# comments` removed; synopsis lines
(`FILE`, `[--flag]`, `...`) are not commands.
Each source runs in a fresh work directory holding copies of `flows/`, `stdlib/` and `data/`,
in the order the source shows them, so that a command can read what an earlier one wrote
(`--out runs/a`, then `--resume runs/a`), and the shipped files are never rewritten (`fmt -w`).

`flowrl run` commands train few steps (`--steps 1`; 3 where a later command reads the run,
e.g. `profile --calibrate` needs steps after the warm-up one). To stay within CI's budget they
are grouped: one real run per distinct flow file (the one whose run directory a later command
reads, else the first); the other runs of that flow go through everything `flowrl run` checks
before engines start (compile, `--set`, run directories, resume rules, trackers installed) with
the driver's run loop replaced by one that writes what a run leaves behind (every run of a flow
header's commands does: tests/docs/test_shipped_flows.py trains each shipped flow). The warm-start
cache is shared (the user's, as `make run` uses it). Commands that need something this machine
lacks are listed in :data:`NEEDS` with the test that covers them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLOW_SOURCES = sorted((ROOT / "flows").glob("*.flow"))
"""Shipped flows whose header comment (the leading ``#`` lines) shows commands under ``Run:``."""

PREFIX = re.compile(r"^(?:(?:[A-Z_][A-Z0-9_]*=\S+)\s+)*(?:\.venv/bin/)?flowrl\s+[a-z]")
"""A command line: optional environment assignments, then `flowrl SUBCOMMAND` (or `.venv/bin/flowrl`)."""
PIPED = re.compile(r"^cat\s+\S+\s*\|\s*flowrl\s")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9](\.\w+)?$|\[|\]|\.\.\.|^<.*>$")
"""A synopsis token: `FILE`, `OUT.png`, `RUN_DIR`, `FILE...`, `[--flag]`, `<name>`."""

NEEDS = {
    "RAY_ADDRESS=": "a running Ray cluster (tests/cli/test_ray_cluster.py starts one and runs a flow on it)",
    "MLFLOW_TRACKING_URI=http": "an MLflow tracking server (tests/runtime/test_trackers_mlflow_server.py starts one)",
    "--log-uri http": "an MLflow tracking server (tests/runtime/test_trackers_mlflow_server.py starts one)",
    "WANDB_API_KEY=": "a W&B account (tests/runtime/test_trackers_online.py runs against a local stand-in server)",
}
"""Text in a command -> what it needs that a docs test cannot give it, and which test covers it."""


@dataclass(frozen=True)
class DocCommand:
    source: str
    """``README.md:57`` or ``flowrl run --help``."""
    text: str

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.text)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        return words[1:]  # after `flowrl`

    @property
    def shell(self) -> bool:
        """Pipes, redirections, globs or a leading `cat`: run by bash."""
        return bool(re.search(r"[|<>*?]", self.text)) or self.text.startswith("cat ")

    def __str__(self) -> str:
        return f"{self.source}: {self.text}"


def strip_comment(line: str) -> str:
    return re.split(r"\s{2,}#|^\s*#", line, maxsplit=1)[0].strip()


def is_command(line: str) -> bool:
    if not (PREFIX.match(line) or PIPED.match(line)):
        return False
    words = [w for w in line.split() if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # `RAY_ADDRESS=...` is fine
    return not any(PLACEHOLDER.search(w.strip(",;")) for w in words)


def doc_commands() -> dict[str, list[DocCommand]]:
    """Source file (or ``--help``) -> its commands, in order."""
    from flowrl.cli import COMMANDS

    found: dict[str, list[DocCommand]] = {}
    for md in SOURCES:
        rel = md.relative_to(ROOT).as_posix()
        block = False
        for number, line in enumerate(md.read_text().splitlines(), start=1):
            if line.lstrip().startswith("```"):
                block = not block
                continue
            texts = [strip_comment(line)] if block else \
                [span for span in re.findall(r"`([^`]+)`", line) if "/" in span or ".flow" in span]
            for text in texts:
                text = text.replace(".venv/bin/flowrl", "flowrl")
                if is_command(text):
                    found.setdefault(rel, []).append(DocCommand(f"{rel}:{number}", text))
    for flow in FLOW_SOURCES:
        rel = flow.relative_to(ROOT).as_posix()
        for number, line in enumerate(flow.read_text().splitlines(), start=1):
            if not line.startswith("#"):
                break  # the header comment ends at the first line of code (or blank line)
            text = strip_comment(line[1:])
            if is_command(text):
                found.setdefault(rel, []).append(DocCommand(f"{rel}:{number}", text))
    # `run`'s examples first: `plan --measured` and `profile --calibrate` read the runs they write.
    for cmd in sorted(COMMANDS.values(), key=lambda c: c.name != "run"):
        for line in cmd.examples.splitlines():
            text = strip_comment(line)
            if is_command(text):
                found.setdefault("--help", []).append(DocCommand(f"flowrl {cmd.name} --help", text))
    return found


def test_the_extractor_finds_the_commands_and_skips_synopses():
    found = doc_commands()
    every = [c.text for cmds in found.values() for c in cmds]
    assert "flowrl check flows/arith_grpo.flow" in every
    # every shipped flow's header says how to check and run it
    for flow in FLOW_SOURCE_NAMES:
        argvs = [c.argv for c in found.get(flow, [])]
        assert ["check", flow] in argvs and any(a[:2] == ["run", flow] for a in argvs), (flow, argvs)
    assert any(c.text == "flowrl run flows/family_gpt2.flow --steps 4" for c in found["flows/family_gpt2.flow"])
    assert "flowrl graph flows/arith_grpo.flow -o g.svg" in every  # README, `.venv/bin/` dropped
    assert not any("FILE" in t or "[" in t for t in every)
    assert {"README.md", "docs/cli.md", "--help"} <= set(found)
    assert all(c.text != "flowrl profile" or c.source for c in found["docs/cli.md"])


def test_every_documented_file_exists():
    """Every `.flow` file a command names is shipped (`flows/grpo.flow` once was not)."""
    missing = []
    for cmds in doc_commands().values():
        for c in cmds:
            for word in shlex.split(c.text):
                if word.endswith(".flow") and not list(ROOT.glob(word)):
                    missing.append(f"{c}: {word}")
    assert not missing, "\n".join(missing)


# ---- running them ---------------------------------------------------------------------------


def flow_of(cmd: DocCommand, workdir: Path) -> str | None:
    """The flow file a `run` command runs (a resumed run's comes from its plan.json)."""
    argv = cmd.argv
    if "--resume" in argv:
        plan = workdir / argv[argv.index("--resume") + 1] / "plan.json"
        return json.loads(plan.read_text())["source"] if plan.is_file() else None
    files = [w for w in argv if w.endswith(".flow")]
    return str((workdir / files[0]).resolve()) if files else None


def read_later(cmds: list[DocCommand], index: int) -> bool:
    """Whether a later non-run command reads the run directory this `run` command writes."""
    argv = cmds[index].argv
    if "--out" not in argv:
        return False
    out = argv[argv.index("--out") + 1]
    return any(c.argv and c.argv[0] != "run" and out in c.argv for c in cmds[index + 1:])


def with_steps(argv: list[str], steps: int) -> list[str]:
    argv = list(argv)
    if "--steps" in argv:
        argv[argv.index("--steps") + 1] = str(steps)
    else:
        argv += ["--steps", str(steps)]
    if "--save-every" in argv:  # a checkpoint within the steps that run, for a later --resume
        argv[argv.index("--save-every") + 1] = "1"
    return argv


def fake_run_plan(plan, out, *, resume=False, **_):
    """What the driver's run loop leaves behind, without engines: plan, summary, checkpoints."""
    from types import SimpleNamespace

    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out / "plan.json").write_text(plan.to_json())
    for step in range(1, plan.run.steps + 1):
        if plan.run.save_every and step % plan.run.save_every == 0:
            from flowrl.runtime.checkpoints import write_checkpoint

            write_checkpoint(out / "checkpoints" / f"step_{step:06d}", lambda tmp: None)  # with its manifest
    (out / "summary.json").write_text(json.dumps({"steps_done": plan.run.steps}))
    return SimpleNamespace(out=out, steps=plan.run.steps, accuracy_before=None, accuracy_after=None, rows=[])


def workdir_for(tmp: Path) -> Path:
    for name in ("flows", "stdlib", "data"):
        shutil.copytree(ROOT / name, tmp / name)
    return tmp


def run_in_process(argv: list[str]) -> tuple[int, str]:
    """``flowrl ARGV`` in this process (the CLI writes to sys.stdout/sys.stderr as they are at call time)."""
    import contextlib
    import io

    from flowrl.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue()[-3000:] + out.getvalue()[-1000:]


def run_shell(text: str, workdir: Path) -> tuple[int, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=600)
    return proc.returncode, proc.stderr[-3000:] + proc.stdout[-1000:]


def is_fresh_run(c: DocCommand) -> bool:
    return bool(c.argv) and c.argv[0] == "run" and "--resume" not in c.argv and not any(k in c.text for k in NEEDS)


def real_runs(cmds: list[DocCommand], workdir: Path) -> set[int]:
    """Indices of the fresh runs that train for real: every run a later command reads, and the
    first run of each other flow file."""
    fresh = [i for i, c in enumerate(cmds) if is_fresh_run(c)]
    real = {i for i in fresh if read_later(cmds, i)}
    covered = {flow_of(cmds[i], workdir) for i in real}
    for i in fresh:
        flow = flow_of(cmds[i], workdir)
        if flow not in covered:
            real.add(i)
            covered.add(flow)
    return real


def needs_graphviz(c: DocCommand) -> bool:
    return bool(c.argv) and c.argv[0] == "graph" and bool(re.search(r"\.(svg|png)\b|--format (svg|png)|\|\s*dot\b", c.text))


LONG_SOURCES = ("--help", "docs/cli.md", "README.md", "docs/language.md")
"""Sources whose real runs take 1.5-7 minutes each on 2 cores: marked ``long`` (``make test-long``),
outside ``make test``'s budget until their runs are shared; the other sources run in ``make test``."""

FLOW_SOURCE_NAMES = {f.relative_to(ROOT).as_posix() for f in FLOW_SOURCES}
"""The shipped flows' headers: marked ``long``. Their `flowrl run` commands go through everything
`run` checks before engines start, never for real: tests/docs/test_shipped_flows.py trains each
shipped flow for one step (or asserts why this machine refuses it)."""


def _source_param(source: str):
    long = source in LONG_SOURCES or source in FLOW_SOURCE_NAMES
    return pytest.param(source, marks=pytest.mark.long) if long else source


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("source", [_source_param(s) for s in sorted(doc_commands())])
def test_documented_commands_run(source, tmp_path, monkeypatch):
    import flowrl.launch as launch

    real_run_plan = launch.run_plan
    monkeypatch.setenv("FLOWRL_PROFILE", str(tmp_path / "profile.json"))  # never the user's profile
    workdir = workdir_for(tmp_path / "work")
    monkeypatch.chdir(workdir)
    cmds = doc_commands()[source]
    real, real_dirs = (set() if source in FLOW_SOURCE_NAMES else real_runs(cmds, workdir)), set()
    failures, skipped = [], []
    for i, c in enumerate(cmds):
        if any(key in c.text for key in NEEDS) or (needs_graphviz(c) and shutil.which("dot") is None):
            skipped.append(str(c))
            continue
        argv = c.argv
        if argv[0] == "run":
            out = argv[argv.index("--out") + 1] if "--out" in argv else None
            if "--resume" in argv:  # with --steps: one step past where the run it continues stopped
                out = argv[argv.index("--resume") + 1]
                summary = workdir / out / "summary.json"
                done = json.loads(summary.read_text())["steps_done"] if summary.is_file() else 0
                argv, for_real = with_steps(argv, done + 1) if "--steps" in argv else argv, out in real_dirs
            else:
                argv, for_real = with_steps(argv, 3 if read_later(cmds, i) else 1), i in real
            if for_real and out is not None:
                real_dirs.add(out)
            monkeypatch.setattr(launch, "run_plan", real_run_plan if for_real else fake_run_plan)
            code, output = run_in_process(argv)
        elif c.shell or argv[0] == "profile":  # profile's all-reduce starts processes: its own interpreter
            code, output = run_shell(c.text, workdir)
        else:
            code, output = run_in_process(argv)
        if code != 0:
            failures.append(f"{c}\n  exit {code}: {output.strip()[-1500:]}")
    assert not failures, "\n\n".join(failures)
    if skipped and all(any(key in s for key in NEEDS) for s in skipped):
        return
    if skipped:
        pytest.skip("Graphviz `dot` is not installed (`make test` installs it): " + "; ".join(skipped))
