"""Device frames (the NCCL path's bucket format), run on the CPU: checksums, trailers, damage found and named."""

import pytest
import torch

from flowrl.runtime.sync import device_frames
from flowrl.runtime.sync.base import ProtocolStats
from flowrl.runtime.sync.cuda_ipc import word_checksum
from flowrl.runtime.weight_sync import CorruptedWeights, plan_buckets
from sync_testkit import model_weights, raw


def _weights():
    g = torch.Generator().manual_seed(3)
    big = torch.randint(-2**31, 2**31 - 1, (300_000,), generator=g, dtype=torch.int32)  # s2 wraps past 2^63
    return model_weights(1) + [("big", big.view(torch.float32)), ("tail", torch.tensor([True, False, True]))]


def _packed(bucket_bytes: int = 1 << 20):
    stats = ProtocolStats()
    buckets = [device_frames.pack(p, torch.device("cpu"), stats) for p in plan_buckets(_weights(), bucket_bytes)]
    return buckets, stats


def test_the_bucket_checksum_follows_from_the_tensors_and_covers_the_whole_data_room():
    buckets, stats = _packed()
    assert len(buckets) > 1 and stats.copied_bytes == sum(t.numel() * t.element_size() for _, t in _weights())
    for b in buckets:
        room = device_frames.data_room(device_frames.data_bytes(b.tensors))
        assert room % 8 == 0 and b.frame.nbytes == room + device_frames.trailer_bytes(len(b.tensors))
        assert word_checksum(b.frame[:room]) == b.checksum  # derived, never computed over the room by the sender


def test_a_frame_round_trips_through_its_trailer_and_unpacks_to_the_same_tensors():
    buckets, _ = _packed()
    pairs = []
    for b in buckets:
        frame = device_frames.write_trailer(b, 2, 7).clone()  # what a receiver's buffer holds
        trailer = device_frames.trailer_of(frame, device_frames.data_bytes(b.tensors))
        assert trailer[:6] == [2, 7, b.index, b.checksum[0], 0, b.checksum[1]]
        received = device_frames.received(frame, b.tensors, trailer)
        assert (received.index, received.sums, received.checksum) == (b.index, b.sums, b.checksum)
        pairs += device_frames.unpack(received, ProtocolStats())
    assert [n for n, _ in pairs] == [n for n, _ in _weights()]
    assert all(raw(t) == raw(w) and t.dtype == w.dtype and t.shape == w.shape
               for (_, t), (_, w) in zip(pairs, _weights()))


def after_padding(meta) -> int:
    """A padding byte after ``meta``'s tensor and the word its checksum rounds it up to."""
    return -(-(meta.offset + meta.nbytes) // 4) * 4


@pytest.mark.parametrize("where", ["tensor", "padding"])
def test_damage_is_found_and_named(where):
    buckets, _ = _packed()
    bucket, meta = next((b, m) for b in buckets for m, after in zip(b.tensors, b.tensors[1:])
                        if after.offset > m.offset + m.nbytes + 4)  # padding beyond its checksum's last word
    at = meta.offset if where == "tensor" else after_padding(meta)
    bucket.frame[at] ^= 0xFF
    match = f"tensor {meta.name!r} in bucket {bucket.index} is corrupted" if where == "tensor" else "padding bytes"
    with pytest.raises(CorruptedWeights, match=match):
        device_frames.unpack(bucket, ProtocolStats())


def test_a_tamper_hook_damages_a_copy_never_the_packed_frame():
    buckets, _ = _packed()
    host = device_frames.as_host_bucket(buckets[0])
    data = host.data.copy()
    data[0] ^= 0xFF
    damaged = device_frames.with_data(buckets[0], data)
    assert damaged.frame.data_ptr() != buckets[0].frame.data_ptr()
    with pytest.raises(CorruptedWeights):
        device_frames.unpack(damaged, ProtocolStats())
    assert len(device_frames.unpack(buckets[0], ProtocolStats())) == len(buckets[0].tensors)


def test_a_broadcast_chooses_its_frames_by_backend_and_refuses_an_unknown_kind():
    from flowrl.runtime.sync import BroadcastSync, WeightSyncError

    with pytest.raises(WeightSyncError, match="frames='gpu'; hint: one of auto, host, device"):
        BroadcastSync("sender", world_size=2, frames="gpu")
    for frames, on_device in [("auto", False), ("host", False), ("device", True)]:  # gloo: host frames unless told
        sync = BroadcastSync("sender", world_size=2, backend="gloo", frames=frames, timeout_s=5)
        try:
            assert sync.on_device is on_device
            assert (sync.home(model_weights(1)) == {}) is on_device  # device frames pack on the device: no home
        finally:
            sync.close()
