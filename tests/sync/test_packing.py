"""Streaming bucket packing: same buckets as weight_sync.iter_buckets, reused buffers, one CRC pass."""

import zlib

import numpy as np
import pytest
import torch

from flowrl.runtime.sync.broadcast import _Prefetch
from flowrl.runtime.sync.packing import BucketPacker, BufferPool, crc32_combine
from flowrl.runtime.weight_sync import SyncStats, WeightSyncError, crc32_combine_gf2, iter_buckets, unpack_bucket
from sync_testkit import digest, model_weights


@pytest.mark.parametrize("combine", [crc32_combine, crc32_combine_gf2], ids=["used", "python"])
@pytest.mark.parametrize("len_a, len_b", [(0, 5), (1, 1), (1000, 777), (64, 1 << 16)])
def test_crc32_combine_equals_zlib_on_the_concatenation(combine, len_a, len_b):
    rng = np.random.default_rng(len_a + len_b)
    a, b = rng.bytes(len_a), rng.bytes(len_b)
    assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("bucket_bytes", [1, 64, 300, 1 << 20])
def test_packer_makes_the_same_buckets_as_iter_buckets(bucket_bytes):
    packer = BucketPacker(bucket_bytes)
    for version in (1, 2):  # the second round reuses the first round's (dirty) buffers
        mine_stats, ref_stats = SyncStats(), SyncStats()
        mine, unpacked = [], []
        for bucket in packer.pack(model_weights(version), mine_stats):
            mine.append((bucket.index, bucket.tensors, bucket.checksum, bytes(bucket.data)))
            unpacked += digest(unpack_bucket(bucket))  # verifies the bucket CRC built by combining
            packer.release(bucket)
        assert unpacked == digest(model_weights(version))
        ref = [(b.index, b.tensors, b.checksum, bytes(b.data))
               for b in iter_buckets(model_weights(version), bucket_bytes, ref_stats)]
        assert mine == ref
        assert (mine_stats.bytes, mine_stats.buckets, mine_stats.tensors) == \
               (ref_stats.bytes, ref_stats.buckets, ref_stats.tensors)


def test_packer_reuses_released_buffers_and_rejects_duplicates():
    packer = BucketPacker(1 << 20)
    first = next(packer.pack(model_weights(1)))
    base = first.data.base
    packer.release(first)
    second = next(packer.pack(model_weights(2)))
    assert second.data.base is base  # the same memory, no fresh page faults
    with pytest.raises(WeightSyncError, match="appears twice"):
        list(packer.pack([("a", torch.ones(1)), ("a", torch.ones(1))]))


def test_buffer_pool_recycles_per_sync_and_picks_the_smallest_fit():
    pool = BufferPool()
    big, mid, small = pool.take(3000), pool.take(2000), pool.take(1000)
    assert len({id(big.base), id(mid.base), id(small.base)}) == 3  # distinct within a sync
    pool.new_sync()
    again = pool.take(1500)  # several buffers of different sizes fit: no elementwise array comparison
    assert again.base is mid.base and again.nbytes == 1500


def test_prefetch_forwards_errors_and_a_second_iteration_does_not_wait():
    def produce():
        yield 1
        raise OSError("disk gone")

    source = _Prefetch(produce())
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in source:
            got.append(item)
    assert got == [1] and list(source) == []  # draining after the failure returns at once
    source.close()


def test_fill_reserves_the_trailer_room_and_frame_needs_an_unreleased_bucket():
    from flowrl.runtime.weight_sync import plan_buckets

    packer = BucketPacker(1 << 20)
    planned = next(plan_buckets(model_weights(1), 1 << 20))
    assert all(m.checksum == 0 for m in planned.tensors)  # the layout comes from shapes alone
    bucket = packer.fill(planned, tail=48)
    frame = packer.frame(bucket, 48)
    assert frame.nbytes == bucket.data.nbytes + 48 and np.shares_memory(frame, bucket.data)
    assert [m[:5] for m in bucket.tensors] == [m[:5] for m in planned.tensors]
    assert digest(unpack_bucket(bucket)) == digest(model_weights(1)[:len(bucket.tensors)])
    packer.release(bucket)
    with pytest.raises(WeightSyncError, match="was released"):
        packer.frame(bucket, 48)
