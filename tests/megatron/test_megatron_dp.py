"""megatron(dp=2) on 2 gloo ranks with Megatron's distributed optimizer: same step as tp=1 and
as the torch engine; save/load keeps the sharded optimizer state (next step bit-identical)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import OPTIM, assert_same_step, make_batch, pg_loss, run_megatron  # noqa: E402

from flowrl.engines.base import EngineConfigError  # noqa: E402
from flowrl.engines.megatron import MegatronTrainEngine  # noqa: E402


@pytest.fixture(scope="module")
def dp2(tiny_dir):
    return run_megatron(tiny_dir, dp=2)


def test_dp2_matches_tp1_and_torch_engine(dp2, megatron_tp1, torch_reference):
    assert_same_step(dp2, megatron_tp1)
    assert_same_step(dp2, torch_reference)


def test_save_load_resumes_bit_identically(tiny_dir, tmp_path):
    """Two steps straight == one step, save, fresh engine, load, one step (weights and stats)."""
    first, second = make_batch(seed=1), make_batch(seed=2)
    with MegatronTrainEngine(tiny_dir, optim=OPTIM, dp=2) as eng:
        eng.train_step(first, pg_loss, micro_batch_size=2)
        eng.save(str(tmp_path))
        straight = eng.train_step(second, pg_loss, micro_batch_size=2)
        expected = dict(eng.named_weights())
        # A different batch size must be rejected before anything runs.
        with pytest.raises(EngineConfigError, match="dp=2"):
            eng.train_step(make_batch(rows=1), pg_loss, micro_batch_size=1)
    with MegatronTrainEngine(tiny_dir, optim=OPTIM, dp=2) as eng:
        eng.load(str(tmp_path))
        assert eng.step == 1
        resumed = eng.train_step(second, pg_loss, micro_batch_size=2)
        got = dict(eng.named_weights())
    assert resumed == straight
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
