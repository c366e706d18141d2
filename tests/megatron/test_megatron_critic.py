"""A megatron(tp=2) critic: values and a value-loss step match the torch engine's critic
(same seeded Linear(H, 1) head, replicated over TP ranks)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from mcore_cases import MICRO_BATCH, OPTIM, TOL, assert_close, make_batch, value_loss  # noqa: E402

from flowrl.engines.base import EngineConfigError  # noqa: E402
from flowrl.engines.megatron import MegatronTrainEngine  # noqa: E402
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine  # noqa: E402


def test_critic_tp2_matches_torch_critic(tiny_dir):
    batch = make_batch(seed=3)
    ref = TorchTrainEngine(tiny_dir, role="critic", optim=OPTIM, seed=7)
    ref_values = ref.forward(batch, values=True)["values"]
    ref_stats = ref.train_step(batch, value_loss, micro_batch_size=MICRO_BATCH)
    ref_weights = dict(ref.named_weights())
    twin = TorchTrainEngine(tiny_dir, role="critic", optim=OptimConfig(lr=OPTIM.lr, max_grad_norm=None), seed=7)
    twin.train_step(batch, value_loss, micro_batch_size=MICRO_BATCH)
    ref_grads = {k: p.grad for k, p in twin.model.named_parameters()}

    with MegatronTrainEngine(tiny_dir, role="critic", optim=OPTIM, seed=7, tp=2) as eng:
        values = eng.forward(batch, values=True)["values"]
        with pytest.raises(EngineConfigError, match="entropy=True asked of a critic"):
            eng.forward(batch, entropy=True)
        stats = eng.train_step(batch, value_loss, micro_batch_size=MICRO_BATCH, capture_grads=True)
        grads = dict(eng.last_gradients())
        weights = dict(eng.named_weights())

    assert float((values - ref_values).abs().max()) <= TOL
    assert float(values[:, 0].abs().max()) == 0.0 and float(values.abs().max()) > 0
    assert abs(stats["loss"] - ref_stats["loss"]) <= TOL and abs(stats["grad_norm"] - ref_stats["grad_norm"]) <= TOL
    assert "value_head.weight" in weights and "lm_head.weight" not in weights
    assert_close(grads, ref_grads)
    assert_close(weights, ref_weights)
