"""Mixed precision (flowrl.catalog.precision, flowrl.engines.precision): a bf16 model trains with fp32
master weights and fp32 AdamW moments on the torch and fsdp engines; ``precision = "pure"`` keeps
everything in bf16 and loses the updates below bf16's resolution that mixed precision keeps."""

from __future__ import annotations

import pytest
import torch
from engine_testkit import random_batch, sft_loss

from flowrl.engines.base import EngineError
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine

# RMSNorm weights start at 1.0, where bf16's spacing is 2**-8 below and 2**-7 above: an update under
# half of it (1.95e-3) rounds back to 1.0. AdamW moves a weight by at most ~3.2 lr per step
# ((1 - beta1) / sqrt(1 - beta2)), so with lr = 4.5e-4 no single step can leave 1.0 in bf16, while
# 12 steps of a steady gradient move the fp32 master by up to 5.4e-3.
SMALL = OptimConfig(lr=4.5e-4, max_grad_norm=None)
STEPS = 12


def _norms(named) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named if n.endswith("norm.weight")}


def _train(engine, steps: int = STEPS) -> None:
    batch = random_batch(4, seed=4)
    for _ in range(steps):
        engine.train_step(batch, sft_loss, micro_batch_size=4)


def _optimizer_tensors(engine) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    states = [v for s in engine.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return params, states


def test_mixed_bf16_trains_fp32_masters_and_computes_in_bf16(tiny_model_dir):
    engine = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", optim=SMALL)  # mixed: the default
    _train(engine, 2)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # the compute copy
    assert {t.dtype for _, t in engine.named_weights()} == {torch.bfloat16}  # what a resync sends
    params, states = _optimizer_tensors(engine)
    assert {p.dtype for p in params} == {torch.float32} and {s.dtype for s in states} == {torch.float32}
    assert len(states) == 2 * len(params)
    for (p, m) in engine.masters.pairs:  # the bf16 weights are the masters rounded to nearest
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))


def test_pure_bf16_keeps_weights_and_moments_in_bf16(tiny_model_dir):
    engine = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", precision="pure", optim=SMALL)
    _train(engine, 2)
    params, states = _optimizer_tensors(engine)
    assert not engine.masters.active
    assert {p.dtype for p in params} == {torch.bfloat16} and {s.dtype for s in states} == {torch.bfloat16}


def test_updates_below_bf16_resolution_accumulate_under_mixed_and_are_lost_under_pure(tiny_model_dir):
    mixed = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", optim=SMALL)
    pure = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", precision="pure", optim=SMALL)
    before = _norms(mixed.named_weights())
    assert all(torch.all(t == 1.0) for t in before.values())
    _train(mixed)
    _train(pure)
    masters = {n: m for (n, p), (_, m) in zip(mixed.model.named_parameters(), mixed.masters.pairs)
               if n.endswith("norm.weight")}
    moved = torch.cat([(m.detach() - 1.0).abs().flatten() for m in masters.values()])
    assert moved.median() > 1e-3  # the fp32 masters took the steps (12 x ~4.5e-4 of a steady gradient)
    changed = sum(int((t != 1.0).sum()) for t in _norms(mixed.named_weights()).values())
    assert changed > 0  # ...and enough of them crossed half a bf16 step to show in the bf16 weights
    after_pure = _norms(pure.named_weights())
    assert all(torch.all(t == 1.0) for t in after_pure.values())  # every update rounded back to 1.0


def test_mixed_checkpoint_round_trips_the_masters_and_resumes_bit_identically(tiny_model_dir, tmp_path):
    first = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", optim=SMALL)
    _train(first, 3)
    first.save(str(tmp_path / "ckpt"))
    expected = first.train_step(random_batch(8, seed=9), sft_loss, micro_batch_size=4)
    resumed = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", optim=SMALL)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.train_step(random_batch(8, seed=9), sft_loss, micro_batch_size=4) == expected
    for (_, a), (_, b) in zip(first.masters.pairs, resumed.masters.pairs):
        assert a.dtype == torch.float32 and torch.equal(a, b)  # the fp32 masters, not re-derived from bf16
    for (n, a), (_, b) in zip(first.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), n
    pure = TorchTrainEngine(tiny_model_dir, dtype="bfloat16", precision="pure", optim=SMALL)
    with pytest.raises(EngineError, match="master weights.*precision and dtype it was saved with"):
        pure.load(str(tmp_path / "ckpt"))


def _dcp_dtypes(path) -> dict[str, torch.dtype]:
    """Each tensor's dtype in an fsdp checkpoint's torch.distributed.checkpoint metadata."""
    from flowrl.engines.fsdp_rank import DCP_DIR, _safe_metadata

    with open(path / DCP_DIR / ".metadata", "rb") as f:
        meta = _safe_metadata(f)
    return {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}


# Fewer steps for the two-process engine: AdamW's first steps on a fixed batch move a weight by ~lr each
# (under half of bf16's spacing at 1.0 each time), so 6 steps of 5e-4 cross it in the fp32 shards.
FSDP_SMALL, FSDP_STEPS = OptimConfig(lr=5e-4, max_grad_norm=None), 6


@pytest.mark.slow  # two 2-rank engines, 12 steps: over a minute on a loaded 2-core machine
def test_fsdp_mixed_keeps_small_updates_in_fp32_shards_and_checkpoints_them_pure_loses_them(tiny_model_dir,
                                                                                            tmp_path):
    from flowrl.engines.fsdp import FsdpTrainEngine

    batch = random_batch(4, seed=4)
    norms = {}
    for precision in ("mixed", "pure"):
        with FsdpTrainEngine(tiny_model_dir, dtype="bfloat16", precision=precision, optim=FSDP_SMALL, dp=2,
                             threads=1) as eng:
            for _ in range(FSDP_STEPS):
                eng.train_step(batch, sft_loss, micro_batch_size=2)
            weights = dict(eng.named_weights())
            assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # what a resync sends
            norms[precision] = _norms(weights.items())
            eng.save(str(tmp_path / precision))
    assert sum(int((t != 1.0).sum()) for t in norms["mixed"].values()) > 0  # accumulated in the fp32 shards
    assert all(torch.all(t == 1.0) for t in norms["pure"].values())  # each step rounded back to 1.0
    for precision, kept in (("mixed", torch.float32), ("pure", torch.bfloat16)):
        dtypes = _dcp_dtypes(tmp_path / precision)
        model = {d for k, d in dtypes.items() if k.startswith("model.")}
        moments = {d for k, d in dtypes.items() if "exp_avg" in k}
        assert model == {kept} and moments == {kept}, precision  # mixed: the masters, not the bf16 casts


@pytest.mark.parametrize("precision, masters", [("mixed", True), ("pure", False)])
def test_a_flows_dtype_and_precision_reach_the_plan_and_the_train_worker(tiny_model_dir, precision, masters):
    from pathlib import Path

    from flowrl.compiler.lower import lower
    from flowrl.compiler.pipeline import compile_text
    from flowrl.runtime.workers import TrainWorker

    root = Path(__file__).resolve().parents[2]
    flow = f'''model policy = tiny(task = "arith", dtype = "bfloat16", precision = "{precision}")
dataset d = jsonl("../data/arith/train.jsonl", prompt = "prompt", answer = "answer")
reward r = verifier("math")
flow main() {{
  b = sample(d, size = 4)
  roll = generate(policy, b, n = 2, max_tokens = 5)
  update(policy, roll, group_advantage(r(roll), group = 2), logprobs(policy, roll))
}}
'''
    m = lower(compile_text(flow, str(root / "flows" / "precision_test.flow"))).model("policy")
    assert (m.args["dtype"], m.args["precision"]) == ("bfloat16", precision)
    worker = TrainWorker(m.train_engine, tiny_model_dir, role="actor", optim=m.optim, temperature=1.0, seed=0,
                         threads=1, dtype=m.args["dtype"], precision=m.args["precision"])  # as the fleet passes them
    assert worker.engine.masters.active is masters
    assert next(worker.engine.model.parameters()).dtype == torch.bfloat16
