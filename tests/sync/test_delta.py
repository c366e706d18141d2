"""``delta``: only changed tensors travel; the receiver's copy stays exact; missed deltas are caught."""

import pytest
import torch

from flowrl.runtime.sync import BroadcastSync, DeltaSync, InPlaceHandoff, WeightSyncError, make_sync
from sync_testkit import collect, delta_broadcast_receiver, digest, model_weights, start_children

ALWAYS = {"layers.0.q.weight", "layers.0.mlp.weight", "layers.0.special"}  # change every version
EVEN = {"layers.1.q.weight", "layers.1.mlp.weight"}  # change on even versions


def pair(**options):
    return make_sync("delta", "sender", **options), make_sync("delta", "receiver", **options)


def test_first_sync_is_full_then_only_changed_tensors_travel():
    sender, receiver = pair(bucket_bytes=4096)
    sent = []
    for version in (1, 2, 3):
        stats = sender.send(model_weights(version), version)
        sent.append({n for n, _ in receiver.receive(sender.handoff())})
        assert receiver.version == version
        assert digest(sorted(receiver.state.items())) == digest(sorted(model_weights(version)))
        assert receiver.stats.skipped == stats.skipped == len(model_weights(1)) - len(sent[-1])
    assert sent[0] == {n for n, _ in model_weights(1)}
    assert sent[1] == ALWAYS | EVEN  # 1 -> 2: the even-version tensors change too
    assert sent[2] == ALWAYS
    full = sender.stats  # v3's stats: fewer bytes than a full sync
    assert full.tensors == len(ALWAYS) and full.bytes < sum(t.numel() * t.element_size() for _, t in model_weights(3))


def test_threshold_sends_a_tensor_once_its_drift_exceeds_it():
    sender, receiver = pair(threshold=0.1)
    w = torch.zeros(4)
    steps = [0.04, 0.04, 0.04, float("nan")]  # drift 0.04, 0.08 (kept back), 0.12 (sent), then a NaN (sent)
    arrived = []
    for version, step in enumerate([0.0] + steps):
        w = w.clone()
        w[0] += step
        sender.send([("w", w), ("b", torch.ones(2))], version)
        arrived.append([n for n, _ in receiver.receive(sender.handoff())])
        assert (receiver.state["w"][1:] == 0).all()
        if step == step:  # not NaN: the receiver is never further than the threshold
            assert abs(receiver.state["w"][0] - w[0]) <= 0.1
    assert arrived == [["w", "b"], [], [], ["w"], ["w"]]
    assert torch.isnan(receiver.state["w"][0])


def test_a_missed_delta_is_caught_and_reset_recovers():
    sender, a = pair()
    b = make_sync("delta", "receiver")
    for version in (1, 2):
        sender.send(model_weights(version), version)
        handoff = sender.handoff()
        list(a.receive(handoff))
        if version == 1:
            list(b.receive(handoff))  # b misses version 2
    sender.send(model_weights(3), 3)
    handoff = sender.handoff()
    with pytest.raises(WeightSyncError, match="version 3 is a delta against version 2, but this receiver holds "
                                              "version 1"):
        list(b.receive(handoff))
    assert b.version == 1 and digest(sorted(b.state.items())) == digest(sorted(model_weights(1)))  # b untouched
    sender.reset()
    sender.send(model_weights(4), 4)
    handoff = sender.handoff()
    for r in (a, b):
        assert len(list(r.receive(handoff))) == len(model_weights(4))
        assert digest(sorted(r.state.items())) == digest(sorted(model_weights(4)))


def test_corruption_through_the_inner_protocol_names_the_tensor():
    sender, receiver = pair()
    sender.send(model_weights(1), 1)
    handoff = sender.handoff()
    bucket = handoff.buckets[0]
    meta = next(m for m in bucket.tensors if m.name == "layers.0.mlp.weight")
    data = bucket.data.copy()
    data[meta.offset + 3] ^= 0x10
    damaged = handoff._replace(buckets=[bucket._replace(data=data)] + handoff.buckets[1:])
    with pytest.raises(WeightSyncError, match="tensor 'layers.0.mlp.weight' in bucket 0 is corrupted"):
        list(receiver.receive(damaged))


def test_a_lost_tensor_is_named():
    sender, receiver = pair()
    sender.send(model_weights(1), 1)
    handoff = sender.handoff()
    # Drop the last bucket's tensors on the way: the manifest still lists them as changed.
    from flowrl.runtime.weight_sync import pack_buckets

    manifest_and_some = list(receiver.inner.receive(handoff))[:-2]
    handoff2, _ = pack_buckets(manifest_and_some, 1 << 20)
    with pytest.raises(WeightSyncError, match="lists 'mask' .* as changed but it never arrived"):
        list(receiver.receive(InPlaceHandoff(1, handoff2, len(handoff2))))


def test_options_are_checked():
    with pytest.raises(WeightSyncError, match="threshold=-1"):
        DeltaSync("sender", threshold=-1)
    with pytest.raises(WeightSyncError, match="inner='delta'"):
        DeltaSync("sender", inner="delta")
    with pytest.raises(WeightSyncError, match="role is 'receiver', this end is a sender"):
        DeltaSync("sender", inner=make_sync("inplace", "receiver"))


def test_delta_over_broadcast_between_processes():
    inner = BroadcastSync("sender", world_size=2, bucket_bytes=1024, timeout_s=60)
    sender = DeltaSync("sender", inner=inner)
    procs, q = start_children(delta_broadcast_receiver, [(inner.rendezvous, 3)])
    skipped = [sender.send(model_weights(v), v).skipped for v in (1, 2, 3)]
    sender.close()
    (results,) = collect(procs, q)
    names = [set(r[1]) for r in results]
    assert names == [{n for n, _ in model_weights(1)}, ALWAYS | EVEN, ALWAYS]
    for version, (got_version, _, state, got_skipped) in zip((1, 2, 3), results):
        assert got_version == version
        assert state == digest(sorted(model_weights(version)))
    assert [r[3] for r in results] == skipped == [0, 5, 7]
