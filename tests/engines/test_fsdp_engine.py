"""fsdp(dp=2): two FSDP2 rank processes on gloo match the single-process torch engine (fp32, 1e-5)
for an actor and a critic, and run GRPO end to end through Ray + vLLM with an exact resync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_testkit import random_batch

from flowrl.engines.base import EngineConfigError
from flowrl.engines.fsdp import FsdpTrainEngine
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine

# AdamW's first step moves a weight by lr * g / (|g| + eps): with the default eps = 1e-8 a
# gradient entry of ~1e-8 that two exact-in-real-arithmetic reductions round differently
# (2e-8 apart here) moves the weight by O(lr) differently. With eps = 1e-3 the update is a
# smooth function of the gradient, |d update / d g| <= lr / eps = 10, so gradients equal to
# ~1e-7 give weights equal to ~1e-6, inside TOL whatever the CPU's summation order.
OPTIM = OptimConfig(lr=1e-2, max_grad_norm=1.0, eps=1e-3)
TOL = dict(rtol=1e-5, atol=1e-5)


def nll_with_metrics(outputs, micro, denominator):
    """Mean response NLL over the global denominator, with a summed and a min-combined metric."""
    lp = outputs["logprobs"] * micro.response_mask
    loss = -lp.sum() / denominator["tokens"]
    masked = torch.where(micro.response_mask.bool(), outputs["logprobs"], torch.zeros_like(lp))
    return loss, {"nll": loss.detach(), "logprob_min": masked.min().detach()}


def value_mse(outputs, micro, denominator):
    """Squared error of values against ``extras["returns"]`` on response tokens, global mean."""
    err = (outputs["values"] - micro.extras["returns"]) ** 2
    return (err * micro.response_mask).sum() / denominator["tokens"]


def _clip_coef(norm: float) -> float:
    """torch's clip_grad_norm_ factor for max_norm = 1."""
    return min(1.0, 1.0 / (norm + 1e-6))


def _run_both(model_dir, role, batch, loss_fn, **forward_kw):
    """The same forward + one train_step on the torch engine and on fsdp(dp=2)."""
    torch.manual_seed(0)
    ref = TorchTrainEngine(model_dir, role=role, optim=OPTIM)
    ref_out = ref.forward(batch, **forward_kw)
    ref_stats = ref.train_step(batch, loss_fn, micro_batch_size=2)
    ref_grads = {n: p.grad.clone() for n, p in ref.model.named_parameters()}  # clipped in place by the step
    ref_weights = {n: t.clone() for n, t in ref.named_weights()}
    with FsdpTrainEngine(model_dir, role=role, optim=OPTIM, dp=2) as eng:
        out = eng.forward(batch, micro_batch_size=1, **forward_kw)  # uneven micro counts: padding passes
        stats = eng.train_step(batch, loss_fn, micro_batch_size=2, capture_grads=True)
        grads = dict(eng.last_gradients())
        weights = dict(eng.named_weights())
    return (ref_out, ref_stats, ref_grads, ref_weights), (out, stats, grads, weights)


def _assert_same(ref, got):
    (ref_out, ref_stats, ref_grads, ref_weights), (out, stats, grads, weights) = ref, got
    assert out.keys() == ref_out.keys()
    for key in ref_out:
        torch.testing.assert_close(out[key], ref_out[key], **TOL)
    assert stats.keys() == ref_stats.keys()
    for key in ref_stats.keys() - {"pad_fraction"}:  # padding depends on the split, the maths does not
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-6), key
    coef = _clip_coef(stats["grad_norm"])
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:  # summed over ranks (not averaged): equal to the one-process grads
        torch.testing.assert_close(grads[name] * coef, ref_grads[name], **TOL, msg=name)
    assert weights.keys() == ref_weights.keys()
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], **TOL, msg=name)


def test_actor_dp2_matches_torch_engine(tiny_model_dir):
    batch = random_batch(rows=5, seed=3)  # 2 + 3 rows: ranks run different numbers of micro-batches
    ref, got = _run_both(tiny_model_dir, "actor", batch, nll_with_metrics, entropy=True)
    _assert_same(ref, got)
    stats = got[1]
    assert stats["step"] == 1.0 and stats["skipped"] == 0.0 and stats["grad_norm"] > 1.0  # clipping was active
    assert stats["logprob_min"] < 0 and stats["nll"] == pytest.approx(stats["loss"])


def test_critic_dp2_matches_torch_engine(tiny_model_dir):
    batch = random_batch(rows=4, seed=5)
    batch.extras["returns"] = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    ref, got = _run_both(tiny_model_dir, "critic", batch, value_mse, values=True)
    _assert_same(ref, got)
    assert {"value_head.weight", "value_head.bias"} <= got[3].keys()


def test_save_load_resumes_and_bad_arguments(tiny_model_dir, tmp_path):
    first, second = random_batch(rows=4, seed=1), random_batch(rows=4, seed=2)
    with FsdpTrainEngine(tiny_model_dir, optim=OPTIM, dp=2) as eng:
        eng.train_step(first, nll_with_metrics, micro_batch_size=2)
        eng.save(str(tmp_path))
        straight = eng.train_step(second, nll_with_metrics, micro_batch_size=2)
        expected = dict(eng.named_weights())
        with pytest.raises(EngineConfigError, match="dp=2"):
            eng.train_step(random_batch(rows=1), nll_with_metrics, micro_batch_size=1)
    with FsdpTrainEngine(tiny_model_dir, optim=OPTIM, dp=2) as eng:
        eng.load(str(tmp_path))
        assert eng.step == 1
        resumed = eng.train_step(second, nll_with_metrics, micro_batch_size=2)
        got = dict(eng.named_weights())
    assert resumed == straight
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert json.loads(Path(tmp_path, "fsdp_engine.json").read_text())["dp"] == 2
    with pytest.raises(EngineConfigError, match="tp=2.*megatron"):
        FsdpTrainEngine(tiny_model_dir, dp=2, tp=2)


# ---- end to end: GRPO through Ray + vLLM with policy.train = fsdp(dp = 2) ---------------------

FSDP_SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  policy.train = fsdp(dp = 2)
  policy.rollout = vllm(tp = 1)
}
"""

GRPO = "grpo(policy, prompts, sevens, batch = 8, group = 4, max_tokens = 8, lr = 3e-3, kl = 0.0, seed = 1)"


@pytest.mark.long  # make test-long, 170 s; in make test: the FSDP dp=2 actor and critic match the torch engine (this file), and save/load
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_dp2_grpo_runs_and_matches_vllm(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from flowrl.launch import run_file

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "runtime"))  # e2e_kit, e2e_rewards
    from e2e_kit import make_workdir, shared_ray, write_flow

    make_workdir(tmp_path, rows=60, train=50)
    result = run_file(str(write_flow(tmp_path / "fsdp.flow", GRPO, 2, FSDP_SCHEDULE)), out=str(tmp_path / "run"),
                      ray_address=shared_ray())
    assert [r["policy/version"] for r in result.rows] == [1, 2]
    for row in result.rows:
        assert row["mismatch/abs_max"] < 1e-4, row  # vLLM vs the FSDP-sharded trainer, after each resync
        assert row["sync/bytes"] > 0
