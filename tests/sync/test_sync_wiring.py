"""How the driver and workers use the protocols: plan -> options, the worker ends, fault injection, metrics."""

import sys
from pathlib import Path

import pytest
import torch

from flowrl.plan import ResyncPlan
from flowrl.runtime.sync import WeightSyncError
from flowrl.runtime.sync.endpoint import open_end, receive_weights, send_weights
from flowrl.runtime.sync.from_plan import collective, sync_metrics, sync_options, sync_problem
from sync_testkit import broadcast_receiver_thread, digest, model_weights

RUN = Path("/runs/r1")


def plan(protocol: str, transport: str, bucket: int = 1 << 20, overlap: bool = False, **options) -> ResyncPlan:
    return ResyncPlan("resync.policy", "policy", "grpo.update", protocol, bucket, 1, "f.flow:9:3",
                      options=options, transport=transport, overlap=overlap)


@pytest.mark.parametrize("record, expected", [
    (plan("inplace", "ray"), {"bucket_bytes": 1 << 20}),
    (plan("broadcast", "gloo", overlap=True), {"bucket_bytes": 1 << 20, "backend": "gloo", "overlap": True}),
    # `nccl` written for a CPU cluster: the plan's transport is gloo, and so is the group
    (plan("nccl", "gloo"), {"bucket_bytes": 1 << 20, "backend": "gloo", "overlap": False}),
    (plan("checkpoint", "disk", bucket=0, keep=2), {"keep": 2, "directory": str(RUN / "sync" / "policy")}),
    (plan("checkpoint", "disk", bucket=0, dir="/shared/w"), {"directory": "/shared/w"}),
    (plan("delta", "gloo", threshold=0.5),
     {"bucket_bytes": 1 << 20, "threshold": 0.5, "inner": "broadcast", "backend": "gloo", "overlap": False}),
    (plan("delta", "ray"), {"bucket_bytes": 1 << 20, "inner": "inplace"}),
], ids=["inplace", "broadcast", "nccl-on-cpu", "checkpoint-default-dir", "checkpoint-dir", "delta-gloo", "delta-ray"])
def test_sync_options_follow_the_plan(record, expected):
    assert sync_options(record, RUN) == expected
    assert sync_problem(record) is None


def test_collective_follows_the_protocol_and_a_delta_its_inner_protocol():
    assert [collective(r, sync_options(r, RUN)) for r in (plan("inplace", "ray"), plan("broadcast", "gloo"),
                                                           plan("checkpoint", "disk", bucket=0),
                                                           plan("delta", "gloo"), plan("delta", "ray"))] \
        == [False, True, False, True, False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can run NCCL")
def test_nccl_without_cuda_is_refused_with_a_hint():
    problem = sync_problem(plan("nccl", "nccl"))
    assert "sends over nccl, which this machine (platform cpu) lacks" in problem and "via gloo()" in problem, problem
    assert sync_problem(plan("nccl", "nccl"), nccl_elsewhere=True) is None  # a joined cluster says for itself


def test_unknown_protocol_and_option_are_named():
    assert "did you mean `delta`" in sync_problem(plan("detla", "ray"))
    assert "option 'colour'" in sync_problem(plan("inplace", "ray", colour="red"))


def test_sync_metrics_are_numbers_and_name_the_protocol():
    sent = {"bytes": 1000, "copied_bytes": 600, "wire_bytes": 1100, "buckets": 2, "tensors": 7, "seconds": 0.5,
            "skipped": 3}
    received = [{"unpack_seconds": 0.1}, {"unpack_seconds": 0.25}]
    assert sync_metrics("delta", sent, received, 0.75) == {
        "sync/bytes": 1000, "sync/copied_bytes": 600, "sync/wire_bytes": 1100, "sync/buckets": 2, "sync/tensors": 7, "sync/seconds": 0.75,
        "sync/unpack_seconds": 0.25, "sync/protocol/delta": 1, "sync/skipped": 3}


def test_sync_metrics_give_the_bytes_each_rollout_rank_was_given():
    sent = {"bytes": 1000, "copied_bytes": 0, "wire_bytes": 1100, "buckets": 2, "tensors": 7}
    received = [{"unpack_seconds": 0.1, "rank_bytes": [520, 530]}, {"unpack_seconds": 0.2, "rank_bytes": [1000]}]
    metrics = sync_metrics("broadcast", sent, received, 0.5)
    assert {k: v for k, v in metrics.items() if "rank_bytes" in k or "delivered" in k} == {
        "sync/rank_bytes/0/0": 520, "sync/rank_bytes/0/1": 530, "sync/rank_bytes/1/0": 1000,
        "sync/delivered_bytes": 2050}


# ---- worker ends ----------------------------------------------------------------------------------------
def _options(name: str, tmp_path: Path) -> dict:
    return {"inplace": {"bucket_bytes": 700}, "checkpoint": {"directory": str(tmp_path), "bucket_bytes": 700},
            "delta": {"inner": "inplace", "bucket_bytes": 700}}[name]


@pytest.mark.parametrize("name", ["inplace", "checkpoint", "delta"])
def test_ends_deliver_exact_weights_and_a_fault_is_named(name, tmp_path):
    sender, rdzv = open_end(name, "sender", _options(name, tmp_path))
    receiver, _ = open_end(name, "receiver", _options(name, tmp_path))
    assert rdzv is None
    for version in (1, 2):
        sent, handoff = send_weights(sender, model_weights(version), version)
        pairs, got = receive_weights(receiver, handoff)
        assert digest(sorted(pairs)) == digest(sorted(model_weights(version)))  # a delta: its whole copy
        assert got["version"] == version and sent["bytes"] > 0
    _, handoff = send_weights(sender, model_weights(3), 3, corrupt=True)
    with pytest.raises(WeightSyncError, match=r"tensor '[^']+' in .* corrupted: crc32"):
        receive_weights(receiver, handoff)
    sender.close()
    receiver.close()


def test_broadcast_ends_in_two_threads_deliver_and_a_fault_is_named():
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # the runs' shared local instance (e2e_kit.shared_ray): ended,
        ray.shutdown()  # as these ends run outside Ray
    sender, rdzv = open_end("broadcast", "sender", {"world_size": 2, "bucket_bytes": 700, "timeout_s": 60,
                                                    "backend": "gloo"})
    assert rdzv.host == "127.0.0.1" and rdzv.world_size == 2  # outside Ray: loopback
    thread, out = broadcast_receiver_thread(rdzv, 2)
    send_weights(sender, model_weights(1), 1)
    send_weights(sender, model_weights(2), 2, corrupt=True)
    thread.join(timeout=60)
    sender.close()
    assert out[0] == (digest(model_weights(1)), 1)
    assert "in bucket 0 is corrupted: crc32" in str(out[1]), out[1]
    assert sender.tamper is None  # the fault is armed for one send only
