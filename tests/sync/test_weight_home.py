"""A sender's weights homed in a sync's messages (``WeightHome``): sent without a copy, bit-identical."""

import pytest
import torch

from flowrl.runtime.sync import BroadcastSync
from flowrl.runtime.sync.broadcast import trailer_bytes
from flowrl.runtime.weight_sync import BucketPacker, SyncStats, WeightHome, iter_buckets, plan_buckets
from sync_testkit import broadcast_receiver, collect, digest, model_weights, raw, start_children

BUCKET = 512  # bytes: the tiny model spans several buckets


def _fill_all(packer: BucketPacker, weights, bucket: int = BUCKET):
    stats, buckets = SyncStats(), []
    for planned in plan_buckets(weights, bucket):
        b = packer.fill(planned, stats, trailer_bytes(len(planned.tensors)))
        buckets.append((b.index, bytes(b.data), b.tensors, b.checksum, b.data.__array_interface__["data"][0]))
        packer.release(b)
    return buckets, stats


def _inside(address: int, home: WeightHome) -> bool:
    return home.buffer.data_ptr() <= address < home.buffer.data_ptr() + home.buffer.nbytes


def test_homed_weights_are_packed_where_they_live_into_the_same_buckets():
    weights = model_weights(1)  # mixed dtypes, a non-contiguous tensor, a 0-d one
    home = WeightHome(weights, BUCKET, trailer_bytes)
    homed = list(home.views.items())
    assert [n for n, _ in homed] == [n for n, _ in weights]
    assert all(raw(h) == raw(w) for (_, h), (_, w) in zip(homed, weights))
    assert all(h.is_contiguous() and _inside(h.data_ptr(), home) for _, h in homed)

    packer = BucketPacker(BUCKET)
    packer.home = home
    buckets, stats = _fill_all(packer, homed)
    expected = list(iter_buckets(weights, BUCKET))
    assert [b[:4] for b in buckets] == [(e.index, bytes(e.data), e.tensors, e.checksum) for e in expected]
    assert stats.copied_bytes == 0 and stats.bytes == sum(e.data.nbytes for e in expected)
    assert all(_inside(b[4], home) for b in buckets)  # each bucket is the home's memory, not a ring buffer

    # The same weights not homed: every byte copied into the packer's own buffers.
    plain = BucketPacker(BUCKET)
    copied, plain_stats = _fill_all(plain, weights)
    assert [b[:4] for b in copied] == [b[:4] for b in buckets]
    assert plain_stats.copied_bytes == sum(m.nbytes for e in expected for m in e.tensors)
    assert not any(_inside(b[4], home) for b in copied)


def test_a_weight_living_elsewhere_is_copied_into_its_slot_and_a_changed_plan_packs_copies():
    weights = model_weights(1)
    home = WeightHome(weights, BUCKET, trailer_bytes)
    homed = list(home.views.items())
    # A tied head or a converted weight: the trainer yields a tensor of its own under a homed name.
    name, view = homed[2]
    other = (view.to(torch.float32) + 1).to(view.dtype)
    mixed = homed[:2] + [(name, other)] + homed[3:]
    packer = BucketPacker(BUCKET)
    packer.home = home
    buckets, stats = _fill_all(packer, mixed)
    assert stats.copied_bytes == other.numel() * other.element_size()
    assert raw(home.views[name]) == raw(other)  # the slot now holds what was sent
    assert [b[:4] for b in buckets] == [(e.index, bytes(e.data), e.tensors, e.checksum)
                                        for e in iter_buckets(mixed, BUCKET)]

    # A sync whose buckets the home does not lay out (larger ones) packs copies, never into the home.
    packer = BucketPacker(16 * BUCKET)
    packer.home = home
    before = bytes(home.buffer.numpy())
    buckets, stats = _fill_all(packer, homed, 16 * BUCKET)
    assert stats.copied_bytes == sum(m.nbytes for e in iter_buckets(homed, 16 * BUCKET) for m in e.tensors)
    assert not any(_inside(b[4], home) for b in buckets)
    assert bytes(home.buffer.numpy()) == before


def test_a_home_too_small_for_the_trailer_is_not_used():
    weights = model_weights(1)
    home = WeightHome(weights, BUCKET, lambda tensors: 0)  # no room kept after the buckets
    packer = BucketPacker(BUCKET)
    packer.home = home
    buckets, stats = _fill_all(packer, list(home.views.items()))
    assert not any(_inside(b[4], home) for b in buckets)
    assert stats.copied_bytes > 0


def test_broadcast_sends_homed_weights_without_copying_and_a_tampered_frame_spares_them():
    """Three syncs to a receiver process: the homed weights (no byte copied), the same weights changed in place
    (a train step), then one tampered on the wire: the receiver names the damage, the sender's weights are intact."""
    sender = BroadcastSync("sender", world_size=2, bucket_bytes=BUCKET, timeout_s=60)
    procs, q = start_children(broadcast_receiver, [(sender.rendezvous, 1, 3, True, None)])
    homes = sender.home(model_weights(1))
    weights = list(homes.items())
    first = sender.send(weights, 1)
    with torch.no_grad():  # an optimizer step writes the parameters in place
        for (name, t), (_, new) in zip(weights, model_weights(2)):
            t.copy_(new)
    second = sender.send(weights, 2)
    kept = [raw(t) for _, t in weights]

    def tamper(bucket):
        data = bucket.data.copy()
        data[bucket.tensors[0].offset] ^= 0xFF
        return bucket._replace(data=data)

    sender.tamper = tamper
    sender.send(weights, 3)
    sender.close()
    (outcomes, _), = collect(procs, q)
    assert outcomes[0][:3] == ("ok", 1, digest(model_weights(1)))
    assert outcomes[1][:3] == ("ok", 2, digest(model_weights(2)))
    assert outcomes[2][0] == "error" and "is corrupted" in outcomes[2][1]
    assert first.copied_bytes == second.copied_bytes == 0 and first.bytes == second.bytes > 0
    assert [raw(t) for _, t in weights] == kept  # the damage was made to a copy, never to the weights


def test_only_a_senders_cpu_weights_are_homed():
    sender = BroadcastSync("sender", world_size=2, bucket_bytes=BUCKET, timeout_s=5)
    try:
        assert sender.home([("w", torch.ones(3, device="meta"))]) == {}
        assert sender._packer.home is None
        assert set(sender.home(model_weights(1))) == {n for n, _ in model_weights(1)}
        assert sender.home([]) == {} and sender._packer.home is None  # dropped again
    finally:
        sender.close()


@pytest.mark.parametrize("where, frames", [("first", "host"), ("last", "host"), ("last", "device")])
def test_an_abort_at_the_first_or_last_bucket_reaches_the_receivers(where, frames):
    """Receivers keep the next frame's receive posted: an abort in any bucket still reaches them in step."""
    buckets = len(list(plan_buckets(model_weights(2), BUCKET)))
    index = 0 if where == "first" else buckets - 1

    def fail(bucket):
        if bucket.index == index:
            raise OSError(f"disk gone while packing bucket {index}")
        return bucket

    sender = BroadcastSync("sender", world_size=3, bucket_bytes=BUCKET, timeout_s=60, frames=frames)
    procs, q = start_children(broadcast_receiver, [(sender.rendezvous, r, 3, True, None, "gloo", frames)
                                                   for r in (1, 2)])
    sender.send(model_weights(1), 1)
    sender.tamper = fail
    with pytest.raises(OSError, match="disk gone"):
        sender.send(model_weights(2), 2)
    sender.tamper = None
    sender.send(model_weights(3), 3)
    sender.close()
    for outcomes, _ in collect(procs, q):
        assert outcomes[0][:3] == ("ok", 1, digest(model_weights(1)))
        assert outcomes[1][0] == "error"
        assert f"sender aborted version 2: OSError: disk gone while packing bucket {index}" in outcomes[1][1]
        assert outcomes[2][:3] == ("ok", 3, digest(model_weights(3)))
