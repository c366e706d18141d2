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

Cases: ``kill -9`` of the vLLM actor and of the train actor mid-step, ``kill -9`` of the driver
(a ``flowrl run`` process) after step 3, SIGTERM (preemption), a generate that hangs (the
watchdog, with deadlines shortened by ``FLOWRL_WATCHDOG``), a damaged weight sync, one with a
bucket lost, a bit flipped
in the newest checkpoint, and the loss of the rollout engine's node (a new node joins, as an
autoscaler would bring one, before the restart). Two more run flows of their own, each against
its own undisturbed run: ``kill -9`` of a reward worker mid-call (the flow's reward is a
``python_reward`` in 2 worker processes) and of an environment worker mid-call (the stdlib
agentic flow with the calculator); each worker is SIGKILLed, as the OOM killer or an operator
would, by the reward or environment itself at the first call after the bench arms it at step 3.

Usage::

    .venv/bin/python bench/chaos.py                # every case, ~10-15 min on 2 cores
    .venv/bin/python bench/chaos.py --only rollout-kill,node-lost
    .venv/bin/python bench/chaos.py --markdown     # the table as docs/runtime.md shows it

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
"""The flows of the cases that run their own: the bench's flow with its reward in worker processes,
the agentic flow with a calculator environment, and the bench's flow whose weights travel as files
in a directory both nodes see (``checkpoint``: the protocol that can lose a part; a broadcast's
bytes are either all delivered or the group breaks)."""


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


def checkpoint_bitflip(b: Bench) -> Row:
    """The newest checkpoint of a run stopped after step 4 gets a flipped bit; --resume refuses it naming the
    file, and ``--resume-step`` continues from the one before."""
    from flowrl.runtime.fleet import Faults

    name = "bitflip"
    try:
        b.run(name, faults=Faults(stop_after_step=3))
    except SystemExit:
        pass
    ckpt = sorted((b.work / name / "checkpoints").glob("step_*"))[-1]
    victim = max((p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    try:
        b.resume(name)
        return _row(b, "bit flip in the newest checkpoint", name, False, "accepted", "resumed", True)
    except Exception as error:
        message = _error_line(error)
    result, _ = b.resume(name, resume_step=2)
    return _row(b, "bit flip in the newest checkpoint", name, "crc" in message.lower(),
                message, "refused: --resume-step 2", len(result.rows) == STEPS)


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


def _own_runs(b: Bench, kind: str, faults) -> tuple:
    """The undisturbed run and the faulted run of ``WORKER_FLOWS[kind]``, written with the case's reward
    and environment modules into ``work/kind``: (reference result, faulted result, what it printed)."""
    folder = b.work / kind
    folder.mkdir(exist_ok=True)
    (folder / "chaos_rewards.py").write_text(REWARDS)
    (folder / "chaos_envs.py").write_text(ENVS)
    flow = folder / "chaos.flow"
    flow.write_text(WORKER_FLOWS[kind].format(model=b.work / "model", data=ROOT / "data" / "arith", steps=STEPS,
                                              shared=folder / "shared"))
    reference, _ = b.run(f"{kind}/reference", flow=flow)
    result, said = b.run(f"{kind}/faulted", flow=flow, faults=faults)
    return reference, result, said


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
    "driver-kill": driver_kill,
    "sigterm": sigterm,
    "hang": hang,
    "damaged-sync": damaged_sync,
    "lost-sync": lost_sync,
    "checkpoint-bitflip": checkpoint_bitflip,
    "node-lost": node_lost,
    "reward-worker-kill": worker_kill("reward"),
    "env-worker-kill": worker_kill("env"),
}


def table(rows: list[Row], markdown: bool = False, width: int = 90) -> str:
    head = ["fault", "detected", "message", "state after", "resumed", "identical", "lost", "duplicated", "s"]
    body = [[r.fault, "yes" if r.detected else "NO", r.message if markdown else r.message[:width],
             r.state, "yes" if r.resumed else "NO", "yes" if r.identical else "NO", str(r.lost), str(r.duplicated),
             f"{r.seconds:.0f}"] for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in body])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated cases (default: all): {', '.join(CASES)}")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--work", default="", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
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
            rows.append(row)
            print(table(rows[-1:]), file=sys.stderr, flush=True)
            out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                                       "load_1m": os.getloadavg()[0], "steps": STEPS, "save_every": SAVE_EVERY,
                                       "rows": [{**asdict(r), "ok": r.ok} for r in rows]}, indent=1))
    finally:
        bench.close()
    print(table(rows, markdown=args.markdown))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
