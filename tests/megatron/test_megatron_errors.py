"""User-facing errors of the megatron engine, the registry entry, and rank failure handling."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import OPTIM, make_batch, pg_loss  # noqa: E402

from flowrl.engines.base import EngineConfigError, EngineError, TrainEngine  # noqa: E402
from flowrl.engines.megatron import ConversionError, MegatronRankError, MegatronTrainEngine  # noqa: E402
from flowrl.engines.registry import make_train_engine  # noqa: E402
from flowrl.engines.torch_train import TorchTrainEngine  # noqa: E402


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 4}, "num_key_value_heads=2 is not divisible by tp=4"),
        ({"pp": 3}, "num_hidden_layers=2 is not divisible by pp=3"),
        ({"role": "judge"}, "role='judge' is not a train-engine role"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"dp": 0}, "dp=0: each of tp, pp, dp, cp and ep must be an integer >= 1"),
        ({"dtype": "float64"}, "dtype=.float64. is not supported"),
        ({"precision": "half"}, "precision=.half. is not supported"),
        ({"dtype": "bfloat16", "precision": "pure"}, "fp32 main params.*E616"),
    ],
)
def test_bad_options_fail_before_any_process_starts(tiny_dir, kwargs, message):
    with pytest.raises(EngineConfigError, match=message):
        MegatronTrainEngine(tiny_dir, **kwargs)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(EngineConfigError, match="is not a directory"):
        MegatronTrainEngine(str(tmp_path / "nope"))
    with pytest.raises(ConversionError, match="no config.json"):
        MegatronTrainEngine(str(tmp_path))


def test_registry_builds_the_engine_and_errors_keep_it_usable(tiny_dir, tmp_path):
    eng = make_train_engine("megatron", model_path=tiny_dir, optim=OPTIM, temperature=1.0, seed=0)
    try:
        assert isinstance(eng, MegatronTrainEngine) and isinstance(eng, TrainEngine)
        batch = make_batch()
        with pytest.raises(EngineConfigError, match="values=True asked of an actor"):
            eng.forward(batch, values=True)
        # The loss function's own error comes back from the rank with its type and message.
        bad_loss = lambda out, mb, denom: out["logprobs"]  # noqa: E731  (not a scalar)
        with pytest.raises(EngineConfigError, match=r"loss_fn returned \(2, 12\)"):
            eng.train_step(batch, bad_loss, micro_batch_size=2)
        before = eng.forward(batch)["logprobs"]
        stats = eng.train_step(batch, pg_loss, micro_batch_size=2)  # still usable
        assert stats["step"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))
        after = eng.forward(batch)["logprobs"]
        assert not torch.equal(after, before)
        eng.save(str(tmp_path))
        # The exported transformers checkpoint (trained weights) loads in transformers and agrees.
        eng.save_pretrained(str(tmp_path / "hf"))
        hf = TorchTrainEngine(str(tmp_path / "hf")).forward(batch)["logprobs"]
        # Two implementations of one model (Megatron's fused QKV and vocab-parallel logits against
        # transformers) in fp32: log-probs of magnitude ~10 agree to a few 1e-6; 1e-4 is the
        # project's engine-vs-engine bound (vLLM against the trainer, too).
        assert float((hf - after).abs().max()) <= 1e-4
    finally:
        eng.shutdown()
    with MegatronTrainEngine(tiny_dir, role="critic") as critic:
        with pytest.raises(EngineConfigError, match="holds role=.actor. with layout"):
            critic.load(str(tmp_path))
        with pytest.raises(EngineError, match="no Megatron engine checkpoint"):
            critic.load(str(tmp_path / "missing"))


def test_a_dead_rank_stops_the_engine_with_a_clear_error(tiny_dir):
    eng = MegatronTrainEngine(tiny_dir, dp=2, timeout_s=60)
    try:
        pids = [p.pid for p in eng._group.procs]
        assert [w["pid"] for w in eng.rank_locations()] == pids  # rank order
        eng._group.procs[1].kill()
        eng._group.procs[1].join()
        with pytest.raises(MegatronRankError, match="rank process died during forward") as info:
            eng.forward(make_batch())
        assert info.value.dead_ranks == (eng._group.procs[1].name,)  # the runtime's EngineDied names it
        assert not any(p.is_alive() for p in eng._group.procs)
    finally:
        eng.shutdown()
