"""The driver's resend of a damaged resync, on the worker ends (no Ray): the receiver that found damage
raises CorruptedWeights (so the driver knows a resend may cure it) and loaded nothing; the same version
sent once more with ``fresh=True`` arrives exact, and the syncs after it work as before."""


import pytest

from flowrl.runtime.sync import WeightSyncError
from flowrl.runtime.sync.endpoint import open_end, receive_weights, send_weights
from flowrl.runtime.weight_sync import CorruptedWeights, LostWeights
from sync_testkit import broadcast_receiver_thread, digest, model_weights


def _options(name: str, tmp_path) -> dict:
    return {"inplace": {"bucket_bytes": 700}, "checkpoint": {"directory": str(tmp_path), "bucket_bytes": 700},
            "delta": {"inner": "inplace", "bucket_bytes": 700}}[name]


def _exact(pairs, version: int) -> bool:
    return digest(sorted(pairs)) == digest(sorted(model_weights(version)))


@pytest.mark.parametrize("name", ["inplace", "checkpoint", "delta"])
def test_a_damaged_sync_sent_again_afresh_arrives_exact(name, tmp_path):
    sender, _ = open_end(name, "sender", _options(name, tmp_path))
    receiver, _ = open_end(name, "receiver", _options(name, tmp_path))
    _, handoff = send_weights(sender, model_weights(1), 1)
    assert _exact(receive_weights(receiver, handoff)[0], 1)
    _, handoff = send_weights(sender, model_weights(2), 2, corrupt=True)
    with pytest.raises(CorruptedWeights, match=r"tensor '[^']+' in .* corrupted: crc32"):
        receive_weights(receiver, handoff)
    _, handoff = send_weights(sender, model_weights(2), 2, fresh=True)
    pairs, got = receive_weights(receiver, handoff)
    assert _exact(pairs, 2) and got["version"] == 2
    _, handoff = send_weights(sender, model_weights(3), 3)  # and the next sync as usual (a delta: against 2)
    pairs, got = receive_weights(receiver, handoff)
    assert _exact(pairs, 3) and got["version"] == 3
    sender.close()
    receiver.close()


@pytest.mark.parametrize("name, missing", [("inplace", r"bucket\(s\) \d+ of the \d+ sent for version 2 never arrived"),
                                           ("checkpoint", r"\S+\.safetensors of the \d+ file\(s\) of version 2 .* "
                                                          r"never arrived"),
                                           ("delta", r"bucket\(s\) \d+ of the \d+ sent")])
def test_a_sync_with_a_part_lost_loads_nothing_and_is_sent_again(name, missing, tmp_path):
    """Issue 14: a bucket (a file) the transport lost, not damaged: the receiver finds it missing
    before loading anything (LostWeights, which the driver resends as it resends damage)."""
    sender, _ = open_end(name, "sender", _options(name, tmp_path))
    receiver, _ = open_end(name, "receiver", _options(name, tmp_path))
    assert _exact(receive_weights(receiver, send_weights(sender, model_weights(1), 1)[1])[0], 1)
    _, handoff = send_weights(sender, model_weights(2), 2, lose=True)
    with pytest.raises(LostWeights, match=missing):
        receive_weights(receiver, handoff)
    assert receiver.version == 1  # nothing of version 2 was taken
    pairs, got = receive_weights(receiver, send_weights(sender, model_weights(2), 2, fresh=True)[1])
    assert _exact(pairs, 2) and got["version"] == 2
    sender.close()
    receiver.close()


def test_broadcast_cannot_lose_a_bucket_on_purpose():
    sender, _ = open_end("broadcast", "sender", {"world_size": 2, "bucket_bytes": 700, "timeout_s": 5, "backend": "gloo"})
    try:
        with pytest.raises(WeightSyncError, match="no way to lose part of a BroadcastSync sync"):
            send_weights(sender, [], 1, lose=True)
    finally:
        sender.close()


def test_a_delta_resent_without_fresh_is_refused():
    """Why the resend is fresh: the delta sender recorded version 2 as delivered, so a plain resend
    is an empty delta against 2, which the receiver (still at 1) cannot apply."""
    sender, _ = open_end("delta", "sender", {"inner": "inplace", "bucket_bytes": 700})
    receiver, _ = open_end("delta", "receiver", {"inner": "inplace", "bucket_bytes": 700})
    receive_weights(receiver, send_weights(sender, model_weights(1), 1)[1])
    with pytest.raises(CorruptedWeights):
        receive_weights(receiver, send_weights(sender, model_weights(2), 2, corrupt=True)[1])
    with pytest.raises(WeightSyncError, match="delta against version 2"):
        receive_weights(receiver, send_weights(sender, model_weights(2), 2)[1])


def test_broadcast_resend_after_damage_keeps_the_group_in_step():
    sender, rdzv = open_end("broadcast", "sender", {"world_size": 2, "bucket_bytes": 700, "timeout_s": 60,
                                                    "backend": "gloo"})
    thread, out = broadcast_receiver_thread(rdzv, 3)
    send_weights(sender, model_weights(1), 1, corrupt=True)
    send_weights(sender, model_weights(1), 1, fresh=True)
    send_weights(sender, model_weights(2), 2)
    thread.join(timeout=60)
    sender.close()
    assert isinstance(out[0], CorruptedWeights) and "in bucket 0 is corrupted: crc32" in str(out[0])
    assert out[1] == (digest(model_weights(1)), 1)
    assert out[2] == (digest(model_weights(2)), 2)
