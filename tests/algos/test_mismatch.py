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


# -- importance corrections (TIS, MIS, sequence-level IS) and their statistics ------------

from flowrl.algos import importance_correction  # noqa: E402

# token log-ratios train - rollout on the response: row 0: .1, -.5 ; row 1: 0, -1
RHO = [math.exp(0.1), math.exp(-0.5), math.exp(0.0), math.exp(-1.0)]


def test_statistics_without_a_correction():
    w, m = importance_correction(TRAIN, ROLLOUT, MASK)
    assert w is None
    assert m["offpolicy_ratio_mean"] == pytest.approx(sum(RHO) / 4, abs=1e-6)
    assert m["offpolicy_ratio_max"] == pytest.approx(math.exp(0.1), abs=1e-6)
    assert m["offpolicy_ratio_min"] == pytest.approx(math.exp(-1.0), abs=1e-6)
    assert m["offpolicy_kl"] == pytest.approx(mismatch_metrics(TRAIN, ROLLOUT, MASK)["mismatch_kl"], abs=1e-7)
    assert "offpolicy_clipped_frac" not in m and "offpolicy_masked_frac" not in m


def test_tis_token_level_equals_tis_weights():
    w, m = importance_correction(TRAIN, ROLLOUT, MASK, tis=1.05)
    torch.testing.assert_close(w, tis_weights(TRAIN, ROLLOUT, MASK, cap=1.05))
    assert m["offpolicy_clipped_frac"] == pytest.approx(1 / 4)  # e^.1 = 1.105 > 1.05
    assert m["offpolicy_weight_mean"] == pytest.approx((1.05 + RHO[1] + 1.0 + RHO[3]) / 4, abs=1e-6)


def test_mis_token_level_masks_outside_the_band():
    # band [1/1.5, 1.5] = [.667, 1.5]: e^-.5 = .607 and e^-1 = .368 are outside
    w, m = importance_correction(TRAIN, ROLLOUT, MASK, mis=1.5)
    torch.testing.assert_close(w, torch.tensor([[RHO[0], 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert m["offpolicy_masked_frac"] == pytest.approx(2 / 4)
    # an explicit lower bound .5 keeps e^-.5
    w, m = importance_correction(TRAIN, ROLLOUT, MASK, mis=1.5, mis_low=0.5)
    torch.testing.assert_close(w, torch.tensor([[RHO[0], RHO[1], 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert m["offpolicy_masked_frac"] == pytest.approx(1 / 4)


def test_sequence_and_geometric_levels():
    # row sums of log-ratios: -.4 and -1; geometric means: -.2 and -.5
    w, m = importance_correction(TRAIN, ROLLOUT, MASK, tis=5.0, level="sequence")
    s0, s1 = math.exp(-0.4), math.exp(-1.0)
    torch.testing.assert_close(w, torch.tensor([[s0, s0, 0.0], [s1, s1, 0.0]]), atol=1e-6, rtol=0)
    assert m["offpolicy_seq_ratio_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-6)
    assert m["offpolicy_seq_ratio_max"] == pytest.approx(s0, abs=1e-6)
    # geometric mean with MIS band [.7, 1.43]: e^-.2 = .819 kept, e^-.5 = .607 masked (a whole sequence)
    w, m = importance_correction(TRAIN, ROLLOUT, MASK, mis=1 / 0.7, level="geometric")
    g0 = math.exp(-0.2)
    torch.testing.assert_close(w, torch.tensor([[g0, g0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert m["offpolicy_masked_frac"] == pytest.approx(2 / 4)


def test_mis_then_tis_and_huge_sequence_ratios_stay_finite():
    train = torch.zeros(2, 30)
    rollout = torch.full((2, 30), -5.0)  # a sequence ratio of e^150: clamped at e^20, then masked
    rollout[1] = 0.0
    w, m = importance_correction(train, rollout, torch.ones(2, 30), tis=2.0, mis=100.0, level="sequence")
    assert torch.isfinite(w).all() and w[0].abs().sum() == 0 and (w[1] == 1.0).all()
    assert m["offpolicy_seq_ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert m["offpolicy_masked_frac"] == pytest.approx(0.5) and m["offpolicy_clipped_frac"] == 0.0


def test_micro_batch_statistics_add_up():
    from flowrl.algos.losses import combine_metrics, global_denominator

    g = torch.Generator().manual_seed(1)
    train, rollout = torch.randn(6, 5, generator=g) * 0.3, torch.randn(6, 5, generator=g) * 0.3
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    for level in ("token", "geometric"):
        _, whole = importance_correction(train, rollout, mask, tis=1.2, mis=2.5, level=level)
        denom, total = global_denominator(mask), {}
        for rows in (slice(0, 2), slice(2, 6)):
            combine_metrics(total, importance_correction(train[rows], rollout[rows], mask[rows], tis=1.2, mis=2.5,
                                                         level=level, denominator=denom)[1])
        for key, value in whole.items():
            assert total[key] == pytest.approx(value, rel=1e-5), key


def test_bad_correction_options_are_clear_errors():
    with pytest.raises(AlgoError, match="unknown level 'row'"):
        importance_correction(TRAIN, ROLLOUT, MASK, level="row")
    with pytest.raises(AlgoError, match="mis=-1, mis_low=0.0; hint: the band's bounds are >= 0"):
        importance_correction(TRAIN, ROLLOUT, MASK, mis=-1)
    with pytest.raises(AlgoError, match="tis=-1"):
        importance_correction(TRAIN, ROLLOUT, MASK, tis=-1)
