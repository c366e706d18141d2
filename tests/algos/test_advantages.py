"""Advantage estimators against hand-computed numbers, plus property tests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.algos import (
    AlgoError,
    broadcast_to_tokens,
    gae,
    group_advantages,
    last_response_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_reward_to_tokens,
)

PROPERTY = settings(derandomize=True, max_examples=60, deadline=None)


def close(actual, expected, atol=1e-6):
    """Element-wise comparison with a hand-written (possibly nested) list."""
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)



def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# -- masked reductions ------------------------------------------------------------


def test_masked_mean_sum_var():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    m = t([1, 0, 1], [0, 0, 1])
    assert masked_sum(x, m).item() == pytest.approx(10.0)
    assert masked_mean(x, m).item() == pytest.approx(10.0 / 3)
    close(masked_mean(x, m, dim=1), [2.0, 6.0])
    # values 1, 3, 6: mean 10/3, deviations -7/3, -1/3, 8/3, squares sum 114/9
    assert masked_var(x, m).item() == pytest.approx(114 / 9 / 2)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(114 / 9 / 3)


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(t([1.0, 2.0]), t([0, 0])).item() == 0.0


def test_masked_whiten():
    # masked values 1, 2, 3: mean 2, unbiased std 1 -> -1, 0, 1; the padded 100 is zeroed.
    out = masked_whiten(t([1.0, 2.0, 3.0, 100.0]), t([1, 1, 1, 0]))
    close(out, [[-1.0, 0.0, 1.0, 0.0]])
    out = masked_whiten(t([1.0, 2.0, 3.0, 100.0]), t([1, 1, 1, 0]), shift_mean=False)
    close(out, [[1.0, 2.0, 3.0, 0.0]])


# -- GRPO / Dr.GRPO / RLOO ---------------------------------------------------------


def test_group_advantages_hand_example_with_arbitrary_ids():
    # groups: id 7 -> rewards 1, 0, 1, 0 (mean .5, unbiased std sqrt(1/3));
    # id 9 -> 3, 1 (mean 2, std sqrt 2); id 3 -> 5, 5, 5 (std 0 -> advantage 0).
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0, 1.0, 5.0, 1.0, 0.0, 5.0])
    ids = torch.tensor([7, 9, 7, 3, 7, 3, 9, 7, 3])
    a = 0.5 / (1 / 3) ** 0.5
    b = 1.0 / 2**0.5
    expected = [a, b, -a, 0.0, a, 0.0, -b, -a, 0.0]
    close(group_advantages(rewards, ids), expected, atol=2e-6)


def test_dr_grpo_is_mean_centred_only():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0])
    out = group_advantages(rewards, torch.tensor([0, 0, 0, 0, 1, 1]), normalize_std=False)
    close(out, [0.5, -0.5, 0.5, -0.5, 1.0, -1.0])


def test_group_size_int_means_consecutive_blocks():
    out = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2)
    b = 0.5 / (0.5**0.5)  # deviation .5, unbiased std sqrt(.5)
    close(out, [-b, b, -b, b], atol=2e-6)


def test_group_advantages_singleton_group_is_zero():
    out = group_advantages(torch.tensor([4.0, 1.0, 2.0]), torch.tensor([0, 1, 1]))
    assert out[0].item() == 0.0


def test_bad_group_size_is_a_clear_error():
    with pytest.raises(AlgoError, match="group size 3 does not divide 4"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(AlgoError, match=r"group_ids has shape \[3\]"):
        rloo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))


def test_rloo_hand_example():
    # group 0: 1, 0, 1, 0 -> r_i - mean(others): 1 - 1/3, 0 - 2/3, ...; group 1: 3, 1 -> 2, -2; group 2: singleton -> 0.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0, 4.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    expected = [2 / 3, -2 / 3, 2 / 3, -2 / 3, 2.0, -2.0, 0.0]
    close(rloo_advantages(rewards, ids), expected)


def _loo_loop(rewards, ids):
    out = []
    for i, (r, g) in enumerate(zip(rewards, ids)):
        others = [rj for j, (rj, gj) in enumerate(zip(rewards, ids)) if gj == g and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


rewards_and_ids = st.lists(
    st.tuples(st.floats(-10, 10, allow_nan=False, width=32), st.integers(0, 4)), min_size=1, max_size=24
)


@PROPERTY
@given(rewards_and_ids)
def test_grpo_zero_mean_per_group(pairs):
    rewards = torch.tensor([p[0] for p in pairs])
    ids = torch.tensor([p[1] for p in pairs])
    for normalize in (True, False):
        adv = group_advantages(rewards, ids, normalize_std=normalize)
        for g in ids.unique():
            assert adv[ids == g].mean().item() == pytest.approx(0.0, abs=1e-3)


@PROPERTY
@given(rewards_and_ids)
def test_rloo_matches_loop(pairs):
    rewards = [p[0] for p in pairs]
    ids = [p[1] for p in pairs]
    out = rloo_advantages(torch.tensor(rewards), torch.tensor(ids))
    close(out, _loo_loop(rewards, ids), atol=1e-4)


# -- token placement ---------------------------------------------------------------

MASK = t([0, 0, 1, 1, 1], [0, 1, 1, 0, 0])  # row 0: prompt 2 + response 3; row 1: prompt 1 + response 2 + pad 2


def test_last_response_index_and_sequence_reward_to_tokens():
    assert last_response_index(MASK).tolist() == [4, 2]
    out = sequence_reward_to_tokens(torch.tensor([1.0, -1.0]), MASK)
    assert out.tolist() == [[0, 0, 0, 0, 1.0], [0, 0, -1.0, 0, 0]]


def test_sequence_reward_to_tokens_rejects_empty_rows():
    with pytest.raises(AlgoError, match="row 1 has no response token"):
        sequence_reward_to_tokens(torch.tensor([1.0, 2.0]), t([0, 1], [0, 0]))


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([0.5, -2.0]), MASK)
    assert out.tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, -2.0, -2.0, 0, 0]]
    with pytest.raises(AlgoError, match="one advantage per row"):
        broadcast_to_tokens(torch.zeros(3), MASK)


# -- REINFORCE++ ------------------------------------------------------------------


def test_reinforce_pp_sequence_rewards_discounted_unwhitened():
    # gamma .5: row 0 reward 1 on t=4 -> returns .25, .5, 1; row 1 reward -1 on t=2 -> -.5, -1.
    out = reinforce_pp_advantages(torch.tensor([1.0, -1.0]), MASK, gamma=0.5, whiten=False)
    close(out, [[0, 0, 0.25, 0.5, 1.0], [0, -0.5, -1.0, 0, 0]])


def test_reinforce_pp_whitened_globally():
    # response returns .25 .5 1 -.5 -1: mean .05, unbiased std .798436
    out = reinforce_pp_advantages(torch.tensor([1.0, -1.0]), MASK, gamma=0.5)
    expected = [[0, 0, 0.2504897, 0.5636019, 1.1898261], [0, -0.6888467, -1.3150710, 0, 0]]
    close(out, expected, atol=1e-6)


def test_reinforce_pp_token_rewards_ignore_prompt_positions():
    # token rewards (e.g. outcome minus per-token KL); the 7.0 on a prompt token is ignored.
    rewards = t([7.0, 0.0, 0.1, -0.2, 1.0], [0.0, 0.3, -0.1, 9.0, 0.0])
    out = reinforce_pp_advantages(rewards, MASK, gamma=1.0, whiten=False)
    close(out, [[0, 0, 0.9, 0.8, 1.0], [0, 0.2, -0.1, 0, 0]])


# -- REINFORCE++-baseline ----------------------------------------------------------

BASE_MASK = t([0, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 1])  # 1, 2, 1, 2 response tokens


def test_reinforce_pp_baseline_hand_example():
    # groups of 2: rewards 1, 0 | 1, 1 -> minus the group mean: .5, -.5 | 0, 0
    # on tokens: .5 | -.5 -.5 | 0 | 0 0: mean -1/12, squares of deviations
    # (7/12)^2 + 2 (5/12)^2 + 3 (1/12)^2 = 102/144, unbiased var 102/720, std .3763863
    out = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, BASE_MASK)
    std = (102 / 720) ** 0.5
    hi, lo, zero = (7 / 12) / std, (-5 / 12) / std, (1 / 12) / std
    close(out, [[0, hi, 0, 0], [0, lo, lo, 0], [zero, 0, 0, 0], [0, 0, zero, zero]])


def test_reinforce_pp_baseline_sums_token_rewards_and_keeps_singletons():
    # token rewards sum per row to 1, 0 (group "a") and 2 (alone in group "b": baseline 0, kept)
    tok = t([0.5, 0.5, 0, 0], [0, -0.25, 0.25, 0], [2.0, 0, 0, 0])
    mask = BASE_MASK[:3]
    ids = torch.tensor([3, 3, 9])
    out = reinforce_pp_baseline_advantages(tok, ids, mask)
    ref = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 2.0]), ids, mask)
    close(out, ref.tolist())
    # centred .5, -.5, 2 on 1 + 2 + 1 tokens: whitened with their token-weighted mean and std
    centred = broadcast_to_tokens(torch.tensor([0.5, -0.5, 2.0]), mask)
    close(out, masked_whiten(centred, mask).tolist())


def test_reinforce_pp_baseline_bad_shapes_are_clear():
    with pytest.raises(AlgoError, match="one reward"):
        reinforce_pp_baseline_advantages(torch.zeros(3), 1, BASE_MASK)
    with pytest.raises(AlgoError, match="group size 3 does not divide 4"):
        reinforce_pp_baseline_advantages(torch.zeros(4), 3, BASE_MASK)


# -- GAE ---------------------------------------------------------------------------


def test_gae_hand_example():
    # gamma .9, lam .8 (gamma*lam = .72)
    # row 0 (response t=1..3): d3 = 1 - .7 = .3; d2 = .9*.7 - .6 = .03; d1 = .9*.6 - .5 = .04
    #   A3 = .3, A2 = .03 + .72*.3 = .246, A1 = .04 + .72*.246 = .21712
    # row 1 (response t=1..2, pad t=3 with a junk value 5): d2 = 2 - 1.5 = .5; d1 = .9*1.5 - 1 = .35
    #   A2 = .5, A1 = .35 + .72*.5 = .71
    rewards = t([0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0])
    values = t([9.0, 0.5, 0.6, 0.7], [0.0, 1.0, 1.5, 5.0])
    mask = t([0, 1, 1, 1], [0, 1, 1, 0])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0, 0.21712, 0.246, 0.3], [0, 0.71, 0.5, 0]], atol=1e-6)
    close(ret, [[0, 0.71712, 0.846, 1.0], [0, 1.71, 2.0, 0]], atol=1e-6)


def test_gae_shape_mismatch_is_a_clear_error():
    with pytest.raises(AlgoError, match=r"gae: shapes differ: token_rewards\[2, 3\], values\[2, 4\]"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))


def _right_padded_mask(gen, b, t):
    mask = torch.zeros(b, t)
    for i in range(b):
        p = int(torch.randint(0, t - 1, (1,), generator=gen))
        r = int(torch.randint(1, t - p + 1, (1,), generator=gen))
        mask[i, p : p + r] = 1
    return mask


@pytest.mark.parametrize("seed", range(5))
def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_values(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = _right_padded_mask(gen, 4, 9)
    rewards = torch.randn(4, 9, generator=gen)
    values = torch.randn(4, 9, generator=gen)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = torch.zeros(4, 9)
    for b in range(4):
        for s in range(9):
            if mask[b, s]:
                to_go[b, s] = sum(rewards[b, k] for k in range(s, 9) if mask[b, k])
    torch.testing.assert_close(ret, to_go, atol=1e-5, rtol=0)
    torch.testing.assert_close(adv, (to_go - values) * mask, atol=1e-5, rtol=0)
