"""Losses against hand-computed numbers; clip boundaries; micro-batch exactness."""

import math

import pytest
import torch

from flowrl.algos import (
    AlgoError,
    aggregate,
    cispo_loss,
    entropy_bonus,
    global_denominator,
    gspo_loss,
    kl_loss,
    pg_loss,
    ppo_clip_loss,
    tis_weights,
    value_loss,
)

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def close(actual, expected, atol=1e-6):
    """Element-wise comparison with a hand-written (possibly nested) list."""
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# -- aggregate ---------------------------------------------------------------------

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "agg, own, global_",
    [
        ("token-mean", 7 / 3, 7 / 10),  # (1+2+4) / 3 tokens, or / 10
        ("seq-mean-token-sum", 3.5, 1.75),  # (3 + 4) / 2 rows, or / 4
        ("seq-mean-token-mean", 2.75, 1.375),  # (1.5 + 4) / 2 rows, or / 4
    ],
)
def test_aggregate_hand_values(agg, own, global_):
    assert aggregate(X, M, agg).item() == pytest.approx(own)
    assert aggregate(X, M, agg, {"tokens": 10, "sequences": 4}).item() == pytest.approx(global_)


def test_aggregate_errors_are_clear():
    with pytest.raises(AlgoError, match=r"unknown aggregation 'mean'.*'seq-mean-token-mean'"):
        aggregate(X, M, "mean")
    with pytest.raises(AlgoError, match="lacks 'tokens'; hint: use global_denominator"):
        aggregate(X, M, "token-mean", {"sequences": 2})
    with pytest.raises(AlgoError, match=r"shapes differ: per_token\[2, 3\], response_mask\[2, 2\]"):
        aggregate(X, M[:, :2])


def test_global_denominator():
    assert global_denominator(M) == {"tokens": 3.0, "sequences": 2.0}


# -- PPO clip ----------------------------------------------------------------------

# row 0: ratios 1.5, .7, 1.1 with A = 1, 1, -2
#   1.5: max(-1.5, -1.2) = -1.2 (clipped); .7: max(-.7, -.8) = -.7; 1.1: max(2.2, 2.2) = 2.2
# row 1: ratios .5, 1.0, (3.0 on padding) with A = -1, 3, 0
#   .5: max(.5, .8) = .8 (clipped); 1.0: -3.0
RATIOS = torch.tensor([[1.5, 0.7, 1.1], [0.5, 1.0, 3.0]])
ADV = torch.tensor([[1.0, 1.0, -2.0], [-1.0, 3.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]])
NEW = OLD + RATIOS.log()


@pytest.mark.parametrize(
    "agg, expected",
    [
        ("token-mean", -1.9 / 5),  # (-1.2 - .7 + 2.2 + .8 - 3) / 5
        ("seq-mean-token-sum", (0.3 - 2.2) / 2),
        ("seq-mean-token-mean", (0.3 / 3 - 2.2 / 2) / 2),
    ],
)
def test_ppo_clip_hand_values(agg, expected):
    loss, metrics = ppo_clip_loss(NEW, OLD, ADV, MASK, agg=agg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)
    assert metrics["ratio_max"] == pytest.approx(1.5)  # 3.0 sits on padding
    assert metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.7 + 1.1 + 0.5 + 1.0) / 5)
    # k3 of KL[old || new]: r - 1 - log r per token
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.7, 1.1, 0.5, 1.0)]
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 5, abs=1e-6)
    assert metrics["dual_clipfrac"] == 0.0


def test_ppo_clip_higher_is_asymmetric():
    # clip_high .28: ratio 1.5 with A=1 -> -1.28 instead of -1.2; the low side is unchanged.
    loss, _ = ppo_clip_loss(NEW, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.7 + 2.2 + 0.8 - 3.0) / 5, abs=1e-6)


def test_ppo_dual_clip_bounds_negative_advantages():
    # A=-1, ratio 5: max(5, 1.2) = 5, dual bound 3 -> 3.  A=-1, ratio 2: 2 < 3 stays.
    # A=+1, ratio 5: max(-5, -1.2) = -1.2, dual clip never applies to A > 0.
    old = torch.zeros(1, 3)
    new = torch.tensor([[5.0, 2.0, 5.0]]).log()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = ppo_clip_loss(new, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.2, abs=1e-5)
    assert metrics["dual_clipfrac"] == pytest.approx(1 / 3)
    plain, _ = ppo_clip_loss(new, old, adv, mask, agg="seq-mean-token-sum")
    assert plain.item() == pytest.approx(5.0 + 2.0 - 1.2, abs=1e-5)


@pytest.mark.parametrize(
    "ratio, adv, grad_is_zero",
    [
        (1.3, 1.0, True),  # above 1 + eps with A > 0: clipped, no push further up
        (1.1, 1.0, False),  # inside the trust region
        (0.7, -1.0, True),  # below 1 - eps with A < 0: clipped, no push further down
        (0.9, -1.0, False),
        (1.5, -1.0, False),  # A < 0 and ratio high: the pessimistic unclipped term keeps the gradient
        (0.5, 1.0, False),  # A > 0 and ratio low: same
    ],
)
def test_ppo_clip_gradient_at_boundaries(ratio, adv, grad_is_zero):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1))
    loss.backward()
    # d/dlogp of -A * exp(logp - old) = -A * ratio
    expected = 0.0 if grad_is_zero else -adv * ratio
    assert logp.grad.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("ratio", [0.8, 1.2])
def test_ppo_clip_value_is_continuous_at_the_boundary(ratio):
    for adv in (1.0, -1.0):
        loss, m = ppo_clip_loss(
            torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1)
        )
        assert loss.item() == pytest.approx(-adv * ratio, abs=1e-6)
        assert m["clipfrac"] == 0.0


def test_ppo_sequence_advantages_broadcast():
    adv_rows = torch.tensor([0.5, -1.0])
    a, _ = ppo_clip_loss(NEW, OLD, adv_rows, MASK)
    b, _ = ppo_clip_loss(NEW, OLD, adv_rows[:, None] * MASK, MASK)
    assert a.item() == pytest.approx(b.item())


def test_ppo_is_weights_multiply_per_token():
    # row 0 per-token losses -1.2, -.7, 2.2 times weights 2, .5, 1
    w = torch.tensor([[2.0, 0.5, 1.0], [1.0, 1.0, 1.0]])
    loss, _ = ppo_clip_loss(NEW, OLD, ADV, MASK, is_weights=w, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx((-2.4 - 0.35 + 2.2 + 0.8 - 3.0) / 2, abs=1e-6)


def test_ppo_with_tis_weights_from_rollout_logprobs():
    rollout = OLD - torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # token (0,1): weight e^1 capped at 2
    w = tis_weights(OLD, rollout, MASK, cap=2.0)
    loss, _ = ppo_clip_loss(NEW, OLD, ADV, MASK, is_weights=w, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx((-1.2 - 1.4 + 2.2 + 0.8 - 3.0) / 2, abs=1e-6)


def test_ppo_bad_options_are_clear_errors():
    with pytest.raises(AlgoError, match="clip_low=1.5"):
        ppo_clip_loss(NEW, OLD, ADV, MASK, clip_low=1.5)
    with pytest.raises(AlgoError, match="dual_clip=0.5; hint: the dual-clip constant c must be > 1"):
        ppo_clip_loss(NEW, OLD, ADV, MASK, dual_clip=0.5)
    with pytest.raises(AlgoError, match=r"old_logprobs\[2, 2\]"):
        ppo_clip_loss(NEW, OLD[:, :2], ADV, MASK)


# -- GSPO ---------------------------------------------------------------------------

# row 0: 2 tokens, log-ratios .1, -.3 -> mean -.1: s = e^-.1 = .9048374, inside [.8, 1.2]
# row 1: 3 tokens, log-ratios .5, .5, .2 -> mean .4: s = e^.4 = 1.4918247, clipped to 1.2 (A > 0)
G_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
G_OLD = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -1.0]])
G_NEW = G_OLD + torch.tensor([[0.1, -0.3, 4.0], [0.5, 0.5, 0.2]])  # the 4.0 sits on padding


def test_gspo_hand_values_and_gradient():
    new = G_NEW.clone().requires_grad_(True)
    loss, m = gspo_loss(new, G_OLD, torch.tensor([1.0, 1.0]), G_MASK, clip_low=0.2, clip_high=0.2)
    s0 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-s0 - 1.2) / 2, abs=1e-6)  # mean over the two sequences (Eq. 5)
    assert m["clipfrac"] == pytest.approx(3 / 5)  # row 1's three tokens
    assert m["seq_ratio_max"] == pytest.approx(math.exp(0.4), abs=1e-6)
    assert m["seq_ratio_min"] == pytest.approx(s0, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, new)
    # d/d log pi_t of -s0 / 2, with d s0 / d log pi_t = s0 / |y_0| = s0 / 2; the clipped row: 0
    close(grad, [[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_clips_whole_sequences_not_tokens():
    # one token of row 0 moves far (log-ratio 1.0) but the sequence mean stays inside the range
    old = torch.zeros(1, 4)
    new = torch.tensor([[1.0, -0.3, -0.35, -0.33]])
    loss, m = gspo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 4), clip_low=0.2, clip_high=0.2)
    assert m["clipfrac"] == 0.0
    _, m_tok = ppo_clip_loss(new, old, torch.tensor([1.0]), torch.ones(1, 4), clip_low=0.2)
    assert m_tok["clipfrac"] == 0.25  # the token-level clip would have cut that token


def test_gspo_token_advantages_weight_each_token():
    # GSPO-token (Eq. 13-14): value s_i on every token, per-token advantages in the gradient
    new = torch.zeros(1, 2, requires_grad=True)
    loss, _ = gspo_loss(new, torch.zeros(1, 2), torch.tensor([[1.0, -3.0]]), torch.ones(1, 2), agg="token-mean")
    assert loss.item() == pytest.approx((-1.0 + 3.0) / 2)
    close(torch.autograd.grad(loss, new)[0], [[-0.5, 1.5]])


# -- CISPO ------------------------------------------------------------------------

# ratios 2, .5, 6 with clip_high 4: weights 2, .5, 5; A = 1, -1, 1; log pi = -1, -2, -.5
C_NEW = torch.tensor([[-1.0, -2.0, -0.5]])
C_OLD = C_NEW - torch.tensor([[math.log(2.0), math.log(0.5), math.log(6.0)]])
C_ADV = torch.tensor([[1.0, -1.0, 1.0]])


def test_cispo_hand_values_and_gradient():
    new = C_NEW.clone().requires_grad_(True)
    loss, m = cispo_loss(new, C_OLD, C_ADV, torch.ones(1, 3), clip_high=4.0)
    # -w A log pi: -(2)(1)(-1) = 2, -(.5)(-1)(-2) = -1, -(5)(1)(-.5) = 2.5 -> mean 3.5 / 3
    assert loss.item() == pytest.approx(3.5 / 3, abs=1e-6)
    assert m["clipfrac"] == pytest.approx(1 / 3) and m["ratio_max"] == pytest.approx(6.0, abs=1e-5)
    # every token keeps a gradient, the clipped one too (weighted by 5, not dropped)
    close(torch.autograd.grad(loss, new)[0], [[-2 / 3, 0.5 / 3, -5 / 3]])


def test_cispo_lower_bound_is_optional():
    loss, m = cispo_loss(C_NEW, C_OLD, C_ADV, torch.ones(1, 3), clip_low=0.2, clip_high=4.0)
    # ratio .5 is raised to .8: -(.8)(-1)(-2) = -1.6
    assert loss.item() == pytest.approx((2.0 - 1.6 + 2.5) / 3, abs=1e-6)
    assert m["clipfrac"] == pytest.approx(2 / 3)


def test_pg_loss_is_reinforce():
    new = C_NEW.clone().requires_grad_(True)
    loss, _ = pg_loss(new, C_ADV, torch.ones(1, 3))
    assert loss.item() == pytest.approx((1.0 - 2.0 + 0.5) / 3)
    close(torch.autograd.grad(loss, new)[0], [[-1 / 3, 1 / 3, -1 / 3]])


def test_new_losses_bad_options_are_clear_errors():
    with pytest.raises(AlgoError, match="clip_high=-1"):
        cispo_loss(C_NEW, C_OLD, C_ADV, torch.ones(1, 3), clip_high=-1)
    with pytest.raises(AlgoError, match="clip_low=1.5"):
        cispo_loss(C_NEW, C_OLD, C_ADV, torch.ones(1, 3), clip_low=1.5)
    with pytest.raises(AlgoError, match="clip_low=2"):
        gspo_loss(G_NEW, G_OLD, torch.ones(2), G_MASK, clip_low=2)
    with pytest.raises(AlgoError, match=r"old_logprobs\[2, 2\]"):
        gspo_loss(G_NEW, G_OLD[:, :2], torch.ones(2), G_MASK)


# -- value, KL, entropy -------------------------------------------------------------


def test_value_loss_hand_values():
    # t0: err .04, V_clip = .9 + .1 = 1.0 -> .04 -> .02
    # t1: err 1, V_clip = 1.5 + .2 = 1.7 -> .49; max 1 -> .5
    # t2: err 0, V_clip = .5 + .2 = .7 -> .09 (the clipped error wins) -> .045
    values = torch.tensor([[1.0, 2.0, 1.0]])
    old = torch.tensor([[0.9, 1.5, 0.5]])
    returns = torch.tensor([[1.2, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx((0.02 + 0.5 + 0.045) / 3, abs=1e-6)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["value_mean"] == pytest.approx(4 / 3)
    loss, _ = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == pytest.approx((0.02 + 0.5 + 0.0) / 3, abs=1e-6)
    with pytest.raises(AlgoError, match="clip=0; hint"):
        value_loss(values, old, returns, mask, clip=0)


def test_kl_loss_hand_values():
    # k3 of (logp, logq) = (-1, -1.5): .1065307, (-2, -1): .7182818; third token masked
    logp = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = kl_loss(logp, ref, mask, kind="k3")
    assert loss.item() == pytest.approx((0.1065307 + 0.7182818) / 2, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(logq - logp), halved by the token mean; 0 on the masked token
    close(logp.grad, [[(1 - math.exp(-0.5)) / 2, (1 - math.e) / 2, 0.0]])
    assert kl_loss(logp, ref, mask, kind="k1").item() == pytest.approx((0.5 - 1.0) / 2)


def test_entropy_bonus():
    ent = torch.tensor([[0.5, 1.5, 9.0], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert entropy_bonus(ent, mask).item() == pytest.approx(4.0 / 3)
    assert entropy_bonus(ent, mask, "seq-mean-token-mean").item() == pytest.approx((1.0 + 2.0) / 2)


# -- micro-batching -----------------------------------------------------------------


def _batch(seed, b=7, t=8):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        p = int(torch.randint(1, 4, (1,), generator=gen))
        r = int(torch.randint(0, t - p + 1, (1,), generator=gen))  # r = 0: an empty row
        mask[i, p : p + r] = 1

    def rnd(scale=1.0):
        return torch.randn(b, t, generator=gen, dtype=torch.float64) * scale

    return mask, {
        "logprobs": (rnd(0.3) - 1.0).requires_grad_(True),
        "old": rnd(0.3) - 1.0,
        "ref": rnd(0.3) - 1.0,
        "adv": rnd(),
        "values": rnd().requires_grad_(True),
        "old_values": rnd(),
        "returns": rnd(),
        "entropy": rnd().abs().requires_grad_(True),
        "w": rnd().abs(),
    }


def _all_losses(x, mask, rows, agg, denominator):
    sel = {k: v[rows] for k, v in x.items()}
    m = mask[rows]
    pg, _ = ppo_clip_loss(
        sel["logprobs"], sel["old"], sel["adv"], m, clip_high=0.28, dual_clip=3.0,
        agg=agg, denominator=denominator, is_weights=sel["w"],
    )
    vf, _ = value_loss(sel["values"], sel["old_values"], sel["returns"], m, agg=agg, denominator=denominator)
    kl = kl_loss(sel["logprobs"], sel["ref"], m, agg=agg, denominator=denominator)
    ent = entropy_bonus(sel["entropy"], m, agg=agg, denominator=denominator)
    gspo, _ = gspo_loss(sel["logprobs"], sel["old"], sel["adv"], m, clip_low=0.05, clip_high=0.1, agg=agg,
                        denominator=denominator, is_weights=sel["w"])
    cispo, _ = cispo_loss(sel["logprobs"], sel["old"], sel["adv"], m, clip_low=0.2, clip_high=0.5, agg=agg,
                          denominator=denominator, is_weights=sel["w"])
    return torch.stack([pg, vf, kl, ent, gspo, cispo])


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", range(3))
def test_micro_batch_sum_equals_full_batch(agg, seed):
    mask, x = _batch(seed)
    full = _all_losses(x, mask, slice(None), agg, None)
    full_grads = torch.autograd.grad(full.sum(), [x["logprobs"], x["values"], x["entropy"]])

    denominator = global_denominator(mask)
    parts = [_all_losses(x, mask, rows, agg, denominator) for rows in (slice(0, 2), slice(2, 5), slice(5, 7))]
    summed = torch.stack(parts).sum(dim=0)
    torch.testing.assert_close(summed, full, atol=1e-12, rtol=0)
    micro_grads = torch.autograd.grad(summed.sum(), [x["logprobs"], x["values"], x["entropy"]])
    for g_micro, g_full in zip(micro_grads, full_grads):
        torch.testing.assert_close(g_micro, g_full, atol=1e-12, rtol=0)


def test_micro_batch_without_denominator_is_not_the_full_batch():
    # Why the denominator exists: per-micro-batch means do not sum to the global mean.
    mask, x = _batch(0)
    full = _all_losses(x, mask, slice(None), "token-mean", None)
    parts = sum(_all_losses(x, mask, rows, "token-mean", None) for rows in (slice(0, 2), slice(2, 7)))
    assert not torch.allclose(parts, full)


def test_micro_batch_metrics_add_up_to_the_whole_batch():
    """Split into micro-batches with the global denominator, combine_metrics gives the whole batch's metrics."""
    from flowrl.algos.losses import combine_metrics, global_denominator

    g = torch.Generator().manual_seed(3)
    lp = torch.randn(6, 5, generator=g) * 0.3
    old = lp + torch.randn(6, 5, generator=g) * 0.3
    adv = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    _, whole = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2)
    denom = global_denominator(mask)
    total: dict = {}
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        _, part = ppo_clip_loss(lp[rows], old[rows], adv[rows], mask[rows], clip_low=0.2, denominator=denom)
        combine_metrics(total, part)
    for key in ("pg_loss", "clipfrac", "approx_kl", "ratio_mean", "ratio_max", "ratio_min"):
        assert total[key] == pytest.approx(whole[key], rel=1e-5), key
    assert 0.0 < total["clipfrac"] < 1.0  # the clip is active on some tokens, so the check above is not vacuous
