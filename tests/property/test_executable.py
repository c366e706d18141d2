"""Whatever ``flowrl check`` accepts, ``flowrl run`` executes (issue 9, point 2).

Flows are drawn from the catalogue by :mod:`flowgen` (stdlib algorithms and hand-assembled op
chains; engines and layouts, weight-sync protocols, staleness 0..3, partial rollout, colocated
and separate pools, clusters of one or two nodes, every hardware profile), seeded, so every
run draws the same flows.

1. Hundreds of them go through ``check`` and ``plan`` (compile, lower, describe; no Ray). Each
   is refused with well-formed diagnostics (a ``FlowError``) or gets a plan; nothing else may
   come out. Every plan must also pass the runtime's own pre-flight check
   (:func:`flowrl.runtime.driver.check_executable`: a handler per op, an adapter per engine,
   a transport per resync), which is what refuses a plan "this build cannot run".
2. A budgeted sample of accepted ``cpu`` flows (chosen by a fixed seed so that together they
   use every engine and every weight-sync protocol of the catalogue) each runs ONE step on a
   fake 2-node CPU Ray cluster with the tiny model. Each must finish its step.
"""

from __future__ import annotations

import random
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from flowgen import Header, draw, tiny_model

from flowrl.catalog.engines import ENGINES
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.diagnostics import FlowError

REPO = Path(__file__).resolve().parents[2]
RUNTIME_DIR = REPO / "tests" / "runtime"
"""``e2e_kit`` (the tiny model's work directory) and ``e2e_rewards``, whose copy beside the generated
flows is ``executable_rewards`` (one module name is imported from one folder per process)."""

SEED = 20261201
FLOWS = 200
_CODE = re.compile(r"^[EW]\d{3}$")
_WHERE = re.compile(r"\S*gen\d+\.flow:\d+:\d+: ")


def _workdir(path: Path) -> Path:
    """The files a generated flow names: the arithmetic data and the reward's module."""
    (path / "data").symlink_to(REPO / "data")
    (path / "executable_rewards.py").write_text((RUNTIME_DIR / "e2e_rewards.py").read_text())
    return path


def _engines_and_protocols(plan) -> set[str]:
    used = set()
    for m in plan.models:
        for e in (m.train_engine, m.rollout_engine):
            if e is not None:
                used.add(f"engine:{e.kind}")
    used |= {f"protocol:{r.protocol}" for r in plan.resyncs}
    return used


def check_and_plan(path: Path):
    """``flowrl plan`` of ``path`` as a function: the plan, or the FlowError refusing the flow."""
    from flowrl.launch import build_plan, describe_plan

    try:
        plan = build_plan(str(path))
    except FlowError as e:
        return e
    assert describe_plan(plan)  # `flowrl plan` prints it
    return plan


# ---- tier 1: check + plan, hundreds of flows ------------------------------------------------------


def _problem(kind: str, error: BaseException) -> str:
    """One line grouping failures alike: the kind, the exception's type and its message without paths."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{kind}: {type(error).__name__}: {_WHERE.sub('', first)[:200]}"


def test_check_and_plan_never_fail_internally(tmp_path, capsys):
    from flowrl.runtime.driver import check_executable

    work = _workdir(tmp_path)
    rng = random.Random(SEED)
    outcomes: Counter = Counter()
    used: set[str] = set()
    problems: dict[str, list[tuple[int, str]]] = {}  # every failure, grouped, with the flows showing it
    for i in range(FLOWS):
        drawn = draw(rng, Header(tiny_model(rng)), rewards=True)
        path = work / f"gen{i}.flow"
        path.write_text(drawn.text)
        try:
            result = check_and_plan(path)
        except Exception as e:  # an internal error: not a diagnostic
            problems.setdefault(_problem("check/plan", e), []).append((i, drawn.text))
            continue
        if isinstance(result, FlowError):
            bad = [d for d in result.diagnostics
                   if not (_CODE.match(d.code) and d.message and d.span.line >= 1 and d.span.column >= 1)]
            if not result.errors or bad:
                problems.setdefault(f"malformed diagnostics: {bad[:1]}", []).append((i, drawn.text))
            outcomes["refused"] += 1
            outcomes.update(d.code for d in result.errors)
            continue
        outcomes["accepted"] += 1
        used |= _engines_and_protocols(result)
        # The runtime's pre-flight must agree, whatever the platform: a handler per op, an adapter per
        # engine; `external`: the cluster's own processes say whether they have NCCL, not this machine.
        try:
            check_executable(result, external=True)
        except Exception as e:
            problems.setdefault(_problem("accepted, then refused by the runtime", e), []).append((i, drawn.text))
    capsys.readouterr()  # plan warnings
    print(dict(outcomes))
    assert not problems, "\n\n".join(f"{p} ({len(flows)} flows, e.g. flow {flows[0][0]}):\n{flows[0][1]}"
                                      for p, flows in problems.items())
    # Not vacuous: a good share is accepted, and every engine and protocol of the catalogue is planned.
    assert outcomes["accepted"] >= FLOWS // 4, outcomes
    missing = ({f"engine:{e}" for e in ENGINES} | {f"protocol:{p}" for p in PROTOCOLS}) - used
    assert not missing, f"no accepted flow uses {sorted(missing)}"


# ---- tier 2: a budgeted sample runs one step on a CPU Ray cluster -----------------------------------

RUNS = 3
"""Flows run for one step (30-100 s each on 2 cores, mostly engine start-up): every engine of the
catalogue, then as many weight-sync protocols as fit (one resync per flow), then variety (stdlib
and chains, two nodes, partial rollout, staleness). Sized for CI's budget: every protocol's
transport is also run by tests/runtime/test_sync_e2e.py and tests/sync/."""

CANDIDATES = 100
SAMPLE_HEADER = Header('hf("model")', dataset='jsonl("data/arith/train.jsonl")')
"""The tiny local model of ``e2e_kit``; no eval split, so no held-out evaluation runs before the step."""
NODES, GPUS_PER_NODE = 2, 2
"""The fake Ray cluster every sampled run shares (logical GPUs, no real one)."""


def _features(drawn, plan) -> set[str]:
    """What a sampled flow exercises: its engines and protocols first, then variety."""
    return _engines_and_protocols(plan) | {
        f"body:{drawn.body.split(':')[0]}", f"nodes:{drawn.nodes}", f"staleness:{plan.staleness}",
        f"pools:{len(plan.pools)}", *(["partial"] if plan.pipeline is not None and plan.pipeline.over_provision > 1 else []),
        *(["ranks>1"] if any(e is not None and e.world_size > 1 for m in plan.models
                             for e in (m.train_engine, m.rollout_engine)) else [])}


MAX_PROCESSES = 4
"""Engine processes (ranks of every engine) a sampled flow may start: engine start-up is most of a
run's time on 2 cores."""


def processes(plan) -> int:
    """Engine ranks the plan starts, every model's train and rollout engines together."""
    return sum(e.world_size for m in plan.models for e in (m.train_engine, m.rollout_engine) if e is not None)


def choose_sample(candidates: list, runs: int) -> list:
    """Greedy cover: the flow adding most missing engines, then most missing protocols, then most
    missing variety, until ``runs`` flows are chosen; ties go to fewer engine processes, then to the
    first drawn. Every engine must be covered."""
    required = {f"engine:{e}" for e in ENGINES}
    wanted = {f"protocol:{p}" for p in PROTOCOLS}
    chosen, covered = [], set()
    while len(chosen) < runs:
        rest = [c for c in candidates if c not in chosen]
        if not rest:
            break
        best = max(rest, key=lambda c: (len((c[2] & required) - covered), len((c[2] & wanted) - covered),
                                        len(c[2] - covered), -c[3], -candidates.index(c)))
        chosen.append(best)
        covered |= best[2]
    missing = required - covered
    assert not missing, f"no accepted flow of the {len(candidates)} drawn uses {sorted(missing)}"
    return chosen


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The accepted flows to run: drawn over the tiny local model for the cluster below."""
    pytest.importorskip("ray")
    sys.path.insert(0, str(RUNTIME_DIR))
    try:
        from e2e_kit import make_workdir
    finally:
        sys.path.remove(str(RUNTIME_DIR))
    work = make_workdir(tmp_path_factory.mktemp("executable"), rows=40, train=32)
    (work / "data").mkdir()
    (work / "data" / "arith").symlink_to(work)  # the header's data/arith/{train,test}.jsonl
    (work / "executable_rewards.py").write_text((RUNTIME_DIR / "e2e_rewards.py").read_text())
    rng = random.Random(SEED + 1)
    accepted = []
    for i in range(CANDIDATES):
        drawn = draw(rng, SAMPLE_HEADER, gpus=("cpu",), max_nodes=NODES, max_per_node=GPUS_PER_NODE)
        path = work / f"run{i}.flow"
        path.write_text(drawn.text)
        result = check_and_plan(path)
        if not isinstance(result, FlowError) and processes(result) <= MAX_PROCESSES:
            accepted.append((path, drawn, _features(drawn, result), processes(result)))
    return work, choose_sample(accepted, RUNS)


@pytest.fixture(scope="module")
def cluster():
    """One fake Ray cluster of 2 nodes x 2 logical GPUs for every sampled run (as
    tests/runtime/test_placement_e2e.py starts it; the driver joins it and frees what it placed)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # an earlier test's Ray in this process: this module joins its own cluster
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": GPUS_PER_NODE,
                                                     "include_dashboard": False})
    for _ in range(NODES - 1):
        c.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield c.address
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", range(RUNS))
def test_sampled_flow_runs_one_step(sample, cluster, k):
    from flowrl.launch import run_file

    work, chosen = sample
    path, drawn, features, _ = chosen[k]
    try:
        result = run_file(str(path), out=str(work / f"out_{path.stem}"), ray_address=cluster, steps=1)
    except BaseException as e:
        raise AssertionError(f"{path.name} ({', '.join(sorted(features))}) accepted by check and plan, "
                             f"failed at run time: {type(e).__name__}: {e}\n{drawn.text}") from e
    assert len(result.rows) == 1 and result.rows[0]["step"] == 1, result.rows
