"""megatron(cp=2): context parallelism by all-gathered K/V on gloo ranks (alone, and with tp, pp or dp).

The same step as cp=1 (per-token log-probabilities and entropy, loss, grad norm, gradients
and updated weights, to 1e-5) on a batch whose micro-batches are 9-11 tokens wide, so
every one is padded to a multiple of 2*cp = 4 and its rows carry their own right padding.
The acceptance model has 4 query heads and 2 KV heads, so GQA is on throughout.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import (  # noqa: E402
    MICRO_BATCH, OPTIM, TOL, assert_close, assert_same_step, make_batch, pg_loss, run_megatron, value_loss,
)

from flowrl.engines.base import EngineConfigError  # noqa: E402
from flowrl.engines.megatron import MegatronTrainEngine, ModelSpec  # noqa: E402
from flowrl.engines.megatron.worker import micro_batches  # noqa: E402


def padded_batch():
    """Micro-batches (of MICRO_BATCH and of 3 rows) 9, 10 or 11 tokens wide: none a multiple of 4."""
    return make_batch(seed=3, width=11)


@pytest.fixture(scope="module")
def cp1(tiny_dir):
    return run_megatron(tiny_dir, batch=padded_batch())


@pytest.fixture(scope="module")
def cp2(tiny_dir):
    return run_megatron(tiny_dir, batch=padded_batch(), cp=2)


def test_the_case_pads_every_micro_batch_and_uses_gqa(tiny_dir):
    batch = padded_batch()
    widths = [m.input_ids.shape[1] for size in (MICRO_BATCH, 3) for m in micro_batches(batch, size)]
    assert all(w % 4 for w in widths), widths
    assert len(set(batch.attention_mask.sum(1).tolist())) > 3  # rows of many lengths
    spec = ModelSpec.from_pretrained(tiny_dir)
    assert spec.kv_heads < spec.heads


def test_cp2_matches_cp1(cp2, cp1):
    assert_same_step(cp2, cp1)
    moved = {k: float((cp2.weights[k] - cp2.initial[k]).abs().max()) for k in cp2.initial}
    assert all(v > 0 for v in moved.values())


def test_cp2_on_the_default_case_matches_torch_engine(tiny_dir, torch_reference):
    """The shared acceptance step (micro-batches 8 and 12 wide: no CP padding) against the torch engine."""
    assert_same_step(run_megatron(tiny_dir, cp=2), torch_reference)


@pytest.mark.parametrize("other", [pytest.param({"tp": 2}, marks=pytest.mark.long, id="tp2"),
                                   pytest.param({"pp": 2}, marks=pytest.mark.long, id="pp2"),
                                   pytest.param({"dp": 2}, id="dp2")])  # tp2, pp2: 12-14 s each, make test-long
def test_cp2_combined_with_tp_pp_or_dp_matches_cp1(tiny_dir, cp1, other):
    """4 ranks: tp=2 (one KV head per TP rank), pp=2 (1F1B over CP-sharded activations) or
    dp=2 (distributed optimizer over the dp x cp group of 4), each x cp=2."""
    assert_same_step(run_megatron(tiny_dir, batch=padded_batch(), cp=2, **other), cp1)


@pytest.mark.long  # make test-long, 23 s; in make test: the critic at tp=2 (test_megatron_critic.py) and the actor at cp=2 (this file)
def test_cp2_critic_matches_cp1_critic(tiny_dir):
    batch = padded_batch()
    results = []
    for cp in (1, 2):
        with MegatronTrainEngine(tiny_dir, role="critic", optim=OPTIM, seed=7, cp=cp) as eng:
            values = eng.forward(batch, values=True, micro_batch_size=3)["values"]
            stats = eng.train_step(batch, value_loss, micro_batch_size=MICRO_BATCH, capture_grads=True)
            results.append((values, stats, dict(eng.last_gradients()), dict(eng.named_weights())))
    (v1, s1, g1, w1), (v2, s2, g2, w2) = results
    assert float(v1.abs().max()) > 0 and float(v1[:, 0].abs().max()) == 0.0
    assert_close({"values": v2}, {"values": v1})
    assert abs(s2["loss"] - s1["loss"]) <= TOL and abs(s2["grad_norm"] - s1["grad_norm"]) <= TOL
    assert_close(g2, g1)
    assert_close(w2, w1)


@pytest.mark.long  # 20 s; make test runs test_megatron_dp.py's save/load of the same state code
def test_cp2_save_load_resumes_bit_identically(tiny_dir, tmp_path):
    """Each CP rank writes its own file (its shard of the distributed optimizer over dp x cp)."""
    first, second = padded_batch(), make_batch(seed=5, width=11)
    with MegatronTrainEngine(tiny_dir, optim=OPTIM, cp=2) as eng:
        eng.train_step(first, pg_loss, micro_batch_size=MICRO_BATCH)
        eng.save(str(tmp_path))
        straight = eng.train_step(second, pg_loss, micro_batch_size=MICRO_BATCH)
        expected = dict(eng.named_weights())
    files = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert files == ["mp_rank_00_000_cp00_dp000.pt", "mp_rank_00_000_cp01_dp000.pt"]
    assert json.loads((tmp_path / "megatron_engine.json").read_text())["layout"] == {"tp": 1, "pp": 1, "dp": 1,
                                                                                       "cp": 2}
    with MegatronTrainEngine(tiny_dir, optim=OPTIM) as other:  # cp=1 cannot read a cp=2 checkpoint
        with pytest.raises(EngineConfigError, match="layout"):
            other.load(str(tmp_path))
    with MegatronTrainEngine(tiny_dir, optim=OPTIM, cp=2) as eng:
        eng.load(str(tmp_path))
        assert eng.step == 1
        resumed = eng.train_step(second, pg_loss, micro_batch_size=MICRO_BATCH)
        got = dict(eng.named_weights())
    assert resumed == straight
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_bad_cp_is_refused_before_any_process_starts(tiny_dir):
    with pytest.raises(EngineConfigError, match="^cp=0: each of tp, pp, dp, cp and ep must be an integer >= 1"):
        MegatronTrainEngine(tiny_dir, cp=0)
