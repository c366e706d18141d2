"""DAPO's dynamic sampling: the group filter and the bounded draw loop, on scripted draws."""

import pytest
import torch

from flowrl.algos import AlgoError, dynamic_sample, varied_groups


def test_varied_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5000001])
    assert varied_groups(r, 2).tolist() == [False, True, False, True]
    with pytest.raises(AlgoError, match="group size 3 does not split 8"):
        varied_groups(r, 3)


def _scripted(*draws):
    """Draw k returns the k-th reward list (groups of 2); records which draws were made."""
    made = []

    def draw(k):
        made.append(k)
        return torch.tensor(draws[k])

    return draw, made


def test_draws_until_the_batch_is_full_and_truncates():
    # size 3 groups: draw 0 has 1 varied group (#1), draw 1 has 3 (#0, #1, #3): keep 2 of them
    draw, made = _scripted([1, 1, 0, 1, 0, 0, 1, 1], [0, 1, 1, 0, 1, 1, 1, 0], [0, 1] * 4)
    kept, m = dynamic_sample(draw, lambda x: x, group=2, size=3, max_draws=5)
    assert made == [0, 1]
    assert [rows.tolist() for _, rows in kept] == [[2, 3], [0, 1, 2, 3]]
    assert m == {"filter/draws": 2.0, "filter/prompts_drawn": 8.0, "filter/groups_varied": 4.0,
                 "filter/groups_kept": 3.0, "filter/kept_frac": 0.5, "filter/short": 0.0}


def test_the_bound_on_draws_gives_a_smaller_batch():
    draw, made = _scripted([1, 1, 0, 1], [0, 0, 1, 1], [1, 0, 1, 0])
    kept, m = dynamic_sample(draw, lambda x: x, group=2, size=2, max_draws=2)
    assert made == [0, 1] and [rows.tolist() for _, rows in kept] == [[2, 3]]
    assert m["filter/groups_kept"] == 1.0 and m["filter/short"] == 1.0


def test_no_varied_group_at_all_keeps_the_last_draw_whole():
    draw, made = _scripted([1, 1, 0, 0], [0, 0, 0, 0])
    kept, m = dynamic_sample(draw, lambda x: x, group=2, size=2, max_draws=2)
    assert len(kept) == 1 and kept[0][0].tolist() == [0, 0, 0, 0] and kept[0][1].tolist() == [0, 1, 2, 3]
    assert m["filter/groups_kept"] == 0.0 and m["filter/short"] == 1.0 and m["filter/draws"] == 2.0


def test_size_zero_means_the_first_draw_s_group_count():
    draw, made = _scripted([1, 0, 1, 1], [0, 1, 1, 0])
    kept, m = dynamic_sample(draw, lambda x: x, group=2, size=0, max_draws=4)
    assert made == [0, 1] and m["filter/groups_kept"] == 2.0 and m["filter/short"] == 0.0
    assert [rows.tolist() for _, rows in kept] == [[0, 1], [0, 1]]


def test_max_draws_one_only_filters():
    draw, made = _scripted([1, 0, 1, 1, 0, 1])
    kept, m = dynamic_sample(draw, lambda x: x, group=2, size=3, max_draws=1)
    assert made == [0] and [rows.tolist() for _, rows in kept] == [[0, 1, 4, 5]]


def test_bad_bounds_are_clear_errors():
    draw, _ = _scripted([1, 0])
    with pytest.raises(AlgoError, match="max_draws=0"):
        dynamic_sample(draw, lambda x: x, group=2, size=1, max_draws=0)
    with pytest.raises(AlgoError, match="size=-1"):
        dynamic_sample(draw, lambda x: x, group=2, size=-1, max_draws=1)
