"""``inplace``: the driver's bucket path as a component (in-process contract tests)."""

import pickle

import pytest

from flowrl.runtime.sync import InPlaceHandoff, InPlaceSync, WeightSyncError
from sync_testkit import digest, model_weights


def test_round_trip_through_pickle_is_bit_exact():
    sender, receiver = InPlaceSync("sender", bucket_bytes=700), InPlaceSync("receiver")
    stats = sender.send(model_weights(3), 3)
    handoff = pickle.loads(pickle.dumps(sender.handoff(), protocol=5))  # what Ray does to it
    assert digest(receiver.receive(handoff)) == digest(model_weights(3))
    assert receiver.version == 3 and receiver.stats.version == 3
    assert receiver.stats.buckets == stats.buckets == len(handoff.buckets) > 1
    assert receiver.stats.bytes == stats.bytes == stats.wire_bytes
    assert receiver.stats.tensors == stats.tensors == len(model_weights(3))


def test_corrupted_bucket_names_the_tensor():
    sender, receiver = InPlaceSync("sender", bucket_bytes=700), InPlaceSync("receiver")
    sender.send(model_weights(1), 1)
    handoff = sender.handoff()
    bucket = handoff.buckets[1]
    data = bucket.data.copy()
    data[bucket.tensors[-1].offset] ^= 0x80
    damaged = handoff._replace(buckets=[handoff.buckets[0], bucket._replace(data=data), *handoff.buckets[2:]])
    with pytest.raises(WeightSyncError, match=rf"tensor {bucket.tensors[-1].name!r} in bucket 1 is corrupted"):
        list(receiver.receive(damaged))


def test_handoff_is_taken_once_and_roles_are_enforced():
    sender, receiver = InPlaceSync("sender"), InPlaceSync("receiver")
    with pytest.raises(WeightSyncError, match=r"handoff\(\) before send\(\)"):
        sender.handoff()
    sender.send(model_weights(1), 1)
    assert isinstance(sender.handoff(), InPlaceHandoff)
    with pytest.raises(WeightSyncError, match=r"handoff\(\) before send\(\)"):
        sender.handoff()  # the sender does not keep the buckets alive
    with pytest.raises(WeightSyncError, match="a receiver cannot send"):
        receiver.send(model_weights(1), 1)
    with pytest.raises(WeightSyncError, match="receive\\(\\) got NoneType"):
        receiver.receive(None)
    with pytest.raises(WeightSyncError, match="version=-2"):
        sender.send(model_weights(1), -2)
    with pytest.raises(WeightSyncError, match="role='trainer'"):
        InPlaceSync("trainer")
