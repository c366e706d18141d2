"""``broadcast``: packed buckets over a standalone gloo group between real processes."""

import pytest
import torch
import torch.distributed as dist

from flowrl.runtime.sync import BroadcastSync, Rendezvous, WeightSyncError
from flowrl.runtime.sync import device_frames
from flowrl.runtime.sync.broadcast import HEADER_LEN, trailer_bytes
from flowrl.runtime.weight_sync import pack_buckets
from flowrl.runtime.weight_sync import TransportBroken
from sync_testkit import broadcast_receiver, broadcast_receiver_that_breaks, collect, digest, model_weights, \
    start_children

BUCKET = 512  # bytes: every sync spans several buckets


def flip_first_tensor_of(index: int):
    """Tamper hook: flip one byte of the first tensor of bucket ``index`` (after checksumming)."""

    def tamper(bucket):
        if bucket.index != index:
            return bucket
        data = bucket.data.copy()
        data[bucket.tensors[0].offset] ^= 0xFF
        return bucket._replace(data=data)

    return tamper


def fail_at(index: int):
    """Tamper hook: packing fails on bucket ``index``, after the layout and earlier buckets went out."""

    def tamper(bucket):
        if bucket.index == index:
            raise OSError(f"disk gone while packing bucket {index}")
        return bucket

    return tamper


@pytest.mark.parametrize("overlap, frames", [(True, "host"), (False, "host"), (True, "device"), (False, "device")])
def test_broadcast_delivers_verified_weights_and_survives_corruption_and_abort(tmp_path, overlap, frames):
    """``frames="device"``: the NCCL path's frames (packed and verified on the wire's device), run on the CPU."""
    sender = BroadcastSync("sender", world_size=3, bucket_bytes=BUCKET, overlap=overlap, timeout_s=60, frames=frames)
    procs, q = start_children(broadcast_receiver, [(sender.rendezvous, 1, 5, overlap, str(tmp_path), "gloo", frames),
                                                   (sender.rendezvous, 2, 5, overlap, None, "gloo", frames)])
    # v1: a clean sync
    stats = sender.send(model_weights(1), 1)
    # v2: bucket 1 is damaged after checksumming: both receivers must name its first tensor
    sender.tamper = flip_first_tensor_of(1)
    sender.send(model_weights(2), 2)
    sender.tamper = None
    # v3: the sender refuses the weights before anything is sent (a dtype the format cannot carry)
    bad = model_weights(3)[:4] + [("layers.9.complex", torch.zeros(2, dtype=torch.complex64))]
    with pytest.raises(WeightSyncError, match="unsupported dtype"):
        sender.send(bad, 3)
    # v4: the sender fails half-way, after two buckets went out: receivers must not hang
    sender.tamper = fail_at(2)
    with pytest.raises(OSError, match="disk gone"):
        sender.send(model_weights(4), 4)
    sender.tamper = None
    # v5: the group is still in step
    sender.send(model_weights(5), 5)
    sender.close()
    results = collect(procs, q)

    assert not dist.is_initialized()  # the sync never touched torch's default group
    buckets, _ = pack_buckets(model_weights(2), BUCKET)
    damaged = buckets[1].tensors[0].name
    for outcomes, _ in results:
        assert outcomes[0] == ("ok", 1, digest(model_weights(1)), stats.buckets)
        assert outcomes[1][0] == "error" and f"tensor {damaged!r} in bucket 1 is corrupted" in outcomes[1][1]
        assert outcomes[2][0] == "error" and "sender aborted version 3" in outcomes[2][1]
        assert "unsupported dtype" in outcomes[2][1]
        assert outcomes[3] == ("error", outcomes[3][1])
        assert "sender aborted version 4: OSError: disk gone while packing bucket 2" in outcomes[3][1]
        assert outcomes[4][:3] == ("ok", 5, digest(model_weights(5)))
    assert results[0][1] is True  # the receiver's own default group (like vLLM's) still works
    assert stats.buckets > 3 and stats.tensors == len(model_weights(1))
    assert stats.wire_bytes > stats.bytes  # the header, the layout and the CRC trailers travel too


@pytest.mark.parametrize("frames", ["host", "device"])
def test_each_bucket_is_one_message_of_the_size_the_layout_announced(frames):
    """The wire carries the header, the layout, then exactly one message per bucket: data + checksum trailer
    (host frames: CRC-32s after the data; device frames: word sums after the data rounded up to 8 bytes)."""
    sender = BroadcastSync("sender", world_size=2, bucket_bytes=BUCKET, timeout_s=60, frames=frames)
    procs, q = start_children(broadcast_receiver, [(sender.rendezvous, 1, 1, True, None, "gloo", frames)])
    sizes, events = [], []
    post, wait = sender._post, sender._wait  # every message goes out through the one, is waited for by the other
    sender._post = lambda tensor: sizes.append(tensor.nbytes) or events.append(("post", len(sizes))) or post(tensor)
    sender._wait = lambda work: events.append(("wait", id(work))) or wait(work)
    stats = sender.send(model_weights(1), 1)
    sender.close()
    (outcomes, _), = collect(procs, q)
    buckets, _ = pack_buckets(model_weights(1), BUCKET)
    assert outcomes[0][:3] == ("ok", 1, digest(model_weights(1)))
    frame = (lambda b: device_frames.frame_bytes(b.data.nbytes, len(b.tensors))) if sender.on_device else \
        (lambda b: b.data.nbytes + trailer_bytes(len(b.tensors)))
    assert sizes[0] == 8 * HEADER_LEN and sizes[2:] == [frame(b) for b in buckets]  # sizes[1]: the layout
    assert stats.wire_bytes == sum(sizes)
    assert stats.copied_bytes == sum(m.nbytes for b in buckets for m in b.tensors)
    # The header and the layout are waited for one by one; then each bucket's frame goes on the wire before
    # the one before it is waited for (IN_FLIGHT), so the wire never idles between frames.
    kinds = [kind for kind, _ in events]
    assert kinds[:4] == ["post", "wait", "post", "wait"] and kinds[4:7] == ["post", "post", "wait"]
    assert kinds.count("post") == kinds.count("wait") == len(sizes)


@pytest.mark.parametrize("breaks", ["kill", "close"])
def test_a_receiver_that_dies_or_drops_out_mid_sync_breaks_the_group_at_once(breaks):
    """Receiver 1 breaks the group as sync 2 starts: SIGKILLed, or closing its end. The sender's send fails
    with ``TransportBroken`` long before its timeout, and so does every later use of its group; receiver 2,
    left waiting for bytes that will not come, fails the same way (at the latest at its own timeout)."""
    import time

    sender = BroadcastSync("sender", world_size=3, bucket_bytes=BUCKET, timeout_s=60)
    procs, q = start_children(broadcast_receiver_that_breaks, [(sender.rendezvous, 1, breaks, 60),
                                                               (sender.rendezvous, 2, None, 5)])
    sender.send(model_weights(1), 1)
    t0 = time.monotonic()
    with pytest.raises(TransportBroken, match="transport failed on rank 0"):  # connection closed, or reset
        sender.send(model_weights(2), 2)
    assert time.monotonic() - t0 < 30, "the sender waited out its timeout"  # deadline: it saw the peer go
    with pytest.raises(TransportBroken, match="the group is unusable on rank 0"):
        sender.send(model_weights(3), 3)
    sender.close()
    if breaks == "kill":
        procs[0].join(timeout=60)
        assert procs[0].exitcode == -9
        procs, q = procs[1:], q
    results = []
    for _ in procs:
        index, ok, value = q.get(timeout=120)
        assert ok, value
        results.append((index, value))
    for p in procs:
        p.join(timeout=60)
    outcomes = dict(results)
    kind, message = outcomes[1][0]
    assert kind == "TransportBroken" and "transport failed on rank 2" in message, message
    if breaks == "close":
        kind, message = outcomes[0][0]
        assert kind == "TransportBroken" and "the group is unusable on rank 1 (closed)" in message, message


def test_a_rank_that_never_joins_is_a_broken_transport():
    """No receiver ever connects: the group cannot form, and the sender says so at its timeout."""
    sender = BroadcastSync("sender", world_size=2, timeout_s=1)
    with pytest.raises(TransportBroken, match="rank 0: the group did not form"):
        sender.send(model_weights(1), 1)
    with pytest.raises(TransportBroken, match="the group is unusable on rank 0"):
        sender.send(model_weights(1), 1)
    sender.close()


def test_receiver_needs_rendezvous_and_valid_rank():
    with pytest.raises(WeightSyncError, match="needs the sender's Rendezvous"):
        BroadcastSync("receiver", rank=1)
    with pytest.raises(WeightSyncError, match=r"rank=3; hint: ranks 1\.\.2"):
        BroadcastSync("receiver", rendezvous=Rendezvous("127.0.0.1", 1, 3), rank=3)
    with pytest.raises(WeightSyncError, match="world_size=1"):
        BroadcastSync("sender", world_size=1)
    with pytest.raises(WeightSyncError, match="backend='mpi'"):
        BroadcastSync("sender", world_size=2, backend="mpi")


def test_roles_are_enforced_and_close_is_idempotent():
    sender = BroadcastSync("sender", world_size=2, backend="gloo")
    assert sender.rendezvous.world_size == 2 and sender.rendezvous.port > 0
    with pytest.raises(WeightSyncError, match="a sender cannot receive"):
        sender.receive()
    sender.close()
    sender.close()
    with pytest.raises(WeightSyncError, match="the group is unusable"):
        sender.send(model_weights(1), 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_nccl_broadcast_between_two_gpus(tmp_path):
    sender = BroadcastSync("sender", world_size=2, bucket_bytes=BUCKET, backend="nccl", timeout_s=60)
    procs, q = start_children(broadcast_receiver, [(sender.rendezvous, 1, 1, True, None, "nccl")])
    sender.send(model_weights(1), 1)
    sender.close()
    (outcomes, _), = collect(procs, q)
    assert outcomes[0][:3] == ("ok", 1, digest(model_weights(1)))
