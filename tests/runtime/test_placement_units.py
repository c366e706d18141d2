"""Placement decisions from Ray's node list, without Ray: which resource a plan GPU takes, and
which clusters are refused before anything is reserved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flowrl.catalog.engines import ENGINES
from flowrl.plan import Memory
from flowrl.runtime.placement import (ACTOR_GB, PlacementError, available_memory_gb, check_cluster_fits,
                                      check_host_memory, host_memory_need, no_gpu_warning, node_targets,
                                      slot_resource)


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


def engine(kind: str, role: str, ranks: int, gb: float):
    return SimpleNamespace(kind=kind, role=role, world_size=ranks, dp=ranks, memory=Memory(gb))


def memory_plan(gpu: str = "cpu", nodes: int = 8, per: int = 8, replicas: int = 56):
    policy = SimpleNamespace(id="policy", train_engine=engine("torch", "train", 8, 0.03),
                             rollout_engine=engine("vllm", "rollout", replicas, 1.0))
    ref = SimpleNamespace(id="ref", train_engine=engine("torch", "train", 8, 0.004), rollout_engine=None)
    return SimpleNamespace(cluster={"gpu": gpu, "nodes": nodes, "gpus_per_node": per}, pools=[], models=[policy, ref])


def test_host_memory_is_the_sum_over_every_rank_of_every_engine():
    """Per rank: the compiler's estimate, the rank's process (the record's cpu_rank_gb) and its share of
    the actors: vLLM runs an actor per replica; torch(dp = 8) runs on fsdp's 8 rank actors and their
    coordinator."""
    rows = dict(((k, r), gb) for k, r, gb in host_memory_need(memory_plan()))
    vllm, fsdp = ENGINES["vllm"].cpu_rank_gb, ENGINES["fsdp"].cpu_rank_gb
    assert (vllm, fsdp, ACTOR_GB) == (0.3, 0.3, 0.21)  # the measured figures the numbers below use
    assert rows["policy.rollout (vllm)", 56] == pytest.approx(1.0 + 0.3 + 0.21)
    assert rows["policy.train (torch)", 8] == pytest.approx(0.03 + 0.3 + 0.21 * 9 / 8)
    assert rows["ref.train (torch)", 8] == pytest.approx(0.004 + 0.3 + 0.21 * 9 / 8)
    total = 56 * 1.51 + 8 * 0.634 + 2 * 9 * 0.21  # the two train engines' actors: 8 ranks and a coordinator each
    assert sum(r * gb for (_k, r), gb in rows.items()) == pytest.approx(total)


def test_a_plan_larger_than_the_machines_memory_is_refused_naming_the_need_and_the_way_out():
    with pytest.raises(PlacementError) as e:
        check_host_memory(memory_plan(), available_gb=22.0)
    msg = str(e.value)
    assert "need 93.4 GB" in msg and "56 x policy.rollout (vllm) 1.5 GB" in msg and "22.0 GB available" in msg
    assert "memory/GPU and each rank's process, times the ranks" in msg
    assert "RAY_ADDRESS" in msg and "--ray" in msg and "cluster(nodes = 8, gpus_per_node = 8)" in msg


def test_a_plan_that_fits_or_an_unknown_memory_passes():
    check_host_memory(memory_plan(replicas=8), available_gb=22.0)
    check_host_memory(memory_plan(), available_gb=None)


def test_a_plan_for_gpus_is_not_checked_against_host_memory():
    assert host_memory_need(memory_plan("H100")) == []
    check_host_memory(memory_plan("H100"), available_gb=1.0)


def test_available_memory_is_read_from_this_machine():
    gb = available_memory_gb()
    assert gb is None or gb > 0


def test_a_plan_on_gpus_whose_engines_see_none_is_warned_about_naming_them():
    """On the H200 the torch trainer of a plan on GPUs once computed on the CPU without a word: each engine
    actor now reports the device it takes, and a plan on GPUs with an actor on the CPU says which."""
    rows = [{"engine": "policy.train", "rank": 0, "device": "cpu"}, {"engine": "policy.rollout", "rank": 0,
                                                                      "device": "cuda"}]
    warning = no_gpu_warning(plan("H100"), rows)
    assert warning.startswith("warning: the plan is for H100 GPUs, but policy.train rank 0 see(s) no GPU")
    assert "policy.rollout" not in warning and 'gpu = "cpu"' in warning
    assert no_gpu_warning(plan("H100"), [{**r, "device": "cuda"} for r in rows]) is None
    assert no_gpu_warning(plan("cpu"), rows) is None  # logical GPUs: the CPU is the plan


def test_a_cpu_plans_actors_are_told_to_compute_on_the_cpu(monkeypatch):
    """On a machine with GPUs, Ray's logical GPU slots name real GPUs: the engines of a plan on the `cpu`
    platform are told to stay on the CPU (``FLOWRL_DEVICE``), a plan on GPUs' engines take the GPU they see."""
    import torch

    from flowrl.engines.base import DEVICE_ENV, EngineConfigError, accelerator
    from flowrl.runtime.fleet import ACTOR_ENV, actor_env

    for name in (*ACTOR_ENV, DEVICE_ENV):  # whatever earlier tests in this process set
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLOWRL_CACHE", "/somewhere")
    assert actor_env(plan("cpu")) == {"FLOWRL_CACHE": "/somewhere", DEVICE_ENV: "cpu"}
    assert actor_env(plan("H100")) == {"FLOWRL_CACHE": "/somewhere"}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU in sight
    assert accelerator() == "cuda"
    monkeypatch.setenv(DEVICE_ENV, actor_env(plan("cpu"))[DEVICE_ENV])  # as in the plan's actors
    assert accelerator() == "cpu"
    from flowrl.engines.ranks import server_preload
    assert "flowrl.engines.ranks" in server_preload(["megatron.core"]) and "megatron.core" in server_preload(
        ["megatron.core"])  # no CUDA in those processes: the fork server may preload the engine again
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(EngineConfigError, match="FLOWRL_DEVICE='tpu'; hint: one of cpu, cuda"):
        accelerator()
