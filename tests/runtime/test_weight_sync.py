"""Packed weight-sync buckets: exact round trips, sizing rules, corruption detection."""

import pickle
import warnings
import zlib

import numpy as np
import pytest
import torch

from flowrl.runtime.weight_sync import (
    ALIGN,
    Bucket,
    SyncStats,
    WeightSyncError,
    iter_buckets,
    pack_buckets,
    unpack_bucket,
    unpack_buckets,
)


def mixed_weights():
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 3.0])
    return [
        ("embed.weight", torch.randn(17, 8, generator=gen)),
        ("layer.0.q.weight", torch.randn(8, 8, generator=gen).to(torch.bfloat16)),
        ("layer.0.special_bf16", special.to(torch.bfloat16)),
        ("layer.0.norm.weight", torch.randn(8, generator=gen).to(torch.float16)),
        ("layer.0.transposed", torch.randn(5, 3, generator=gen).t()),  # non-contiguous input
        ("position_ids", torch.arange(11, dtype=torch.int64)),
        ("scale", torch.tensor(0.25)),  # 0-dim
        ("empty", torch.zeros(0, 4, dtype=torch.float16)),
        ("mask", torch.tensor([True, False, True])),
        ("lm_head.weight", torch.randn(40, 8, generator=gen)),  # 1280 bytes
    ]


def raw_bytes(t):
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_bit_exact(expected, got):
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(expected, got):
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert raw_bytes(a) == raw_bytes(b), name  # bit-exact, NaN payloads and -0.0 included


@pytest.mark.parametrize("bucket_bytes", [1, 64, 300, 1 << 20])
def test_round_trip_is_bit_exact_through_pickle(bucket_bytes):
    weights = mixed_weights()
    buckets, stats = pack_buckets(weights, bucket_bytes)
    shipped = pickle.loads(pickle.dumps(buckets, protocol=5))
    got = list(unpack_buckets(shipped, stats))
    assert_bit_exact(weights, got)
    assert stats.tensors == len(weights)
    assert stats.buckets == len(buckets)
    assert stats.bytes == sum(b.data.nbytes for b in buckets)
    assert stats.pack_seconds > 0 and stats.unpack_seconds > 0


def test_buckets_are_plain_numpy_and_tuples():
    (bucket,), _ = pack_buckets(mixed_weights()[:3], 1 << 20)
    assert isinstance(bucket, tuple)
    assert isinstance(bucket.data, np.ndarray) and bucket.data.dtype == np.uint8 and bucket.data.ndim == 1
    for meta in bucket.tensors:
        assert isinstance(meta, tuple)
        assert all(isinstance(v, (str, int, tuple)) for v in meta)
    assert zlib.crc32(bucket.data) == bucket.checksum


def test_sizing_rules():
    # float32 sizes: a 40 B, b 120 B, c 400 B (> bucket), d 64 B, e 4 B; bucket 256 B, ALIGN 64.
    # a at 0, b at 64 (ends 184); c does not fit -> alone; d at 0, e at 64. Every byte is copied (none homed).
    sizes = {"a": 10, "b": 30, "c": 100, "d": 16, "e": 1}
    weights = [(n, torch.ones(k)) for n, k in sizes.items()]
    buckets, stats = pack_buckets(weights, 256)
    assert [[m.name for m in b.tensors] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert [[m.offset for m in b.tensors] for b in buckets] == [[0, 64], [0], [0, 64]]
    assert [b.data.nbytes for b in buckets] == [184, 400, 68]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert stats == SyncStats(bytes=652, buckets=3, tensors=5, copied_bytes=628, pack_seconds=stats.pack_seconds)
    assert ALIGN == 64


def test_exact_fit_stays_in_one_bucket():
    weights = [("x", torch.zeros(32)), ("y", torch.zeros(32)), ("z", torch.zeros(1))]  # 128 + 128 = 256
    buckets, _ = pack_buckets(weights, 256)
    assert [[m.name for m in b.tensors] for b in buckets] == [["x", "y"], ["z"]]
    assert buckets[0].data.nbytes == 256


def test_padding_is_zero_and_offsets_aligned():
    buckets, _ = pack_buckets(mixed_weights(), 1 << 20)
    for b in buckets:
        covered = np.zeros(b.data.nbytes, dtype=bool)
        for m in b.tensors:
            assert m.offset % ALIGN == 0
            covered[m.offset : m.offset + m.nbytes] = True
        assert not b.data[~covered].any()


def test_iter_buckets_is_lazy():
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield f"w{i}", torch.zeros(16)  # 64 B each, two per 128 B bucket

    it = iter_buckets(source(), 128)
    first = next(it)
    assert [m.name for m in first.tensors] == ["w0", "w1"]
    assert pulled == [0, 1, 2]  # w2 was read to learn that bucket 0 is full, nothing more


def test_flipped_byte_names_the_corrupted_tensor():
    weights = mixed_weights()
    buckets, _ = pack_buckets(weights, 300)
    target = next(b for b in buckets if len(b.tensors) > 1)
    meta = target.tensors[1]
    data = target.data.copy()
    data[meta.offset + meta.nbytes // 2] ^= 0xFF
    damaged = target._replace(data=data)
    actual = zlib.crc32(data[meta.offset : meta.offset + meta.nbytes])
    with pytest.raises(WeightSyncError) as err:
        unpack_bucket(damaged)
    msg = str(err.value)
    assert f"tensor {meta.name!r} in bucket {target.index}" in msg
    assert f"crc32 {actual:#010x}, expected {meta.checksum:#010x}" in msg
    assert f"expected {target.checksum:#010x}" in msg
    # the other buckets are untouched and still unpack
    for b in buckets:
        if b is not target:
            unpack_bucket(b)


def test_flipped_padding_byte_is_reported_as_such():
    buckets, _ = pack_buckets([("a", torch.ones(3)), ("b", torch.ones(3))], 1 << 20)
    data = buckets[0].data.copy()
    data[20] ^= 1  # a ends at 12, b starts at 64
    with pytest.raises(WeightSyncError, match="bucket 0 .* every tensor's crc32 matches; hint: the padding bytes"):
        unpack_bucket(buckets[0]._replace(data=data))


def test_truncated_bucket_is_reported():
    buckets, _ = pack_buckets([("a", torch.ones(3)), ("b", torch.ones(3))], 1 << 20)
    with pytest.raises(WeightSyncError, match=r"bucket 0 data is ndarray uint8 \[70\], expected uint8 \[76\]"):
        unpack_bucket(buckets[0]._replace(data=buckets[0].data[:70]))


def test_read_only_buffers_unpack_without_warnings_and_copy():
    weights = mixed_weights()
    (bucket,), _ = pack_buckets(weights, 1 << 20)
    bucket.data.setflags(write=False)  # what Ray's zero-copy get returns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = unpack_bucket(bucket)
    assert_bit_exact(weights, got)
    got[0][1].add_(1.0)  # writable, and does not touch the bucket
    assert zlib.crc32(bucket.data) == bucket.checksum


def test_views_share_memory_unless_copy():
    (bucket,), _ = pack_buckets([("a", torch.ones(4))], 1 << 20)
    view = unpack_bucket(bucket)[0][1]
    copied = unpack_bucket(bucket, copy=True)[0][1]
    view.zero_()
    assert copied.sum().item() == 4.0
    assert not bucket.data.any()


@pytest.mark.parametrize(
    "weights, bucket_bytes, message",
    [
        ([("a", torch.ones(1))], 0, r"bucket_bytes=0; hint"),
        ([("a", torch.ones(1)), ("a", torch.ones(1))], 64, r"weight 'a' appears twice"),
        ([("c", torch.ones(2, dtype=torch.complex64))], 64, r"weight 'c' has unsupported dtype torch.complex64"),
        ([("n", np.ones(2))], 64, r"weight 'n' is a ndarray, not a torch.Tensor"),
    ],
)
def test_bad_input_is_a_clear_error(weights, bucket_bytes, message):
    with pytest.raises(WeightSyncError, match=message):
        pack_buckets(weights, bucket_bytes)


def test_round_trip_through_ray_object_store():
    ray = pytest.importorskip("ray")
    weights = mixed_weights()
    buckets, _ = pack_buckets(weights, 512)
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        fetched = ray.get([ray.put(b) for b in buckets])
    finally:
        if started_here:
            ray.shutdown()
    assert all(isinstance(b, Bucket) for b in fetched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = list(unpack_buckets(fetched))
    assert_bit_exact(weights, got)
