"""Faults injected into real runs: is each one detected, named, survived, with nothing lost?

Every case runs the same small GRPO flow (a tiny random-init Llama built here, the arithmetic
task's prompts, the ``math`` verifier; 6 steps, a checkpoint every 2, samples logged every step)
on one fake 2-node Ray cluster (``ray.cluster_utils.Cluster``, 2 logical GPUs per node): the
trainer on node 0, vLLM on node 1, as a disaggregated plan places them. One undisturbed run is
the reference. Each case injects one fault into a run of its own, lets flowrl react as a user
would run it (``--restarts 1``, or ``--resume`` afterwards), and compares:

* detected: flowrl said what happened (the line it printed or raised, shortened in the table);
* state after: how the faulted command ended (restarted in the command, preempted, stopped);
* resumed: the run reached its last step (by the restart, or by ``flowrl run --resume``);
* identical: ``metrics.jsonl`` equals the undisturbed run's (times and the count of resent
  syncs aside);
* lost / duplicated: the (step, prompt, completion) rows of ``samples.jsonl`` missing from, or in
  excess of, the undisturbed run's (every sample is logged: 4 prompts x 2 completions per step).

Cases, one per fault of issue 14:

* ``kill -9`` mid-step of the vLLM actor, of the train actor, and of one rank actor of a trainer
  with a rank per GPU (its own flow, on a node of 2 GPUs that joins for the case);
* ``kill -9`` of the driver (a ``flowrl run`` process) after step 3, and during step 4's checkpoint
  write (its files written, its manifest not);
* SIGTERM (preemption); a generate that hangs (the watchdog, with deadlines shortened by
  ``FLOWRL_WATCHDOG``);
* a bit flipped in, or a file truncated of, the newest checkpoint; the disk full (ENOSPC) while a
  checkpoint is written;
* NaN in an update's inputs with ``on_nan = "stop"``;
* a weight bucket damaged; a weight file lost (its own flow: a ``checkpoint`` sync); the broadcast
  group broken by the rollout replica as step 4's sync starts, SIGKILLed (the sender finds the
  connection closed) or dropping out alive (its own flow: a ``broadcast`` sync from node 0 to 1);
* bad data rows (an empty prompt, a missing field, bytes that are not UTF-8, a line that is not
  JSON, a prompt longer than the context) read with ``bad_rows = "skip"``;
* ``kill -9`` of a reward worker and of an environment worker mid-call (their own flows: the reward
  in 2 ``python_reward`` worker processes; the stdlib agentic flow with a calculator), each
  SIGKILLed by the reward or environment itself at its first call after the bench arms it at step 3;
* the loss of the rollout engine's node (a new node joins, as an autoscaler would bring one,
  before the resume).

A case with a flow of its own compares with that flow's undisturbed run.

Usage::

    .venv/bin/python bench/chaos.py                # every case, ~20-25 min on 2 cores
    .venv/bin/python bench/chaos.py --only rollout-kill,node-lost
    .venv/bin/python bench/chaos.py --markdown     # the table as docs/runtime.md shows it
    .venv/bin/python bench/chaos.py --show --markdown   # run nothing: the table of the results file

Writes ``bench/results/chaos.json`` (``--out``). Exit status 1 if a case is not detected,
not resumed, not identical, or lost or duplicated a sample.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 6, 2
VOLATILE = ("time/", "perf/", "pipeline/", "env/latency", "sync/seconds", "sync/unpack_seconds", "sync/send_seconds",
            "sync/receive_seconds", "faults/sync_resent")

FLOW = """import stdlib.grpo

model policy = hf("{model}")
dataset arith = jsonl("{data}/train.jsonl", eval = "{data}/test.jsonl")
reward exact = verifier("math")

flow main(steps: int = {steps}, eval_every: int = 0) {{
  grpo(policy, arith, exact, batch = 4, group = 2, max_tokens = 6, lr = 3e-3, kl = 0.0, seed = 1)
}}

schedule main on cluster(nodes = 2, gpus_per_node = 1) {{
  pool train = gpus(gpus = 1, nodes = 1)
  pool gen = gpus(gpus = 1, nodes = 1)
  place policy.train on train
  place policy.rollout on gen
}}
"""


REWARDS = """import os
import signal
from pathlib import Path

from flowrl.rewards.verifiers import math_equivalence

HERE = Path(__file__).resolve().parent


def math(completions, answers):
    \"\"\"The math verifier; once armed (the file `armed`), the first call SIGKILLs its own process.\"\"\"
    if (HERE / "armed").exists() and not (HERE / "fired").exists():
        (HERE / "fired").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return math_equivalence(completions, answers)
"""

ENVS = """import os
import signal
from pathlib import Path

from flowrl.envs.calculator import Calculator

HERE = Path(__file__).resolve().parent


class Calc(Calculator):
    \"\"\"The calculator; once armed (the file `armed`), the first step SIGKILLs its worker process.\"\"\"

    def step(self, turn):
        if (HERE / "armed").exists() and not (HERE / "fired").exists():
            (HERE / "fired").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(turn)
"""

WORKER_FLOWS = {
    "reward": FLOW.replace('reward exact = verifier("math")',
                           'reward exact = python_reward("chaos_rewards:math", workers = 2)'),
    "env": FLOW.replace("import stdlib.grpo", "import stdlib.agentic").replace(
        'reward exact = verifier("math")',
        'env calc = python_env("chaos_envs:Calc", timeout = 60.0, workers = 1)\nreward exact = verifier("math")').replace(
        "grpo(policy, arith, exact, batch = 4, group = 2, max_tokens = 6,",
        "agentic(policy, arith, calc, exact, batch = 4, group = 2, max_turns = 2, max_tokens = 6,"),
}
WORKER_FLOWS["sync"] = FLOW.replace("  place policy.rollout on gen\n",
                                   "  place policy.rollout on gen\n  resync policy via checkpoint(dir = \"{shared}\")\n")
WORKER_FLOWS["ranks"] = FLOW.split("schedule main")[0] + """schedule main on cluster(nodes = 1, gpus_per_node = 2) {{
  policy.train = torch(dp = 2)
}}
"""
WORKER_FLOWS["broadcast"] = FLOW.replace("  place policy.rollout on gen\n",
                                        "  place policy.rollout on gen\n  resync policy via broadcast()\n")
"""The flows of the cases that run their own: the bench's flow with its reward in worker processes,
the agentic flow with a calculator environment, the bench's flow whose weights travel as files
in a directory both nodes see (``checkpoint``: the protocol that can lose a part; a broadcast's
bytes are either all delivered or the group breaks), the bench's flow whose weights are broadcast
over a gloo group from node 0 to node 1 (the protocol whose group can break), and the bench's flow on
one node of 2 GPUs whose trainer runs a rank actor per GPU (``torch(dp = 2)``, on fsdp's ranks)."""


@dataclass
class Row:
    fault: str
    detected: bool
    message: str
    state: str
    resumed: bool
    identical: bool
    lost: int
    duplicated: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.detected and self.resumed and self.identical and self.lost == 0 and self.duplicated == 0


class Bench:
    """The cluster, the work directory and the undisturbed reference run."""

    def __init__(self, work: Path):
        from ray.cluster_utils import Cluster

        from flowrl.models.tiny import build_tiny_model

        self.work = work
        # The fake cluster runs without Ray's token authentication, and says so for every process of the
        # bench: its runs, the `flowrl run` the driver-kill case starts, and the node the node-lost case adds.
        # (A run that finds a token, ~/.ray/auth_token left by any `ray start` here, would turn token mode on
        # as Ray's CLI does, and the process environment keeps it: a node added later then registers but
        # takes no work, and a client's actors die at start.)
        os.environ["RAY_AUTH_MODE"] = "disabled"
        build_tiny_model(work / "model", seed=0)
        self.flow = work / "chaos.flow"
        self.flow.write_text(FLOW.format(model=work / "model", data=ROOT / "data" / "arith", steps=STEPS))
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1,
                                                                    "include_dashboard": False})
        self.worker = self.cluster.add_node(num_cpus=2, num_gpus=1)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address
        import ray

        ray.init(address=self.address, log_to_driver=False, configure_logging=False)  # this process joins first
        self.reference: list[dict] = []
        self.reference_samples: Counter = Counter()
        self.own_references: dict = {}
        """The undisturbed run of each flow of :data:`WORKER_FLOWS` a case ran (:func:`_own_runs`)."""

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()

    def run(self, name: str, flow: Path | None = None, **kwargs):
        """``flowrl run`` of the flow (the bench's, or ``flow``) into ``work/name`` on the cluster; returns
        (result, what it printed)."""
        from flowrl.launch import run_file

        said = io.StringIO()
        kwargs.setdefault("save_every", SAVE_EVERY)
        result = run_file(str(flow or self.flow), out=str(self.work / name), ray_address=self.address, log_samples=1,
                          stream=said, **kwargs)
        return result, said.getvalue()

    def resume(self, name: str, **kwargs):
        from flowrl.launch import run_file

        said = io.StringIO()
        result = run_file(None, resume=str(self.work / name), ray_address=self.address, stream=said, **kwargs)
        return result, said.getvalue()

    def compare(self, name: str) -> tuple[bool, int, int]:
        """(identical metrics, samples lost, samples duplicated) of run ``name`` against the reference."""
        rows = _rows(self.work / name)
        samples = _samples(self.work / name)
        return (_stable(rows) == _stable(self.reference), sum((self.reference_samples - samples).values()),
                sum((samples - self.reference_samples).values()))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _samples(out: Path) -> Counter:
    path = out / "samples.jsonl"
    if not path.is_file():
        return Counter()
    return Counter((r["step"], r["prompt"], r["completion"])
                   for r in map(json.loads, path.read_text().splitlines()) if r["step"] >= 1)


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows if r["step"] >= 1]


def _line(text: str, start: str) -> str:
    """The first printed line starting with ``start`` ('' if none)."""
    return next((line for line in text.splitlines() if line.startswith(start)), "")


def _error_line(error: BaseException) -> str:
    from flowrl.runtime.errors import user_error

    return user_error(error) or f"{type(error).__name__}: {error}"


# ---- the cases ----------------------------------------------------------------------------------------

def engine_kill(engine: str) -> Callable[[Bench], Row]:
    def case(b: Bench) -> Row:
        from flowrl.runtime.fleet import Faults

        name = f"kill_{engine.replace('.', '_')}"
        result, said = b.run(name, restarts=1, faults=Faults(kill_at_step=3, kill_engine=engine))
        restart = _line(said, "flowrl: restart")
        return _row(b, f"kill -9 {engine} actor (step 4)", name, "died" in restart, restart,
                    "restarted in the command" if restart else "?", len(result.rows) == STEPS)
    return case


def rank_kill(b: Bench) -> Row:
    """``kill -9`` of rank 1's actor process of a trainer with rank actors (``torch(dp = 2)``, on a node of 2 GPUs
    that joins for this case) while it trains step 4: the engine stops its other rank and names the dead one,
    and ``--restarts 1`` starts the engines again from step 2's checkpoint."""
    from flowrl.runtime.fleet import Faults

    node = b.cluster.add_node(num_cpus=2, num_gpus=2)
    b.cluster.wait_for_nodes()
    try:
        reference, result, said = _own_runs(b, "ranks", Faults(kill_at_step=3, kill_engine="policy.train", kill_rank=1),
                                            restarts=1)
    finally:
        b.cluster.remove_node(node)
    restart = _line(said, "flowrl: restart")
    return _own_row(b, "kill -9 a policy.train rank (step 4, dp = 2)", reference, result,
                    "rank process died during train" in restart, restart,
                    "restarted in the command" if restart else "?", ())


def driver_kill(b: Bench) -> Row:
    """A real ``flowrl run`` process, SIGKILLed once step 3 is in metrics.jsonl; then ``--resume``."""
    name = "kill_driver"
    out = b.work / name
    cmd = [str(Path(sys.executable).parent / "flowrl"), "run", str(b.flow), "--out", str(out), "--save-every", str(SAVE_EVERY),
           "--log-samples", "1", "--ray", b.address]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and any(r["step"] >= 3 for r in _rows(out)):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = max((r["step"] for r in _rows(out)), default=0)
    result, said = b.resume(name)
    note = _line(said, "resumed from")
    return _row(b, f"kill -9 driver (after step {done})", name, bool(note), note, "killed: --resume",
                len(result.rows) == STEPS)


def sigterm(b: Bench) -> Row:
    from flowrl.runtime.fleet import Faults
    from flowrl.runtime.preemption import Preempted

    name = "sigterm"
    try:
        b.run(name, faults=Faults(sigterm_after_step=2))
        return _row(b, "SIGTERM (step 3)", name, False, "not stopped", "finished", False)
    except Preempted as stopped:
        message = str(stopped)
    result, _ = b.resume(name)
    return _row(b, "SIGTERM (step 3)", name, "preempted" in message, message, "preempted: --resume",
                len(result.rows) == STEPS)


def hang(b: Bench) -> Row:
    from flowrl.runtime.fleet import Faults
    from flowrl.runtime.watchdog import ENV_VAR

    name = "hang"
    os.environ[ENV_VAR] = "first=120,floor=10,factor=4"
    try:
        result, said = b.run(name, restarts=1, faults=Faults(hang_at_step=3))
    finally:
        del os.environ[ENV_VAR]
    restart = _line(said, "flowrl: restart")
    return _row(b, "generate hangs (step 4)", name, "did not finish" in restart, restart,
                "restarted in the command" if restart else "?", len(result.rows) == STEPS)


def damaged_sync(b: Bench) -> Row:
    from flowrl.runtime.fleet import Faults

    name = "damaged_sync"
    result, _ = b.run(name, faults=Faults(corrupt_bucket_at_step=2, corrupt_sends=1))
    resent = sum(r.get("faults/sync_resent", 0) for r in result.rows)
    return _row(b, "weight bucket damaged (step 3)", name, resent == 1, f"faults/sync_resent = {resent}",
                "resent, run went on", len(result.rows) == STEPS)


def lost_sync(b: Bench) -> Row:
    """The ``checkpoint`` flow's resync after step 3 loses a file on its first send: the replica finds
    it missing, loads nothing, and the driver sends the resync once more."""
    from flowrl.runtime.fleet import Faults

    reference, result, _ = _own_runs(b, "sync", Faults(lose_bucket_at_step=2))
    resent = sum(r.get("faults/sync_resent", 0) for r in result.rows)
    return _own_row(b, "weight file lost (step 3, checkpoint sync)", reference, result, resent == 1,
                    f"faults/sync_resent = {resent}", "resent, run went on", ("faults/sync_resent",))


def _flip_a_bit(victim: Path) -> None:
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))


def _truncate(victim: Path) -> None:
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)


DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "bitflip": ("bit flip in the newest checkpoint", _flip_a_bit, "crc"),
    "truncated": ("truncated file in the newest checkpoint", _truncate, "bytes"),
}
"""How a checkpoint case damages the largest file of the newest checkpoint: (the row's fault, the damage, a
word the refusal must hold)."""


def checkpoint_damage(how: str) -> Callable[[Bench], Row]:
    """The newest checkpoint of a run stopped after step 4 gets a flipped bit, or its largest file cut in half;
    --resume refuses it naming the file, and ``--resume-step`` continues from the one before."""
    fault, damage, word = DAMAGES[how]

    def case(b: Bench) -> Row:
        from flowrl.runtime.fleet import Faults

        name = how
        try:
            b.run(name, faults=Faults(stop_after_step=3))
        except SystemExit:
            pass
        ckpt = sorted((b.work / name / "checkpoints").glob("step_*"))[-1]
        damage(max((p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"),
                   key=lambda p: p.stat().st_size))
        try:
            b.resume(name)
            return _row(b, fault, name, False, "accepted", "resumed", True)
        except Exception as error:
            message = _error_line(error)
        result, _ = b.resume(name, resume_step=2)
        return _row(b, fault, name, word in message.lower() and "--resume-step 2" in message, message,
                    "refused: --resume-step 2", len(result.rows) == STEPS)
    return case


KILL_IN_CHECKPOINT = """import os
import signal
import sys

from flowrl.launch import run_file
from flowrl.runtime.fleet import Faults


def die(step, tmp):
    if step == 4:  # the checkpoint's files are written, its manifest is not
        os.kill(os.getpid(), signal.SIGKILL)


run_file(sys.argv[1], out=sys.argv[2], ray_address=sys.argv[3], save_every={save_every}, log_samples=1,
         faults=Faults(in_checkpoint=die))
"""
"""The ``flowrl run`` of :func:`checkpoint_kill`, in a process of its own: it SIGKILLs itself mid-checkpoint."""


def checkpoint_kill(b: Bench) -> Row:
    """A ``flowrl run`` process SIGKILLed while it writes step 4's checkpoint (its files written, its manifest
    not): step 2's checkpoint is intact, and ``--resume`` continues from it, ignoring the half-written one
    with a note."""
    name = "kill_in_checkpoint"
    script = b.work / "kill_in_checkpoint.py"
    script.write_text(KILL_IN_CHECKPOINT.format(save_every=SAVE_EVERY))
    proc = subprocess.run([sys.executable, str(script), str(b.flow), str(b.work / name), b.address], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, timeout=900)
    result, said = b.resume(name)
    note, resumed = _line(said, "note: ignoring"), _line(said, "resumed from")
    detected = proc.returncode == -signal.SIGKILL and "step_000004.tmp" in note and "step_000002" in resumed
    return _row(b, "kill -9 during a checkpoint write (step 4)", name, detected, f"{note} / {resumed}",
                "killed: --resume", len(result.rows) == STEPS)


def disk_full(b: Bench) -> Row:
    """ENOSPC while step 4's checkpoint is written: the run stops saying the disk is full, that step 2's
    checkpoint is intact and how to resume; ``--resume`` (the disk freed) continues from it."""
    import errno

    from flowrl.runtime.fleet import Faults

    def full(step: int, tmp: Path) -> None:
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "driver.json"))

    name = "disk_full"
    try:
        b.run(name, faults=Faults(in_checkpoint=full))
        return _row(b, "disk full during a checkpoint write (step 4)", name, False, "not stopped", "finished", False)
    except Exception as error:
        message = _error_line(error)
    result, _ = b.resume(name)
    return _row(b, "disk full during a checkpoint write (step 4)", name,
                "disk full" in message and "step_000002 is intact" in message, message, "stopped: --resume",
                len(result.rows) == STEPS)


def nan_loss(b: Bench) -> Row:
    """NaN in step 4's update inputs (as a diverged reward would put there), with ``on_nan = "stop"``: the run
    stops naming the op, the model and the step, the weights untouched; ``--resume`` continues from step 2."""
    from flowrl.runtime.fleet import Faults

    name = "nan"
    flow = b.work / "nan.flow"
    flow.write_text(b.flow.read_text().replace("seed = 1)", 'seed = 1, on_nan = "stop")'))
    try:
        b.run(name, flow=flow, faults=Faults(nan_at_step=3))
        return _row(b, "NaN in the loss (step 4, on_nan = stop)", name, False, "not stopped", "finished", False)
    except Exception as error:
        message = _error_line(error)
    result, _ = b.resume(name)
    return _row(b, "NaN in the loss (step 4, on_nan = stop)", name, "non-finite" in message and "step 4" in message,
                message, "stopped: --resume", len(result.rows) == STEPS)


BAD_ROWS = [b'{"prompt": "  ", "answer": "0"}', b'{"prompt": "3+3="}', b'{"prompt": "caf\xe9=", "answer": "1"}',
            b'{"prompt": "4+4=", "answer": ', b'{"prompt": "' + b"9" * 300 + b'=", "answer": "9"}']
"""An empty prompt, a missing answer, bytes that are not UTF-8, a line that is not JSON, a prompt longer than
the tiny model's context."""


def bad_rows(b: Bench) -> Row:
    """The training data with :data:`BAD_ROWS` among its rows, read with ``bad_rows = "skip"``: each is left
    out, named in events.log and counted, and the run equals the undisturbed one on the clean data."""
    folder = b.work / "messy"
    folder.mkdir(exist_ok=True)
    good = (ROOT / "data" / "arith" / "train.jsonl").read_bytes().splitlines()
    lines = good[:3] + BAD_ROWS[:3] + good[3:10] + BAD_ROWS[3:] + good[10:]
    (folder / "train.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    flow = folder / "chaos.flow"
    flow.write_text(b.flow.read_text().replace(f'jsonl("{ROOT / "data" / "arith"}/train.jsonl", ',
                                               f'jsonl("{folder}/train.jsonl", bad_rows = "skip", '))
    name = "messy/run"
    result, said = b.run(name, flow=flow)
    warning = _line(said, "warning: dataset")
    skipped = {r.get("data/rows_skipped") for r in result.rows}
    counts = ("data/rows_skipped",)
    identical = ([{k: v for k, v in r.items() if k not in counts} for r in _stable(_rows(result.out))]
                 == _stable(b.reference))
    samples = _samples(result.out)
    return Row("bad data rows: 5 of 5 kinds (skip)", "skipped 5 bad row(s)" in warning and skipped == {5},
               warning.removeprefix("warning: "), "skipped, run went on", len(result.rows) == STEPS, identical,
               sum((b.reference_samples - samples).values()), sum((samples - b.reference_samples).values()), 0.0)


def node_lost(b: Bench) -> Row:
    """The rollout engine's node goes at step 4 (its raylet killed); the run stops naming it. A new node
    joins (as an autoscaler brings one) and ``--resume`` continues on it."""
    from flowrl.runtime.fleet import Faults

    name = "node_lost"
    out = b.work / name

    def lose_node(step: int) -> None:  # the driver's producer thread: removing a node works there, adding does not
        if step == 3:
            import ray

            used = {r["node_id"] for r in json.loads((out / "placement.json").read_text())}
            victim = next(n for n in b.cluster.list_all_nodes() if n is not b.cluster.head_node and n.node_id in used)
            b.cluster.remove_node(victim, allow_graceful=False)
            # Back to the driver once Ray has declared the node dead: step 4's generate, held in flight
            # (hang_at_step), cannot finish first, and the resume does not see the dead node as alive.
            deadline = time.monotonic() + 120
            while any(n["NodeID"] == victim.node_id and n["Alive"] for n in ray.nodes()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Ray did not declare node {victim.node_id} dead within 120 s")
                time.sleep(0.5)

    try:
        b.run(name, faults=Faults(at_generate=lose_node, hang_at_step=3))
        return _row(b, "node of the rollout engine lost (step 4)", name, False, "not stopped", "finished", True)
    except Exception as error:
        message = _error_line(error)
    b.worker = b.cluster.add_node(num_cpus=2, num_gpus=1)
    b.cluster.wait_for_nodes()
    result, _ = b.resume(name)
    return _row(b, "node of the rollout engine lost (step 4)", name, "node has died" in message, message,
                "stopped: --resume on a new node", len(result.rows) == STEPS)


def worker_kill(kind: str) -> Callable[[Bench], Row]:
    """``kill -9`` of a reward or environment worker mid-call, in a flow of its own: the run goes on
    (the pool replaces the worker and scores or replays what it held) and must equal the same flow's
    undisturbed run."""
    def case(b: Bench) -> Row:
        from flowrl.runtime.fleet import Faults

        folder = b.work / kind

        def arm(step: int) -> None:
            if step == 3:
                (folder / "armed").touch()

        reference, result, said = _own_runs(b, kind, Faults(at_generate=arm))
        metric = "reward/recovered" if kind == "reward" else "env/recovered"
        warning = next((line for line in said.splitlines() if "died" in line), "")
        recovered = sum(r.get(metric, 0) for r in result.rows)
        return _own_row(b, f"kill -9 a{'n environment' if kind == 'env' else ' reward'} worker (step 3-4)",
                        reference, result, (folder / "fired").exists() and recovered > 0 and bool(warning),
                        warning.removeprefix("warning: "), "went on (worker replaced)", (metric,))
    return case


def _own_runs(b: Bench, kind: str, faults, name: str = "faulted", **kwargs) -> tuple:
    """The undisturbed run (once per kind) and the faulted run ``name`` of ``WORKER_FLOWS[kind]``, written
    with the case's reward and environment modules into ``work/kind``; ``kwargs`` go to the faulted run
    (``restarts``): (reference result, faulted result, what it printed)."""
    folder = b.work / kind
    flow = folder / "chaos.flow"
    if kind not in b.own_references:
        folder.mkdir(exist_ok=True)
        (folder / "chaos_rewards.py").write_text(REWARDS)
        (folder / "chaos_envs.py").write_text(ENVS)
        flow.write_text(WORKER_FLOWS[kind].format(model=b.work / "model", data=ROOT / "data" / "arith",
                                                  steps=STEPS, shared=folder / "shared"))
        b.own_references[kind], _ = b.run(f"{kind}/reference", flow=flow)
    result, said = b.run(f"{kind}/{name}", flow=flow, faults=faults, **kwargs)
    return b.own_references[kind], result, said


def broken_broadcast(breaks: str) -> Callable[[Bench], Row]:
    """The rollout replica breaks step 4's broadcast as it starts, in the broadcast flow: ``kill`` SIGKILLs
    its process (the sender finds the connection closed; the replica is named dead), ``close`` shuts its
    end of the group down, the actor alive (the sync broke with every end alive). ``--restarts 1`` sets up
    new engines and a new group from step 2's checkpoint."""
    def case(b: Bench) -> Row:
        from flowrl.runtime.fleet import Faults

        reference, result, said = _own_runs(b, "broadcast", Faults(break_sync_at_step=3, break_sync_by=breaks),
                                            name=f"broken_{breaks}", restarts=1)
        restart = _line(said, "flowrl: restart")
        what = "died during `sync_receive`" if breaks == "kill" else "broke at step 4, every end alive"
        fault = ("kill -9 policy.rollout mid-broadcast (step 4)" if breaks == "kill"
                 else "broadcast group broken, ends alive (step 4)")
        return _own_row(b, fault, reference, result, what in restart, restart,
                        "restarted in the command" if restart else "?", ())
    return case


def _own_row(b: Bench, fault: str, reference, result, detected: bool, message: str, state: str,
             counts: tuple[str, ...]) -> Row:
    """A row of a case that ran its own flow: compared with that flow's undisturbed run (``counts``: the
    metrics that count the fault, which only the faulted run has)."""
    def stable(out) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in counts} for r in _stable(_rows(out))]

    ref_samples, samples = _samples(reference.out), _samples(result.out)
    return Row(fault, detected, message, state, len(result.rows) == STEPS, stable(result.out) == stable(reference.out),
               sum((ref_samples - samples).values()), sum((samples - ref_samples).values()), 0.0)


def _row(b: Bench, fault: str, name: str, detected: bool, message: str, state: str, resumed: bool) -> Row:
    identical, lost, duplicated = b.compare(name)
    return Row(fault, detected, message, state, resumed, identical, lost, duplicated, 0.0)


CASES: dict[str, Callable[[Bench], Row]] = {
    "rollout-kill": engine_kill("policy.rollout"),
    "train-kill": engine_kill("policy.train"),
    "train-rank-kill": rank_kill,
    "driver-kill": driver_kill,
    "sigterm": sigterm,
    "hang": hang,
    "damaged-sync": damaged_sync,
    "lost-sync": lost_sync,
    "checkpoint-bitflip": checkpoint_damage("bitflip"),
    "checkpoint-truncated": checkpoint_damage("truncated"),
    "checkpoint-kill": checkpoint_kill,
    "disk-full": disk_full,
    "nan": nan_loss,
    "bad-rows": bad_rows,
    "node-lost": node_lost,
    "reward-worker-kill": worker_kill("reward"),
    "env-worker-kill": worker_kill("env"),
    "broadcast-replica-kill": broken_broadcast("kill"),
    "broadcast-broken": broken_broadcast("close"),
}


def table(rows: list[Row], markdown: bool = False, width: int = 90) -> str:
    """The rows as a text table, or as markdown (the message in the detected column, cut at ``width``)."""
    if markdown:
        head = ["fault", "detected", "state after", "resumed", "identical", "lost", "duplicated", "s"]
        body = [[r.fault, ("yes" if r.detected else "NO") + f": `` {_cut(r.message, width)} ``", r.state,
                 "yes" if r.resumed else "NO", "yes" if r.identical else "NO", str(r.lost), str(r.duplicated),
                 f"{r.seconds:.0f}"] for r in rows]
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in body])
    head = ["fault", "detected", "message", "state after", "resumed", "identical", "lost", "duplicated", "s"]
    body = [[r.fault, "yes" if r.detected else "NO", r.message[:width],
             r.state, "yes" if r.resumed else "NO", "yes" if r.identical else "NO", str(r.lost), str(r.duplicated),
             f"{r.seconds:.0f}"] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *body])


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width].rstrip() + " ..."


def merged(out: Path, run: dict, rows: list[Row]) -> dict:
    """``out``'s results with this run's: its rows replace the earlier rows of the same faults (an ``--only``
    run keeps the other cases' rows), and ``runs`` lists every run whose rows are kept."""
    try:
        earlier = json.loads(out.read_text())
    except (OSError, ValueError):
        earlier = {}
    faults = {r.fault for r in rows}
    kept = [r for r in earlier.get("rows", []) if r.get("fault") not in faults]
    runs = [r for r in earlier.get("runs", []) if any(k.get("when") == r.get("when") for k in kept)]
    return {"runs": runs + [run], "steps": STEPS, "save_every": SAVE_EVERY,
            "rows": kept + [{**asdict(r), "ok": r.ok, "when": run["when"]} for r in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated cases (default: all): {', '.join(CASES)}")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--work", default="", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--show", action="store_true", help="run nothing: print the table of --out's rows")
    args = parser.parse_args(argv)
    if args.show:
        kept = json.loads(Path(args.out).read_text())["rows"]
        fields = set(Row.__dataclass_fields__)
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in kept]
        print(table(rows, markdown=args.markdown))
        return 0 if all(r.ok for r in rows) else 1
    chosen = [c for c in filter(None, args.only.split(","))] or list(CASES)
    unknown = set(chosen) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {list(CASES)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="flowrl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(work)
    rows: list[Row] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "steps": STEPS, "save_every": SAVE_EVERY}
    try:
        t0 = time.time()
        bench.run("reference")
        bench.reference = _rows(work / "reference")
        bench.reference_samples = _samples(work / "reference")
        print(f"[chaos] undisturbed reference: {len(_stable(bench.reference))} steps in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)
        for name in chosen:
            print(f"[chaos] {name} ...", file=sys.stderr, flush=True)
            t0 = time.time()
            try:
                row = CASES[name](bench)
            except Exception as error:  # a case that crashes is a row that failed, not the end of the table
                row = Row(name, False, _error_line(error)[:300], "crashed", False, False, -1, -1, 0.0)
            row.seconds = time.time() - t0
            row.message = row.message.replace(str(work), "RUN_DIRS")  # the same in every run's table
            run["load_1m"] = os.getloadavg()[0]
            rows.append(row)
            print(table(rows[-1:]), file=sys.stderr, flush=True)
            out.write_text(json.dumps(merged(out, run, rows), indent=1))
    finally:
        bench.close()
    print(table(rows, markdown=args.markdown))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
