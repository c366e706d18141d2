"""AdamW settings of an `update` reach the train engine: lr, weight decay, betas, grad clip."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError

ROOT = Path(__file__).resolve().parents[2]

FLOW = """model policy = tiny(task = "arith")
dataset d = jsonl("../data/arith/train.jsonl", prompt = "prompt", answer = "answer")
reward r = verifier("math")
flow main() {
  b = sample(d, size = 4)
  roll = generate(policy, b, n = 2, max_tokens = 5)
  old = logprobs(policy, roll)
  update(policy, roll, group_advantage(r(roll), group = 2), old, lr = 3e-4, weight_decay = 0.01, OPTIONS)
}
"""


def _compile(options: str):
    return compile_text(FLOW.replace("OPTIONS", options), str(ROOT / "flows" / "optim_test.flow"))


def test_betas_reach_the_plan_and_the_engine(tmp_path):
    from flowrl.models.tiny import build_tiny_model
    from flowrl.runtime.workers import TrainWorker

    plan = lower(_compile("beta1 = 0.8, beta2 = 0.95, grad_clip = 0.5"))
    optim = plan.model("policy").optim
    assert optim == {"lr": 3e-4, "weight_decay": 0.01, "beta1": 0.8, "beta2": 0.95, "grad_clip": 0.5,
                     "lr_schedule": "constant", "warmup": 0, "min_lr_ratio": 0.0, "schedule_steps": 20}  # 20 run steps
    path = build_tiny_model(tmp_path / "m", hidden=64, heads=2, kv_heads=1, layers=1, seed=0)
    engine = plan.model("policy").train_engine
    worker = TrainWorker(engine, str(path), role="actor", optim=optim, temperature=1.0, seed=0, threads=1)
    group = worker.engine.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (3e-4, 0.01, (0.8, 0.95))
    assert worker.engine.optim_config.max_grad_norm == 0.5


def test_defaults_are_adamw_defaults():
    optim = lower(_compile("epochs = 1")).model("policy").optim
    assert (optim["beta1"], optim["beta2"]) == (0.9, 0.999)


def test_a_beta_of_one_is_refused_with_its_position():
    with pytest.raises(FlowError) as e:
        _compile("beta2 = 1.0")
    assert "beta2" in str(e.value) and "optim_test.flow:8:" in str(e.value)
