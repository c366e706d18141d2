"""megatron(tp=2) on 2 gloo ranks: same step as tp=1 and as the torch engine; HF round trip exact."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import assert_same_step, run_megatron  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def tp2(tiny_dir):
    return run_megatron(tiny_dir, tp=2)


def test_tp1_matches_torch_engine(megatron_tp1, torch_reference):
    assert_same_step(megatron_tp1, torch_reference)


def test_tp2_matches_tp1_and_torch_engine(tp2, megatron_tp1, torch_reference):
    assert_same_step(tp2, megatron_tp1)
    assert_same_step(tp2, torch_reference)


def test_hf_to_megatron_tp2_to_hf_is_bit_exact(tp2, tiny_dir):
    """Weights loaded into the sharded model and gathered back equal the checkpoint bit for bit."""
    hf = load_file(f"{tiny_dir}/model.safetensors")
    assert sorted(tp2.initial) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(tp2.initial[name], tensor), name


def test_the_step_changed_the_weights(tp2):
    moved = {k: float((tp2.weights[k] - tp2.initial[k]).abs().max()) for k in tp2.initial}
    assert all(v > 0 for v in moved.values())


def test_qwen2_with_qkv_bias_and_tied_embeddings_tp2(tmp_path):
    """Qwen2 (q/k/v biases) with tied embeddings: tp=2 forward and one step match the torch engine."""
    from mcore_cases import OPTIM, TOL, assert_close, make_batch, pg_loss
    from transformers import Qwen2ForCausalLM

    from flowrl.engines.megatron import MegatronTrainEngine
    from flowrl.engines.torch_train import TorchTrainEngine
    from flowrl.models.tiny import tiny_config

    config = tiny_config(17, arch="qwen2")
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(config)
        for name, p in model.named_parameters():  # transformers zero-inits biases: make them matter
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
    model.save_pretrained(tmp_path)
    batch = make_batch(seed=4)
    ref = TorchTrainEngine(str(tmp_path), optim=OPTIM)
    ref_out = ref.forward(batch, entropy=True)
    ref_stats = ref.train_step(batch, pg_loss, micro_batch_size=4)
    with MegatronTrainEngine(str(tmp_path), optim=OPTIM, tp=2) as eng:
        out = eng.forward(batch, entropy=True)
        stats = eng.train_step(batch, pg_loss, micro_batch_size=4)
        weights = dict(eng.named_weights())
    assert_close(out, ref_out)
    assert abs(stats["loss"] - ref_stats["loss"]) <= TOL and abs(stats["grad_norm"] - ref_stats["grad_norm"]) <= TOL
    ref_weights = dict(ref.model.named_parameters())  # tied: lm_head is the embedding
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert_close({k: weights[k] for k in ref_weights}, {k: v.detach() for k, v in ref_weights.items()})
