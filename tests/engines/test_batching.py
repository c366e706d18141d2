"""Token-budget micro-batches, their balance over ranks, and sequence packing (flowrl.engines.batching)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_testkit import BOS_ID, batch_of, make_trainer, sft_loss

from flowrl.engines import batching
from flowrl.engines.torch_train import OptimConfig
from flowrl.engines.types import Completion


@pytest.mark.parametrize("seed", range(20))
def test_plan_assigns_every_row_once_with_equal_micro_batch_counts(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(2, 20), rng.randint(50, 300)]) for _ in range(rng.randint(1, 40))]
    ranks, budget, padded = rng.randint(1, 4), rng.choice([0, 64, 256]), rng.random() < 0.5
    plans = batching.plan_ranks(lengths, ranks, max_rows=rng.randint(1, 8), max_tokens=budget, padded=padded)
    rows = sorted(i for plan in plans for m in plan for i in m)
    assert rows == list(range(len(lengths)))
    most = max(len(plan) for plan in plans)
    for plan in plans:  # as many micro-batches on every rank, unless a rank has too few rows to split
        assert len(plan) == most or all(len(m) == 1 for m in plan)
    if budget:
        totals = [sum(lengths[i] for m in plan for i in m) for plan in plans]
        assert max(totals) - min(totals) <= max(lengths)
        for plan in plans:
            for m in plan:  # within the budget (padded: rows x longest), or one long row alone
                cost = len(m) * max(lengths[i] for i in m) if padded else sum(lengths[i] for i in m)
                assert cost <= budget or len(m) == 1


def test_balance_is_within_the_longest_row():
    lengths = [300, 7, 9, 250, 3, 40, 41, 5, 120, 8]
    parts = batching.balance(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    totals = [sum(lengths[i] for i in p) for p in parts]
    assert max(totals) - min(totals) <= max(lengths)


def _long_tailed(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for b in range(rows):
        p = int(torch.randint(2, 5, (1,), generator=gen))
        r = 40 if b % 4 == 0 else int(torch.randint(1, 8, (1,), generator=gen))
        ids = torch.randint(3, 43, (p + r,), generator=gen).tolist()
        completions.append(Completion(tuple([BOS_ID] + ids[:p]), tuple(ids[p:]), (0.0,) * r, "length"))
    return batch_of(completions)


def test_packed_forward_equals_padded(tiny_model_dir):
    engine = make_trainer(tiny_model_dir)
    batch = _long_tailed(7, seed=1)
    padded = engine.forward(batch, entropy=True)
    packed = engine.forward(batch, entropy=True, micro_batch_tokens=60, pack=True)
    budget = engine.forward(batch, entropy=True, micro_batch_tokens=60)
    for key in padded:
        torch.testing.assert_close(packed[key], padded[key], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(budget[key], padded[key], atol=1e-5, rtol=1e-5)


def test_packed_token_budget_step_matches_padded_step(tiny_model_dir):
    batch = _long_tailed(8, seed=3)
    optim = OptimConfig(lr=1e-2, eps=1e-3)  # see test_micro_batching_is_exact: eps keeps Adam smooth in g
    ref, new = make_trainer(tiny_model_dir, optim=optim), make_trainer(tiny_model_dir, optim=optim)
    m_ref = ref.train_step(batch, sft_loss, micro_batch_size=3)
    m_new = new.train_step(batch, sft_loss, micro_batch_size=3, micro_batch_tokens=50, pack=True)
    assert m_new["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
    assert m_new["grad_norm"] == pytest.approx(m_ref["grad_norm"], abs=1e-6)
    assert m_new["pad_fraction"] == 0.0 < m_ref["pad_fraction"]
    after = dict(ref.named_weights())
    for name, tensor in new.named_weights():
        torch.testing.assert_close(tensor, after[name], atol=1e-5, rtol=0)


def test_pack_masks_attention_within_each_sequence():
    batch = batch_of([Completion((BOS_ID, 5), (6,), (0.0,), "stop"), Completion((BOS_ID,), (7, 8), (0.0, 0.0), "stop")])
    p = batching.pack(batch)
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    allowed = (p.attention_mask[0, 0] == 0).int()
    assert allowed[3].tolist() == [0, 0, 0, 1, 0, 0] and allowed[5].tolist() == [0, 0, 0, 1, 1, 1]
    values = torch.arange(6.0)
    assert batching.unpack(values, p.lengths, 4).tolist() == [[0, 1, 2, 0], [3, 4, 5, 0]]


def test_fsdp_dp2_token_budget_packed_matches_torch_padded(tiny_model_dir):
    from flowrl.engines.fsdp import FsdpTrainEngine
    from flowrl.engines.torch_train import TorchTrainEngine

    batch = _long_tailed(8, seed=5)
    optim = OptimConfig(lr=1e-2, eps=1e-3)
    ref = TorchTrainEngine(tiny_model_dir, optim=optim)
    ref_out = ref.forward(batch, entropy=True)
    ref_stats = ref.train_step(batch, sft_loss, micro_batch_size=3)
    ref_weights = dict(ref.named_weights())
    with FsdpTrainEngine(tiny_model_dir, optim=optim, dp=2) as eng:
        out = eng.forward(batch, entropy=True, micro_batch_size=2, micro_batch_tokens=30, pack=True)
        stats = eng.train_step(batch, sft_loss, micro_batch_size=3, micro_batch_tokens=30, pack=True)
        weights = dict(eng.named_weights())
    for key in ref_out:
        torch.testing.assert_close(out[key], ref_out[key], atol=1e-5, rtol=1e-5)
    assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], abs=1e-5)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[name], atol=1e-5, rtol=1e-5)


def test_packed_critic_values_equal_padded(tiny_model_dir):
    engine = make_trainer(tiny_model_dir, role="critic")
    batch = _long_tailed(6, seed=7)
    padded = engine.forward(batch, values=True)["values"]
    packed = engine.forward(batch, values=True, micro_batch_tokens=50, pack=True)["values"]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)


def test_packing_refuses_a_sliding_window_shorter_than_a_sequence(tiny_model_dir):
    from flowrl.engines.base import EngineConfigError

    engine = make_trainer(tiny_model_dir)
    engine._window = 4  # as read from a Mistral-style config.json with sliding_window = 4
    with pytest.raises(EngineConfigError, match="sliding window"):
        engine.forward(_long_tailed(3, seed=2), pack=True)
