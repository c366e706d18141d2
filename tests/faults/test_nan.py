"""NaN / inf in the loss or the gradients (issue 14, item 6): the torch train engine never
steps its optimizer on them, and ``update(on_nan = ...)`` chooses between skipping and counting
(``faults/nan_skipped``) or stopping the run naming the op and the step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from engine_testkit import build_tiny_llama, random_batch, sft_loss  # noqa: E402

from flowrl.runtime.errors import RuntimeFlowError  # noqa: E402
from flowrl.runtime.nonfinite import apply_nan_policy  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One tiny Llama train engine for the module (each test leaves it with finite weights)."""
    from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine

    model_dir = build_tiny_llama(str(tmp_path_factory.mktemp("nan_llama")))
    return TorchTrainEngine(model_dir, optim=OptimConfig(lr=1e-2, max_grad_norm=1.0), seed=0)


def _weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def nan_loss(outputs, micro, denominator):
    """A loss whose gradient is NaN everywhere it reaches (0 * inf)."""
    return sft_loss(outputs, micro, denominator) * float("nan")


def inf_loss(outputs, micro, denominator):
    """An infinite loss whose gradient is finite: the inf term carries no gradient."""
    return sft_loss(outputs, micro, denominator) + torch.tensor(float("inf"))


@pytest.mark.parametrize("loss_fn", [nan_loss, inf_loss], ids=["nan_grad", "inf_loss"])
def test_engine_skips_the_update_and_keeps_the_weights_and_moments(engine, loss_fn):
    first = engine.train_step(random_batch(4, seed=1), sft_loss, micro_batch_size=4)  # AdamW moments exist
    assert first["skipped"] == 0
    weights = _weights(engine)
    moments = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
               for p, s in engine.optimizer.state.items()}
    stats = engine.train_step(random_batch(4, seed=2), loss_fn, micro_batch_size=4)
    assert stats["skipped"] == 1.0
    assert _same(weights, _weights(engine)), "a non-finite step changed the weights"
    for p, s in engine.optimizer.state.items():
        assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items() if torch.is_tensor(v))
    after = engine.train_step(random_batch(4, seed=3), sft_loss, micro_batch_size=4)  # training goes on
    assert after["skipped"] == 0 and not _same(weights, _weights(engine))
    assert all(torch.isfinite(v).all() for v in engine.model.state_dict().values())


class _Op:
    id, model, origin = "update", "policy", "main.flow:14:3"

    def __init__(self, on_nan: str):
        self.options = {"on_nan": on_nan}


def test_skip_counts_the_engines_skipped_steps(engine):
    stats = [engine.train_step(random_batch(4, seed=s), fn, micro_batch_size=4)
             for s, fn in ((1, sft_loss), (2, nan_loss), (3, inf_loss))]
    assert apply_nan_policy(_Op("skip"), 6, stats) == {"faults/nan_skipped": 2}
    assert apply_nan_policy(_Op("skip"), 6, stats[:1]) == {"faults/nan_skipped": 0}


def test_stop_names_the_op_the_model_and_the_step(engine):
    stats = [engine.train_step(random_batch(4, seed=2), nan_loss, micro_batch_size=4)]
    with pytest.raises(RuntimeFlowError) as e:
        apply_nan_policy(_Op("stop"), 6, stats)
    msg = str(e.value)
    assert msg.startswith("main.flow:14:3: step 7: `update` (model `policy`) got a non-finite loss or gradient")
    assert "loss=nan" in msg and "1 of 1 optimizer step(s)" in msg and 'on_nan = "skip"' in msg
    assert apply_nan_policy(_Op("stop"), 6, [{"loss": 0.5, "grad_norm": 0.1, "skipped": 0.0}]) == \
        {"faults/nan_skipped": 0}
    with pytest.raises(RuntimeFlowError, match=r"main.flow:14:3: on_nan = 'ignore'; choose one of skip, stop"):
        apply_nan_policy(_Op("ignore"), 0, stats)


FLOW = """model policy = tiny(task = "arith")
dataset arith = jsonl("train.jsonl")
reward exact = verifier("math")

flow main() {
  b        = sample(arith, size = 4)
  rollouts = generate(policy, b, n = 2, max_tokens = 8)
  scores   = exact(rollouts)
  old_lp   = logprobs(policy, rollouts)
  adv      = group_advantage(scores, group = 2)
  update(policy, rollouts, adv, old_lp, loss = ppo_clip(0.2), on_nan = %s)
}
"""


def _compile(tmp_path: Path, value: str):
    from flowrl.compiler.pipeline import compile_file

    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    path = tmp_path / "main.flow"
    path.write_text(FLOW % value)
    return compile_file(path)


def test_on_nan_is_checked_when_compiled(tmp_path):
    from flowrl.diagnostics import FlowError

    with pytest.raises(FlowError) as e:
        _compile(tmp_path, '"ignore"')
    text = str(e.value)
    assert "main.flow:11:" in text and "ignore" in text and "skip" in text and "stop" in text
    from flowrl.compiler.lower import lower

    plan = lower(_compile(tmp_path, '"stop"').graph)
    assert next(op for op in plan.ops if op.id == "update").options["on_nan"] == "stop"
