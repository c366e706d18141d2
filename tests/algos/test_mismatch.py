"""Train-vs-rollout mismatch metrics and truncated importance weights."""

import math

import pytest
import torch

from flowrl.algos import AlgoError, mismatch_metrics, tis_weights

TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
ROLLOUT = torch.tensor([[-1.1, -1.5, -9.0], [-0.2, -2.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_mismatch_metrics_hand_values():
    # |train - rollout| on response tokens: .1, .5, 0, 1 (the 8.5 gap sits on padding)
    # k3 with p = rollout, q = train, log r = train - rollout = .1, -.5, 0, -1:
    #   e^.1 - 1.1 = .0051709, e^-.5 - .5 = .1065307, 0, e^-1 = .3678794
    m = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    assert m["mismatch_abs_mean"] == pytest.approx(1.6 / 4, abs=1e-6)
    assert m["mismatch_abs_max"] == pytest.approx(1.0, abs=1e-6)
    assert m["mismatch_kl"] == pytest.approx((0.0051709 + 0.1065307 + 0.0 + 0.3678794) / 4, abs=1e-6)


def test_mismatch_metrics_identical_and_empty():
    zeros = {"mismatch_abs_mean": 0.0, "mismatch_abs_max": 0.0, "mismatch_kl": 0.0}
    assert mismatch_metrics(TRAIN, TRAIN, MASK) == zeros
    assert mismatch_metrics(TRAIN, ROLLOUT, torch.zeros_like(MASK)) == zeros


def test_tis_weights_hand_values():
    # exp(train - rollout) = e^.1, e^-.5, (padding -> 0); e^0, e^-1 -> capped only above 2
    w = tis_weights(TRAIN, ROLLOUT, MASK, cap=2.0)
    expected = [[math.exp(0.1), math.exp(-0.5), 0.0], [1.0, math.exp(-1.0), 0.0]]
    torch.testing.assert_close(w, torch.tensor(expected), atol=1e-6, rtol=0)


def test_tis_weights_truncate_detach_and_survive_huge_gaps():
    train = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[-0.5, -200.0, -0.1]])  # e^200 would overflow float32
    w = tis_weights(train, rollout, torch.ones(1, 3), cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, math.exp(0.1)]]), atol=1e-6, rtol=0)
    assert not w.requires_grad


def test_tis_bad_cap_is_a_clear_error():
    with pytest.raises(AlgoError, match="cap=0; hint"):
        tis_weights(TRAIN, ROLLOUT, MASK, cap=0)
