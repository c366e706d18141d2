"""DAPO's overlong reward shaping (Eq. 13) against hand-computed values."""

import pytest
import torch

from flowrl.algos import AlgoError, overlong_penalty


def _mask(lengths, width=12):
    m = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        m[i, 2 : 2 + n] = 1  # two prompt tokens first: only response tokens count
    return m


def test_overlong_penalty_hand_values():
    # L_max 8, L_cache 4: no penalty up to 4 tokens, then -(|y| - 4) / 4, and -1 beyond 8
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    out = overlong_penalty(rewards, _mask([3, 4, 5, 8, 10]), max_tokens=8, buffer=4)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, -0.25, 0.0, 0.0]))
    # scaled by the penalty factor
    out = overlong_penalty(rewards, _mask([3, 4, 5, 8, 10]), max_tokens=8, buffer=4, factor=0.5)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, -0.125, 0.5, 0.5]))


def test_overlong_penalty_is_continuous_at_both_ends():
    lengths = [4, 5, 7, 8]
    out = overlong_penalty(torch.zeros(4), _mask(lengths), max_tokens=8, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.25, -0.75, -1.0]))


def test_overlong_penalty_bad_options_are_clear():
    with pytest.raises(AlgoError, match="buffer=9, max_tokens=8"):
        overlong_penalty(torch.zeros(1), _mask([3]), max_tokens=8, buffer=9)
    with pytest.raises(AlgoError, match="factor=-1"):
        overlong_penalty(torch.zeros(1), _mask([3]), max_tokens=8, buffer=2, factor=-1)
    with pytest.raises(AlgoError, match="one reward per row"):
        overlong_penalty(torch.zeros(2), _mask([3]), max_tokens=8, buffer=2)
