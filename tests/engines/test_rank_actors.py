"""Train-engine ranks as Ray actors (``flowrl.engines.rank_actors``) on a fake 2-node CPU cluster.

One ``ray.cluster_utils.Cluster``: a head and a worker node with 2 logical GPUs each (no real
GPU; Ray schedules by them as on a GPU cluster). The placement groups are the runtime's own
(:meth:`Fleet._start_ray <flowrl.runtime.fleet.Fleet._start_ray>`: one per plan node, pinned to a
Ray node) and each rank's bundle comes from the plan (:func:`flowrl.runtime.placement.rank_placement`).

* ``megatron(tp = 2, dp = 2)`` planned over 2 nodes runs ranks 0-1 on one Ray node and 2-3 on the
  other, as the plan says, and trains bit-identically (losses, grad norms, every rank's parameter,
  gradient and optimizer-state checksums, the gathered weights) to the same layout on one node
  (forked ranks: an engine outside Ray);
* a rank actor killed mid-call is detected and named with its node (``dead_ranks``: what the runtime
  turns into ``EngineDied``, restarted by ``--restarts``), its peers are stopped, and after shutdown
  no rank process is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")  # the flows' rollout engine (compiled, never started here)
ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
MEGATRON_TESTS = HERE.parent / "megatron"
sys.path.insert(0, str(MEGATRON_TESTS))
from mcore_cases import OPTIM, make_batch, pg_loss  # noqa: E402

from flowrl.engines.base import EngineConfigError  # noqa: E402
from flowrl.engines.megatron import MegatronTrainEngine  # noqa: E402
from flowrl.engines.rank_hosts import start_ranks  # noqa: E402
from flowrl.engines.ranks import RankProcessError  # noqa: E402
from flowrl.launch import build_plan  # noqa: E402
from flowrl.runtime.fleet import Fleet  # noqa: E402
from flowrl.runtime.placement import node_of, rank_placement  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLOW = """import stdlib.grpo
model policy = hf("model")
dataset prompts = jsonl("train.jsonl")
reward sevens = python_reward("e2e_rewards:sevens", workers = 1)
flow main(steps: int = 2, eval_every: int = 0) {{
  grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 6, lr = 3e-3, kl = 0.0, seed = 1)
}}
schedule main on cluster(nodes = {nodes}, gpus_per_node = {per}) {{
  pool shared = gpus(gpus = 4, nodes = {nodes})
  colocate policy.train, policy.rollout on shared
  policy.train = megatron(tp = 2, dp = 2)
  policy.rollout = vllm(tp = 1)
}}
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_gone(pids: list[int], message: str, within_s: float = 30.0) -> None:
    """Every process of ``pids`` ends within ``within_s`` (Ray's raylet reaps a killed actor's worker)."""
    deadline = time.monotonic() + within_s
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(p) for p in pids), message


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The fake cluster (head: 2 logical GPUs, worker: 2), joined by this process; the work dir."""
    from ray.cluster_utils import Cluster

    from flowrl.models.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("rank_actors")
    build_tiny_model(tmp / "model", hidden=128, heads=4, kv_heads=2, layers=2, seed=0)
    (tmp / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    shutil.copy(HERE.parent / "runtime" / "e2e_rewards.py", tmp)  # the flow's reward (compiled, never run)
    # Rank actors unpickle the tests' loss function and rank worker by reference (mcore_cases,
    # rank_workers): their directories on the actors' path.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(MEGATRON_TESTS), str(HERE), old) if p)
    if ray.is_initialized():  # the tests' shared local instance (e2e_kit.shared_ray): this module joins its own cluster
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2, num_gpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield tmp, c.address
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _placed(cluster, nodes: int, per: int):
    """The plan of :data:`FLOW` on ``nodes`` x ``per`` GPUs, its train engine, and a Fleet holding the
    runtime's placement groups for it (its ``node_targets``: plan node -> Ray node)."""
    tmp, address = cluster
    flow = tmp / f"ranks_{nodes}x{per}.flow"
    flow.write_text(FLOW.format(nodes=nodes, per=per))
    plan = build_plan(str(flow))
    engine = plan.model("policy").train_engine
    fleet = Fleet(plan, tmp, timeline=None, log=lambda _m: None, ray_address=address)
    fleet._start_ray()
    return plan, engine, fleet


def _steps(eng) -> dict:
    """Two training steps on ``eng``; what they computed."""
    stats = [eng.train_step(make_batch(seed=s), pg_loss, micro_batch_size=2) for s in (1, 2)]
    return {"losses": [s["loss"] for s in stats], "grad_norms": [s["grad_norm"] for s in stats],
            "checksums": eng.state_checksums(), "weights": dict(eng.named_weights())}


def test_megatron_tp2_dp2_ranks_run_on_their_planned_nodes_and_train_as_on_one_node(cluster):
    """The plan over 2 nodes x 2 GPUs puts ranks 0-1 (a tp group) on node 0 and 2-3 on node 1; the rank
    actors run there. The reference is the same layout on one node, its ranks forked on this machine (the
    path of an engine outside Ray; starting 4 more rank actors, each importing Megatron, costs ~30 s more
    on 2 cores)."""
    tmp, _ = cluster
    plan, engine, fleet = _placed(cluster, nodes=2, per=2)
    try:
        placement = rank_placement(plan, engine, fleet.pgs, fleet.slot)
        with MegatronTrainEngine(str(tmp / "model"), optim=OPTIM, tp=2, dp=2, threads=1,
                                 placement=placement) as eng:
            where = eng.rank_locations()
            two = _steps(eng)
        _assert_gone([w["pid"] for w in where], "rank actors outlived their engine's shutdown")
    finally:
        fleet._release_placement()
    assert [node_of(plan, engine, r) for r in range(4)] == [0, 0, 1, 1]  # tp groups within a node, dp across
    planned = [fleet.node_targets[node_of(plan, engine, r)] for r in range(4)]
    assert [w["node_id"] for w in where] == planned and len(set(planned)) == 2  # two Ray nodes, as planned
    assert all(len(w["gpu_ids"]) == 1 for w in where)  # each rank its own logical GPU
    assert len({(w["node_id"], tuple(w["gpu_ids"])) for w in where}) == 4

    with MegatronTrainEngine(str(tmp / "model"), optim=OPTIM, tp=2, dp=2, threads=1) as eng:  # one node, forked
        one = _steps(eng)
    assert two["losses"] == one["losses"] and two["grad_norms"] == one["grad_norms"]
    assert two["checksums"] == one["checksums"]  # every rank's parameters, gradients, optimizer states
    assert two["weights"].keys() == one["weights"].keys()
    assert all(two["weights"][k].equal(one["weights"][k]) for k in one["weights"])


def test_a_killed_rank_actor_is_named_with_its_node_and_nothing_is_left_running(cluster):
    """A rank's own error (every rank answered) reaches the caller and the ranks stay; a rank actor killed
    mid-call stops the others within seconds and is named with its plan and Ray nodes."""
    sys.path.insert(0, str(HERE))
    try:
        from rank_workers import SleepWorker
    finally:
        sys.path.remove(str(HERE))

    plan, engine, fleet = _placed(cluster, nodes=2, per=2)
    try:
        placement = rank_placement(plan, engine, fleet.pgs, fleet.slot)
        group = start_ranks(SleepWorker, None, 4, 120.0, name="probe", placement=placement)
        where = group.locations()
        assert [w["node_id"] for w in where] == [fleet.node_targets[n] for n in (0, 0, 1, 1)]
        with pytest.raises(EngineConfigError, match="rank 0 refuses"):  # every rank answered: they stay
            group.call("refuse", 60.0)
        assert group.call("sleep", 60.0, seconds=0.0) == [None] * 4
        t0 = time.monotonic()
        # the call blocks while the ranks sleep; rank 3 (plan node 1) is killed meanwhile
        killer = threading.Timer(2.0, os.kill, (where[3]["pid"], signal.SIGKILL))
        killer.start()
        with pytest.raises(RankProcessError) as info:
            group.call("sleep", 60.0, seconds=30.0)
        killer.join()
        assert time.monotonic() - t0 < 30.0  # deadline: found dead, not waited out (60 s)
        error = info.value
        assert "rank process died during sleep" in str(error)
        assert error.dead_ranks == (f"probe-rank3 (plan node 1, Ray node {where[3]['node_id'][:8]})",)
        _assert_gone([w["pid"] for w in where], "a rank actor outlived its group's failure")
    finally:
        fleet._release_placement()
