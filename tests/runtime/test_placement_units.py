"""Placement decisions from Ray's node list, without Ray: which resource a plan GPU takes, and
which clusters are refused before anything is reserved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flowrl.runtime.placement import PlacementError, check_cluster_fits, node_targets, slot_resource


def plan(gpu: str = "cpu", nodes: int = 2, per: int = 1):
    return SimpleNamespace(cluster={"gpu": gpu, "nodes": nodes, "gpus_per_node": per}, pools=[])


def node(cpus: float, gpus: float = 0, head: bool = False, alive: bool = True, nid: str = "n"):
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **({"node:__internal_head__": 1} if head else {})}
    return {"Alive": alive, "Resources": res, "NodeID": nid}


def test_a_cpu_plan_on_a_cpu_only_cluster_takes_cores():
    nodes = [node(2, head=True, nid="a"), node(2, nid="b")]
    assert slot_resource(plan(), nodes) == "CPU"
    check_cluster_fits(plan(), nodes, "127.0.0.1:1")
    assert node_targets(plan(), nodes) == ["a", "b"]


def test_logical_gpus_are_used_when_the_cluster_declares_them():
    assert slot_resource(plan(), [node(2, gpus=2)]) == "GPU"


def test_a_gpu_plan_always_takes_gpus_and_a_cpu_only_cluster_is_refused():
    nodes = [node(64), node(64)]
    assert slot_resource(plan("H100"), nodes) == "GPU"
    with pytest.raises(PlacementError, match=r"node\(s\) with GPUs \[0, 0\].*num_gpus >= 1"):
        check_cluster_fits(plan("H100"), nodes, "127.0.0.1:1")


def test_too_few_cores_for_the_plans_gpus_is_refused_naming_the_node():
    with pytest.raises(PlacementError, match=r"2 node\(s\) with 4 GPU\(s\) each.*CPUs \[2, 2\].*num_cpus >= 4"):
        check_cluster_fits(plan(per=4), [node(2), node(2)], None)


def test_dead_nodes_do_not_count():
    with pytest.raises(PlacementError, match="room for 1"):
        check_cluster_fits(plan(per=2), [node(2), node(8, alive=False)], None)
