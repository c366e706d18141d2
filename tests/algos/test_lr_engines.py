"""Learning-rate schedules reach the train engines: the lr each optimizer step uses.

The update's options travel as the plan's ``ModelPlan.optim`` to :func:`flowrl.runtime.workers.optim_config`,
whose :class:`~flowrl.engines.torch_train.OptimConfig` every train engine takes; the torch and FSDP
engines schedule with ``OptimConfig.lr_factor``, Megatron's ranks with the same
:func:`~flowrl.algos.schedules.lr_factor` on their options.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.algos import lr_factor
from flowrl.compiler.lower import lower
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine
from flowrl.runtime.workers import optim_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from engine_testkit import build_tiny_llama, random_batch  # noqa: E402
from test_compile import _dapo  # noqa: E402


def _nll(outputs, micro, denominator):
    return -(outputs["logprobs"] * micro.response_mask).sum() / denominator["tokens"]


def test_the_plan_s_optimiser_options_become_the_engines_config():
    plan = lower(_dapo('lr = 1e-4, lr_schedule = "linear", warmup = 2, min_lr_ratio = 0.1, beta2 = 0.95'),
                 {"steps": 5})
    cfg = optim_config(plan.model("policy").optim)
    assert cfg == OptimConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, warmup_steps=2, schedule="linear",
                              total_steps=5, min_lr_ratio=0.1, max_grad_norm=1.0)
    # step 3 (0-based) is one of three decay steps in: 0.1 + 0.9 * (1 - 1/3) = 0.7
    assert cfg.lr_factor(3) == pytest.approx(0.7)


def test_the_torch_engine_steps_with_the_scheduled_lr(tmp_path, schedule="cosine", warmup=2):
    # one schedule here (an engine costs seconds); lr_factor's shapes are tested in test_schedules.py
    optim = OptimConfig(lr=1e-3, warmup_steps=warmup, schedule=schedule, total_steps=5, min_lr_ratio=0.2)
    torch.manual_seed(0)
    engine = TorchTrainEngine(build_tiny_llama(str(tmp_path / "m")), role="actor", optim=optim)
    batch = random_batch(rows=2)
    used = [engine.train_step(batch, _nll, micro_batch_size=2)["lr"] for _ in range(7)]
    expected = [1e-3 * lr_factor(s, schedule=schedule, warmup=warmup, total=5, min_ratio=0.2) for s in range(7)]
    assert used == pytest.approx(expected, rel=1e-12)
    # warm-up climbs, then the rate decays to its floor and stays there
    assert used[0] == pytest.approx(5e-4) and used[warmup - 1] == pytest.approx(1e-3)
    assert used[-1] == pytest.approx(2e-4) and used[3] < used[2]
    # the schedule survives a checkpoint: a restored engine continues the curve
    engine.save(str(tmp_path / "ckpt"))
    again = TorchTrainEngine(str(tmp_path / "m"), role="actor", optim=optim)
    again.load(str(tmp_path / "ckpt"))
    assert again.train_step(batch, _nll, micro_batch_size=2)["lr"] == pytest.approx(
        1e-3 * lr_factor(7, schedule=schedule, warmup=warmup, total=5, min_ratio=0.2))


def test_megatron_ranks_follow_the_same_curve():
    from flowrl.engines.megatron.worker import MegatronRank, RankOptions

    opts = RankOptions(model_path="unused", lr=2e-3, warmup_steps=2, lr_schedule="cosine", total_steps=6,
                       min_lr_ratio=0.0)
    used = [MegatronRank._lr(SimpleNamespace(options=opts, step=s)) for s in range(7)]
    assert used == pytest.approx([2e-3 * f for f in (0.5, 1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5,
                                                      (1 + math.cos(3 * math.pi / 4)) / 2, 0.0)], abs=1e-15)
