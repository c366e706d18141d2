"""flowrl.data.sampler: seeded per-epoch shuffles, full batches, exact resume."""

import json

import pytest

from flowrl.data.sampler import BatchSampler, SamplerStateError


def take(sampler, k):
    return [sampler.next_batch() for _ in range(k)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = BatchSampler(10, 5, seed=3)
    e0, e1 = sum(take(s, 2), []), sum(take(s, 2), [])
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1
    assert s.epoch == 2 and s.cursor == 0


def test_same_seed_same_stream_other_seed_other_stream():
    assert take(BatchSampler(50, 8, seed=1), 20) == take(BatchSampler(50, 8, seed=1), 20)
    assert take(BatchSampler(50, 8, seed=1), 20) != take(BatchSampler(50, 8, seed=2), 20)


def test_batches_span_epochs_and_stay_full():
    s = BatchSampler(7, 3, seed=0)
    batches = take(s, 7)  # 21 draws = exactly 3 epochs
    assert all(len(b) == 3 for b in batches)
    flat = sum(batches, [])
    for e in range(3):
        assert sorted(flat[7 * e : 7 * (e + 1)]) == list(range(7))


def test_no_shuffle_is_in_order():
    assert take(BatchSampler(5, 2, shuffle=False), 3) == [[0, 1], [2, 3], [4, 0]]


def test_resume_continues_with_exactly_the_same_batches():
    reference = BatchSampler(23, 4, seed=9)
    expected = take(reference, 30)
    first = BatchSampler(23, 4, seed=9)
    assert take(first, 13) == expected[:13]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = BatchSampler(23, 4, seed=9)
    resumed.load_state_dict(state)
    assert take(resumed, 17) == expected[13:]


def test_next_rows_maps_indices():
    rows = [f"r{i}" for i in range(6)]
    s = BatchSampler(6, 6, shuffle=False)
    assert s.next_rows(rows) == rows
    with pytest.raises(ValueError, match="built for 6 rows but got 2"):
        s.next_rows(rows[:2])


def test_state_from_other_settings_is_refused():
    state = BatchSampler(10, 2, seed=1).state_dict()
    with pytest.raises(SamplerStateError, match="seed=1 but this sampler has seed=2"):
        BatchSampler(10, 2, seed=2).load_state_dict(state)
    with pytest.raises(SamplerStateError, match="n_rows=10 but this sampler has n_rows=11"):
        BatchSampler(11, 2, seed=1).load_state_dict(state)
    with pytest.raises(SamplerStateError, match="out of range"):
        BatchSampler(10, 2, seed=1).load_state_dict({"epoch": 0, "cursor": 10})


def test_bad_construction():
    with pytest.raises(ValueError, match="n_rows=0"):
        BatchSampler(0, 2)
    with pytest.raises(ValueError, match="batch_size=0"):
        BatchSampler(3, 0)
