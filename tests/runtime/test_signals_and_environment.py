"""`flowrl run` as a user's terminal, `timeout`, Slurm or Kubernetes meet it: a real run started as a
subprocess in a process group of its own (the torch rollout engine: no vLLM start-up), with fake
secrets in its environment.

* No process the run starts holds a secret: every descendant of the flowrl process and every process
  of its Ray session (reparented ones too) is read from ``/proc/PID/environ`` while the run goes on.
* Ray's processes run in a session of their own, so a signal to flowrl's process group reaches
  flowrl alone; one signal (SIGINT to flowrl, SIGTERM to the group, SIGINT to the group): the step in
  flight finishes, a checkpoint is written without ``--save-every``, summary.json, curves.png and
  trace.json are written, the resume command is printed, exit status 0, and ``--resume`` continues;
  two signals: the run stops at once, non-zero, without a traceback. Nothing of the run's Ray session
  outlives it.

No wall-clock time is asserted: the timeouts are only deadlines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from e2e_kit import RUNTIME_DIR, make_workdir, write_flow  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BODY = """b = sample(prompts, size = 4)
  x = generate(policy, b, n = 2, max_tokens = 6)
  update(policy, x, group_advantage(sevens(x), group = 2), logprobs(policy, x), lr = 3e-3)"""

SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
}
"""

STEPS = 40
"""More steps than a run lives through here: each is stopped by a signal after its first step."""

SECRETS = {
    "HF_TOKEN": "hf_fakeTokenValue0123456789",
    "WANDB_API_KEY": "wandbfakekey0123456789abcdef",
    "MY_SERVICE_PASSWORD": "correct-horse-battery-staple",
    "AWS_SECRET_ACCESS_KEY": "awsFakeSecretAccessKey0123456789",
    "OPENAI_API_KEY": "sk-fake0123456789abcdef",
    "GITHUB_TOKEN": "ghp_fake0123456789abcdef",
    "DATABASE_URL": "postgres://admin:hunter2hunter2@db.internal/prod",  # a secret no name gives away
}

DEADLINE_S = 600


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = make_workdir(tmp_path_factory.mktemp("signals"))
    write_flow(work / "sig.flow", BODY, steps=STEPS, schedule=SCHEDULE, imports=())
    return work


class Run:
    """``flowrl run`` in a new process group (its own leader: the group id is its pid), output to a file."""

    def __init__(self, workdir: Path, *args: str):
        self.log = workdir / f"run-{time.monotonic_ns()}.log"
        env = {**os.environ, **SECRETS,
               "PYTHONPATH": os.pathsep.join([str(RUNTIME_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "run", *args], cwd=workdir, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_step(self, out: Path, step: int) -> None:
        """Until ``metrics.jsonl`` has step ``step``'s row (the run's failure or the deadline: the test fails)."""
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the run ended early (rc {self.proc.returncode}):\n{self.output}"
            path = out / "metrics.jsonl"
            if path.is_file() and any(json.loads(line)["step"] >= step
                                      for line in path.read_text().splitlines() if line.strip()):
                return
            time.sleep(0.2)
        pytest.fail(f"no step {step} before the deadline:\n{self.output}")

    def wait(self) -> int:
        try:
            return self.proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"the run did not stop:\n{self.output}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()


# ---- /proc ------------------------------------------------------------------------------------

def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                out[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> set[int]:
    parents = _parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


SESSION = re.compile(rb"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")


def ray_session_of(pids: set[int]) -> bytes | None:
    """The name of the Ray session (``session_<date>_<time>_<pid>``) these processes' command lines name."""
    for pid in pids:
        found = SESSION.search(_read(f"/proc/{pid}/cmdline"))
        if found:
            return found.group(0)
    return None


def session_processes(session: bytes) -> set[int]:
    """Every process whose command line or environment names the Ray session ``session``."""
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()
            and (session in _read(f"/proc/{e}/cmdline") or session in _read(f"/proc/{e}/environ"))}


def wait_gone(pids: set[int]) -> set[int]:
    """``pids`` still running at the deadline."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = {p for p in pids if os.path.exists(f"/proc/{p}") and b"zombie" not in _read(f"/proc/{p}/status")
                and b"\tZ" not in _read(f"/proc/{p}/status")}
        if not pids:
            return pids
        time.sleep(0.2)
    return pids


# ---- what every cleanly stopped run leaves ------------------------------------------------------

def assert_stopped_cleanly(run: Run, rc: int, out: Path, signal_name: str) -> int:
    """rc 0, the resume command printed, a checkpoint of a finished step, summary.json, curves.png,
    trace.json; returns the step checkpointed."""
    output = run.output
    assert rc == 0, output
    assert "Traceback" not in output, output
    assert f"preempted ({signal_name})" in output and f"flowrl run --resume {out}" in output, output
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts, output
    step = int(ckpts[-1].split("_")[1])
    assert step >= 1 and (out / "checkpoints" / ckpts[-1] / "manifest.json").is_file()
    for name in ("summary.json", "curves.png", "trace.json"):
        assert (out / name).is_file(), (name, output)
    assert json.loads((out / "summary.json").read_text())["steps_done"] == step
    return step


def resumed(run: Run, out: Path, after: int) -> None:
    """``run`` (``--resume out``) continued from step ``after``'s checkpoint: wait for its first new step."""
    run.wait_for_step(out, after + 1)
    assert f"after step {after}" in run.output, run.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(set(steps)) == steps and after + 1 in steps, steps


def first_signal_seen(run: Run, name: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while f"{name}: finishing the step" not in run.output:
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output
        time.sleep(0.05)


# ---- the test: one run, stopped and resumed three times, then stopped twice ----------------------

def test_no_process_of_a_run_holds_a_secret_and_every_stop_signal_stops_it_cleanly(workdir):
    """Each start of a run costs tens of seconds on 2 cores: one run directory goes through every case."""
    out = workdir / "run"
    sessions = []
    # 1. A fresh run without --save-every: every process it started is read; Ctrl-C in its terminal
    #    (SIGINT to the whole group) stops it with a checkpoint.
    run = Run(workdir, "sig.flow", "--out", str(out))
    try:
        run.wait_for_step(out, 1)
        ours = descendants(run.pid)
        session = ray_session_of(ours)
        assert session is not None, "no process of the run names its Ray session"
        sessions.append(session)
        everyone = ours | session_processes(session)
        leaks = {}
        for pid in everyone:
            environ = _read(f"/proc/{pid}/environ")
            leaked = [name for name, value in SECRETS.items() if value.encode() in environ]
            if leaked:
                leaks[pid] = (_read(f"/proc/{pid}/cmdline").replace(b"\0", b" ")[:120], leaked)
        assert not leaks, leaks
        assert SECRETS["HF_TOKEN"].encode() in _read(f"/proc/{run.pid}/environ")  # the reading works: flowrl has it
        cmdlines = {p: _read(f"/proc/{p}/cmdline")[:300] for p in everyone}
        ray_own = {p for p, c in cmdlines.items() if b"raylet" in c or b"gcs_server" in c}
        assert len(ray_own) >= 2 and any(b"ray::" in c or b"default_worker" in c for c in cmdlines.values()), cmdlines
        assert all(os.getsid(p) != os.getsid(run.pid) for p in ray_own)  # Ray: a session of its own

        os.killpg(run.pid, signal.SIGINT)
        step = assert_stopped_cleanly(run, run.wait(), out, "SIGINT")
    finally:
        run.kill()

    # 2. --resume continues; SIGTERM to the whole group (`timeout`, Slurm, Kubernetes) stops it cleanly.
    run = Run(workdir, "--resume", str(out))
    try:
        resumed(run, out, step)
        sessions.append(ray_session_of(descendants(run.pid)))
        os.killpg(run.pid, signal.SIGTERM)
        step = assert_stopped_cleanly(run, run.wait(), out, "SIGTERM")
    finally:
        run.kill()

    # 3. --resume continues; SIGINT to flowrl alone stops it cleanly.
    run = Run(workdir, "--resume", str(out))
    try:
        resumed(run, out, step)
        sessions.append(ray_session_of(descendants(run.pid)))
        os.kill(run.pid, signal.SIGINT)
        step = assert_stopped_cleanly(run, run.wait(), out, "SIGINT")
    finally:
        run.kill()

    # 4. --resume continues; a second signal (either) stops it at once: non-zero, no traceback.
    run = Run(workdir, "--resume", str(out))
    try:
        resumed(run, out, step)
        sessions.append(ray_session_of(descendants(run.pid)))
        os.killpg(run.pid, signal.SIGINT)
        first_signal_seen(run, "SIGINT")
        os.killpg(run.pid, signal.SIGTERM)
        rc = run.wait()
    finally:
        run.kill()
    assert rc != 0 and "interrupted" in run.output and "Traceback" not in run.output, run.output

    # Nothing of any of the four Ray sessions outlives its run (flowrl stopped them, by process id).
    assert None not in sessions and len(set(sessions)) == 4
    for session in sessions:
        assert not wait_gone(session_processes(session)), session
