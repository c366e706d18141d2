"""KL estimators (Schulman's k1/k2/k3, veRL's abs, k3 clamped as veRL does) and the KL penalty in the reward."""

import math

import pytest
import torch

from flowrl.algos import AlgoError, kl_abs, kl_estimate, kl_k1, kl_k2, kl_k3, kl_loss, kl_penalty_in_reward
from flowrl.algos.kl import KL_ESTIMATORS

LOGP = torch.tensor([[-1.0, -2.0]])
LOGQ = torch.tensor([[-1.5, -1.0]])


def close(actual, expected, atol=1e-6):
    """Element-wise comparison with a hand-written (possibly nested) list."""
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)



def test_k1_k2_k3_hand_values():
    # log p - log q = .5, -1
    close(kl_k1(LOGP, LOGQ), [[0.5, -1.0]])
    close(kl_k2(LOGP, LOGQ), [[0.125, 0.5]])
    # log r = log q - log p = -.5, 1: e^-.5 + .5 - 1 = .1065307, e - 2 = .7182818
    close(kl_k3(LOGP, LOGQ), [[0.1065307, 0.7182818]], atol=1e-6)
    close(kl_estimate(LOGP, LOGQ, "k2"), [[0.125, 0.5]])


def test_k1_and_k3_are_unbiased_under_the_policy():
    # Exact expectation over a 3-token vocabulary (no sampling): E_p[k] = sum_x p(x) k(x).
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    true_kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    for fn in (kl_k1, kl_k3):
        expectation = (p * fn(p.log(), q.log())).sum().item()
        assert expectation == pytest.approx(true_kl, abs=1e-6)


def test_k3_is_nonnegative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=gen), torch.randn(50, generator=gen)
    assert (kl_k3(a, b) >= 0).all()
    assert kl_k3(a, a).abs().max().item() == 0.0


def test_unknown_estimator_is_a_clear_error():
    with pytest.raises(AlgoError, match=r"unknown KL estimator 'k4'.*\['abs', 'k1', 'k2', 'k3'\]"):
        kl_estimate(LOGP, LOGQ, "k4")


def test_kl_penalty_in_reward_hand_example():
    # k1 = logp - logq = -2, .5, -1; the first position is a prompt token (mask 0).
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    logp = torch.tensor([[-3.0, -1.0, -2.0]])
    logq = torch.tensor([[-1.0, -1.5, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = kl_penalty_in_reward(rewards, logp, logq, mask, coef=0.1)
    close(out, [[0.0, -0.05, 1.1]])
    # with k2: .125, .5 on the response -> -.0125, .95
    out = kl_penalty_in_reward(rewards, logp, logq, mask, coef=0.1, kind="k2")
    close(out, [[0.0, -0.0125, 0.95]])


def test_kl_penalty_rejects_negative_coef():
    z = torch.zeros(1, 2)
    with pytest.raises(AlgoError, match="coef=-0.1 is negative"):
        kl_penalty_in_reward(z, z, z, z, coef=-0.1)


def test_abs_hand_values():
    # |log p - log q| = .5, 1
    close(kl_abs(LOGP, LOGQ), [[0.5, 1.0]])
    close(kl_estimate(LOGP, LOGQ, "abs"), [[0.5, 1.0]])


def test_k3_is_clamped_as_verl_clamps_it():
    # log q - log p = 100 is clamped to 20: e^20 - 21 = 4.85e8, then k3 to 10.
    logp = torch.tensor([[-100.0, 0.0, -1.0]], requires_grad=True)
    logq = torch.tensor([[0.0, -100.0, -1.5]])
    k = kl_k3(logp, logq)
    # the second token: log r = -100 -> -20: e^-20 + 20 - 1 = 19.0000..., clamped to 10
    close(k, [[10.0, 10.0, math.exp(-0.5) + 0.5 - 1.0]])
    assert kl_k3(torch.tensor([-30.0]), torch.tensor([-10.0])).item() == 10.0


def test_k3_loss_and_gradient_are_finite_for_an_impossible_reference_token():
    """The issue's case: a log-prob of -100 against 0 gave an inf KL loss and gradient before the clamp."""
    mask = torch.ones(1, 2)
    for logp_val, ref_val in ((-100.0, 0.0), (0.0, -100.0)):
        logp = torch.tensor([[logp_val, -1.0]], requires_grad=True)
        ref = torch.tensor([[ref_val, -1.2]])
        loss = kl_loss(logp, ref, mask, kind="k3")
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
        # the clamped token contributes 10 nats and no gradient (it stops pulling); the other one pulls
        assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0
        assert loss.item() == pytest.approx((10.0 + math.exp(-0.2) + 0.2 - 1.0) / 2, abs=1e-6)


def test_every_catalogue_estimator_has_a_function_and_works_in_reward_and_loss():
    from flowrl.catalog.losses import KL_ESTIMATORS as CATALOGUE

    assert tuple(KL_ESTIMATORS) == CATALOGUE
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    logp = torch.tensor([[-3.0, -1.0, -2.0]], requires_grad=True)
    logq = torch.tensor([[-1.0, -1.5, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    expected = {"k1": [0.5, -1.0], "k2": [0.125, 0.5], "abs": [0.5, 1.0],
                "k3": [math.exp(-0.5) + 0.5 - 1.0, math.e - 2.0]}
    for kind in CATALOGUE:
        shaped = kl_penalty_in_reward(rewards, logp, logq, mask, coef=0.1, kind=kind)
        close(shaped, [[0.0, -0.1 * expected[kind][0], 1.0 - 0.1 * expected[kind][1]]])
        loss = kl_loss(logp, logq, mask, kind=kind)
        assert loss.item() == pytest.approx(sum(expected[kind]) / 2, abs=1e-6)
        assert torch.autograd.grad(loss, logp)[0].abs().sum() > 0
